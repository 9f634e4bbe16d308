"""The offline API's engine client: the engine runs in the caller's process, one ``step()`` per call.

It takes the requests ``EngineCoreClient`` sends to the engine-core process and returns what that process sends
back, ``StepOutputs`` built by the same code (deltas.py), so ``LLM`` and the server read the same messages
through the same output processor. Errors are raised to the caller instead of sent as ``RequestFailed``: the
caller is right here, and the offline API has always raised them.
"""

from __future__ import annotations

from collections.abc import Collection

from cvllm.engine.llm_engine import LLMEngine
from cvllm.engine_process.deltas import DeltaBuilder, core_stats
from cvllm.engine_process.messages import StepOutputs
from cvllm.sampling_params import SamplingParams


class InProcessClient:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._deltas = DeltaBuilder(engine)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; a prompt or parameters the engine rejects raise ValueError here."""
        self.engine.add_request(request_id, prompt_token_ids, params)

    def abort(self, request_id: str, indices: Collection[int] | None = None) -> None:
        """Stop a request, or only its completions ``indices`` (those a stop string ended: their siblings go on,
        and in-process each one's compute is saved at once). Unknown or finished requests are ignored."""
        self._deltas.abort(request_id, indices)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> StepOutputs:
        """One engine step: every sequence's new tokens (none when the step only ran a prefill chunk)."""
        seqs = self.engine.step()
        deltas = self._deltas.deltas(seqs)
        self._deltas.release_finished(deltas)
        return StepOutputs(deltas, core_stats(self.engine))
