"""An engine step's results as the messages every engine client reads: what each sequence gained since it was
last reported (``SeqDelta``) and the core's counters (``CoreStats``).

Shared by the engine-core process (process.py), which sends them over its pipe, and the in-process client
(inprocess_client.py), which hands them to the offline API: both front-ends read the same messages.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

from cvllm.engine_process.messages import CoreStats, SeqDelta, TokenLogprobs

if TYPE_CHECKING:
    from cvllm.engine.llm_engine import LLMEngine
    from cvllm.engine.sequence import Sequence
    from cvllm.outputs import Logprob


class DeltaBuilder:
    """The new tokens of each sequence a step returned; remembers, per sequence, how many were reported."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._sent: dict[int, int] = {}   # seq_id -> output tokens already reported (the next delta starts there)

    def deltas(self, seqs: Iterable[Sequence]) -> list[SeqDelta]:
        out = []
        sent_counts = self._sent
        for seq in seqs:   # once per generated token: the usual case (a later token, no logprobs) kept short
            sent = sent_counts.get(seq.seq_id)
            if sent is None or seq.logprobs is not None:
                out.append(self._delta(seq))
                continue
            new_tokens = seq.token_ids[seq.num_prompt_tokens + sent:]
            sent_counts[seq.seq_id] = sent + len(new_tokens)
            finish_reason = seq.finish_reason
            stop_reason = None if finish_reason is None else _stop_token(seq.stop_reason)
            out.append(SeqDelta(seq.request_id, seq.index, new_tokens, None, finish_reason, stop_reason,
                                seq.num_prompt_tokens))
        return out

    def resumed(self, seqs: Iterable[Sequence]) -> None:
        """Sequences that continue a dead core's output (``Sequence.resume``): what they hold was reported."""
        for seq in seqs:
            if seq.num_output_tokens:
                self._sent[seq.seq_id] = seq.num_output_tokens

    def release_finished(self, deltas: Iterable[SeqDelta]) -> None:
        """After a step's deltas were built: forget the requests whose every completion has now finished, here
        and in the engine."""
        requests = self.engine.requests
        for request_id in {delta.request_id for delta in deltas if delta.finish_reason is not None}:
            if all(seq.is_finished for seq in requests.get(request_id, ())):
                self.forget(request_id)
                self.engine.release_request(request_id)

    def abort(self, request_id: str, indices: Collection[int] | None = None) -> None:
        """Stop a request in the engine, or only its completions ``indices`` (those a stop string ended: their
        blocks are freed at once and their siblings go on; the request is released once they have all ended).
        Unknown or finished requests are ignored."""
        seqs = self.engine.requests.get(request_id, ())
        if indices is None or all(seq.is_finished or seq.index in indices for seq in seqs):
            self.forget(request_id)
            self.engine.abort_request(request_id)
            return
        for seq in seqs:
            if seq.index in indices:
                self.engine.finish_sequence(seq, "abort")

    def forget(self, request_id: str) -> None:
        """Stop tracking a request (finished, aborted or failed)."""
        for seq in self.engine.requests.get(request_id, ()):
            self._sent.pop(seq.seq_id, None)

    def _delta(self, seq: Sequence) -> SeqDelta:
        sent = self._sent.get(seq.seq_id, 0)
        new_tokens = seq.token_ids[seq.num_prompt_tokens + sent:]
        self._sent[seq.seq_id] = sent + len(new_tokens)
        logprobs = None
        if seq.logprobs is not None:
            logprobs = [token_logprobs(entry, token) for entry, token in zip(seq.logprobs[sent:], new_tokens)]
        prompt_logprobs = None
        raw_prompt_logprobs = getattr(seq, "prompt_logprobs", None)
        if sent == 0 and raw_prompt_logprobs is not None:
            prompt_ids = seq.token_ids[:seq.num_prompt_tokens]
            prompt_logprobs = [None if entry is None else token_logprobs(entry, token)
                               for entry, token in zip(raw_prompt_logprobs, prompt_ids)]
        stop_reason = _stop_token(seq.stop_reason)
        num_cached_tokens = (seq.num_cached_tokens or 0) if sent == 0 else 0
        return SeqDelta(seq.request_id, seq.index, new_tokens, logprobs, seq.finish_reason, stop_reason,
                        seq.num_prompt_tokens, prompt_logprobs, num_cached_tokens)


def _stop_token(stop_reason: int | str | None) -> int | None:
    """The stop reason as the core reports it: a stop token id only (stop strings are the output processor's)."""
    return stop_reason if isinstance(stop_reason, int) else None


def token_logprobs(entry: dict[int, Logprob], token_id: int) -> TokenLogprobs:
    """One position's logprobs as sent: the chosen token's, then the top-k in rank order."""
    top_ids, top_logprobs = [], []
    for top_id, lp in entry.items():   # the engine writes the top-k in rank order: no sort then
        if lp.rank is not None:
            if lp.rank != len(top_ids) + 1:
                break
            top_ids.append(top_id)
            top_logprobs.append(lp.logprob)
    else:
        return TokenLogprobs(entry[token_id].logprob, top_ids, top_logprobs)
    ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank is not None)
    return TokenLogprobs(entry[token_id].logprob, [tid for _, tid, _ in ranked], [lp for _, _, lp in ranked])


def core_stats(engine: LLMEngine) -> CoreStats:
    scheduler = engine.scheduler
    blocks = scheduler.block_manager
    counters = scheduler.stats
    return CoreStats(running=len(scheduler.running), waiting=len(scheduler.waiting),
                     kv_blocks_total=blocks.num_blocks, kv_blocks_free=blocks.num_free_blocks,
                     steps=counters.steps, preemptions=counters.preemptions,
                     prefix_hit_tokens=counters.prefix_hit_tokens,
                     prompt_tokens_computed=counters.prompt_tokens_computed,
                     generated_tokens=counters.generated_tokens, spec_draft_tokens=counters.spec_draft_tokens,
                     spec_accepted_tokens=counters.spec_accepted_tokens,
                     spec_verifications=counters.spec_verifications)
