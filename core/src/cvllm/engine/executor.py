"""The engine's model workers, behind one interface: what a step needs from whatever runs the model.

The engine keeps the scheduling and the async overlap of steps (llm_engine.py); an executor runs the batches it
is given — the forward pass and sampling on the device — and keeps the per-sequence device state (penalty
histories). One worker in the engine's own process now (InProcessExecutor); the tensor parallel executor, one
worker process per device, implements the same methods.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cvllm.engine.ngram_device import NgramHistory
from cvllm.engine.observers import StepRecord
from cvllm.engine.penalties import PenaltyHistory
from cvllm.engine.prompt_logprobs import prompt_logprob_rows, record_prompt_logprobs
from cvllm.engine.scheduler import ScheduledBatch
from cvllm.engine.sequence import Sequence
from cvllm.engine.speculative import sampler_rows
from cvllm.engine.step_inputs import PreviousTokens
from cvllm.engine.upload import upload


@dataclass(slots=True)
class ForwardedStep:
    """A batch whose forward pass is launched and whose sampling is not."""
    sampling: list[Sequence]
    logits: torch.Tensor            # [len(sampling) + drafts, V], on the device
    scoring: bool
    speculative: bool               # some sampling sequence verifies drafts (its 1 + K positions are rows)
    num_drafts: list[int] | None = None   # each sampling sequence's drafts when it was forwarded (speculative)
    # a step whose next inputs the device computes (ScheduledBatch.device_drafts): its input ids and positions
    inputs: tuple[torch.Tensor, torch.Tensor] | None = None
    lagged: bool = False

    def sampler_rows(self) -> list:
        """The sampler's rows: a sequence verifying K drafts has K + 1 (speculative.py)."""
        return sampler_rows(self.sampling, self.num_drafts) if self.num_drafts else self.sampling


@dataclass(slots=True)
class LaunchedStep:
    """A launched step whose sampled tokens may still be on the device."""
    sampling: list[Sequence]        # the sequences that sampled, in the order of the readback's rows
    out: object | None              # the executor's handle on the sampled ids (the next step's decode rows read them)
    # waits for the sampled ids' copy to the host: [token ids] or [token ids, logprobs, top ids, top logprobs]
    readback: Callable[[], list[torch.Tensor]] | None
    scoring: bool                   # it recorded prompt logprobs (such steps finish at once)
    speculative: bool = False       # it verifies drafts: 1 + K rows for a speculating sequence
    num_drafts: list[int] | None = None       # each sampling sequence's drafts (None: none has any)
    drafts: list[list[int]] | None = None     # ... their tokens, taken off the sequences once launched (speculator.py)
    # sequences whose rows are void: the step was launched on a wrong guess of the previous one's outcome
    void: set[int] = field(default_factory=set)
    # the next step's input ids and positions, flat, as the device computed them from this verify step's outcome
    # (ngram_device.py); its readback's last tensor is then the drafts it verified (the host may not know them)
    feed: tuple[torch.Tensor, torch.Tensor] | None = None
    lagged: bool = False            # its inputs came from the step before's feed (ScheduledBatch.lagged)

    def rows(self):
        """(sequence, its first row, the row after its last, its drafts) per sampling sequence, in row order."""
        row = 0
        for j, seq in enumerate(self.sampling):
            drafts = self.drafts[j] if self.drafts else []
            k = self.num_drafts[j] if self.num_drafts else 0
            yield seq, row, row + 1 + k, drafts
            row += 1 + k

    def fill_rows(self) -> dict[int, int]:
        """seq_id -> the row of its next token were every draft accepted: what the next step's decode rows whose
        last token is still on the device read (async scheduling)."""
        return {seq.seq_id: end - 1 for seq, _, end, _ in self.rows()}

    def feed_rows(self) -> dict[int, int]:
        """seq_id -> its first row in ``feed``: a lagged step's chunk takes its inputs from there on."""
        return {seq.seq_id: first for seq, first, _, _ in self.rows()}


class Executor:
    """What the engine asks of its model workers."""

    # the draft model of draft-model speculation (draft_model.py), run beside the model; None: none
    draft = None
    # whether n-gram drafts may be looked up on the device (ngram_device.py; ``enable_device_drafts``)
    supports_device_drafts = False

    def kv_bytes_per_block(self) -> int:
        """Device bytes of one KV block (block_size tokens of every attention layer a worker holds)."""
        raise NotImplementedError

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of device memory after loading the model; with several workers, the least free."""
        raise NotImplementedError

    def allocate_kv_cache(self, num_blocks: int) -> None:
        raise NotImplementedError

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, verify_seqs: int = 0,
                       verify_query_len: int = 1, chunk_tokens: int = 0) -> None:
        """Let the backend capture decode-only steps (CUDA graphs); called once, after the KV cache exists. With
        speculative decoding, also verify steps of up to ``verify_seqs`` sequences of up to ``verify_query_len``
        queries (a token and its drafts) each; and a lone sequence's prefill chunks of up to ``chunk_tokens``."""

    def execute(self, batch: ScheduledBatch, previous: LaunchedStep | None,
                record: StepRecord | None = None) -> LaunchedStep:
        """Forward ``batch`` and sample its sampling sequences, reading nothing back to the host (prompt
        logprobs excepted: they are recorded on the sequences). ``previous``: the step still in flight, whose
        sampled ids are the input of this batch's decode rows whose last token the host does not know yet.
        ``record``: the observed step's record, to mark phases in; None (nobody observes) must cost nothing."""
        return self.sample(self.forward(batch, previous, record), None, record)

    def forward(self, batch: ScheduledBatch, previous: LaunchedStep | None,
                record: StepRecord | None = None) -> ForwardedStep:
        """``execute``'s first half: the forward pass launched, nothing sampled yet (the engine computes grammar
        masks meanwhile)."""
        raise NotImplementedError

    def sample(self, step: ForwardedStep, allowed: tuple[list[int], torch.Tensor] | None,
               record: StepRecord | None = None) -> LaunchedStep:
        """``execute``'s second half. ``allowed``: (rows, int32 bitmask on the host) of the sampling rows whose
        grammar restricts their next token (structured_output/grammar.py)."""
        raise NotImplementedError

    def prompt_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """fp32 logits of every token of ``batch`` (scoring: LLMEngine.prompt_logits)."""
        raise NotImplementedError

    def prompt_hidden(self, batch: ScheduledBatch) -> torch.Tensor:
        """fp32 final hidden states (after the last norm, before the LM head) of every token of ``batch``, on the
        device (embeddings: engine/embedding.py)."""
        raise NotImplementedError

    def enable_device_drafts(self, num_rows: int, max_len: int, min_n: int, max_n: int) -> None:
        """Keep up to ``num_rows`` sequences' tokens (``max_len`` each) on the device for n-gram lookups there, with
        suffixes of ``min_n``..``max_n`` tokens: the steps marked ``device_drafts`` compute the next one's inputs."""
        raise NotImplementedError

    def propose_drafts(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """The draft model's ``ks[i]`` greedy drafts for each ``seqs[i]`` (draft_model.py)."""
        return self.draft.propose(seqs, ks)

    def release(self, seq_id: int) -> None:
        """Sequence ``seq_id`` ended: free what the workers keep for it."""

    def synchronize(self) -> None:
        """Wait until every launched step has run."""

    def sentinels(self) -> list[int]:
        """Handles (``multiprocessing.connection.wait``) that become ready when a worker process ends: the engine
        core's idle wait watches them. None for workers in the engine's own process."""
        return []

    def check(self) -> None:
        """Raise ``EngineBrokenError`` (engine/errors.py) if a worker has died."""

    def shutdown(self) -> None:
        """Free the model, its KV cache and graphs; nothing runs afterwards."""


class InProcessExecutor(Executor):
    """One worker in the engine's process: a model runner (ModelRunner, or FakeModelRunner without a model) and
    the sampler, on the backend's device."""

    def __init__(self, runner, sampler, backend, vocab_size: int, draft=None):
        self.runner = runner
        self.sampler = sampler
        self.backend = backend
        self.draft = draft
        # token counts of penalised sequences, on the device: penalties need no host token list (penalties.py)
        self.penalties = PenaltyHistory(vocab_size, backend.device)
        self.ngram: NgramHistory | None = None   # (enable_device_drafts)
        self._ngram_lookup = (1, 1)

    @property
    def supports_device_drafts(self) -> bool:
        # a runner that computes from its inputs (ModelRunner says whether its layers read sequence lengths on the
        # host; fake steps do not say), and layers that read them on the device only: a lagged step's host lengths
        # are a step behind (the CPU's are set right: step_inputs.to_device)
        reads_host_lengths = getattr(self.runner, "reads_host_lengths", None)
        return reads_host_lengths is not None and (self.backend.device.type == "cpu" or not reads_host_lengths)

    def enable_device_drafts(self, num_rows: int, max_len: int, min_n: int, max_n: int) -> None:
        self.ngram = NgramHistory(num_rows, max_len, self.backend.device)
        self._ngram_lookup = (min_n, max_n)

    def kv_bytes_per_block(self) -> int:
        # a draft model's cache has as many blocks as the model's (draft_model.py): a block costs both
        return self.runner.kv_bytes_per_block() + (self.draft.kv_bytes_per_block() if self.draft else 0)

    def memory(self) -> tuple[int, int]:
        return self.backend.memory()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        if self.draft is not None:
            self.draft.allocate_kv_cache(num_blocks)

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, verify_seqs: int = 0,
                       verify_query_len: int = 1, chunk_tokens: int = 0) -> None:
        self.runner.enable_decode_graphs(max_num_seqs, max_model_len, verify_seqs, verify_query_len, chunk_tokens)
        if self.draft is not None:
            self.draft.capture_graphs(max_num_seqs, max_model_len)

    def forward(self, batch: ScheduledBatch, previous: LaunchedStep | None,
                record: StepRecord | None = None) -> ForwardedStep:
        sampling = [batch.seqs[i] for i in batch.sample_indices]
        scoring, extra = prompt_logprob_rows(batch)
        previous_tokens = None
        if previous is not None and previous.out is not None:
            if batch.lagged:   # every input of its chunks is on the device (ngram_device.py)
                previous_tokens = PreviousTokens(previous.feed[0], previous.feed_rows(), previous.feed[1])
            else:
                previous_tokens = PreviousTokens(previous.out.token_ids, previous.fill_rows())
        inputs = None
        if record is None and self.draft is None and not batch.device_drafts:
            logits = self.runner.run(batch, extra_indices=extra, previous_tokens=previous_tokens)
        else:
            logits, inputs = self._observed_forward(batch, extra, previous_tokens, record)
        speculative = batch.num_draft_chunk_tokens > 0
        num_drafts = [seq.num_drafts for seq in sampling] if speculative else None
        if scoring:
            num_rows = len(sampling) + sum(num_drafts or ())
            record_prompt_logprobs(batch, scoring, logits[num_rows:])
            logits = logits[:num_rows]
        return ForwardedStep(sampling, logits, bool(scoring), speculative, num_drafts,
                             inputs[:2] if batch.device_drafts else None, batch.lagged)

    def sample(self, step: ForwardedStep, allowed: tuple[list[int], torch.Tensor] | None,
               record: StepRecord | None = None) -> LaunchedStep:
        sampling = step.sampling
        if allowed is not None:
            rows, bits = allowed
            device = self.backend.device
            allowed = (upload(torch.tensor(rows), device), upload(bits, device))   # no wait for the device
        out = self.sampler(step.logits, step.sampler_rows(), history=self.penalties, allowed=allowed) \
            if sampling else None
        readback = feed = None
        if out is not None:   # queued now, so reading it back later does not wait for the next step
            ids = out.token_ids if out.reported_ids is None else out.reported_ids   # -1: a row's logits were not finite
            wanted = [ids] if out.logprobs is None else [ids, out.logprobs, out.top_ids, out.top_logprobs]
            if step.inputs is not None:
                feed, drafts = self._advance_drafts(step, out.token_ids)
                wanted.append(drafts)
            readback = self.backend.start_readback(wanted)
        if record is not None:
            record.mark("sample")
            record.device_mark(self.backend, "sampled")
        return LaunchedStep(sampling, out, readback, step.scoring, step.speculative, step.num_drafts, feed=feed,
                            lagged=step.lagged)

    def _advance_drafts(self, step: ForwardedStep, sampled: torch.Tensor
                        ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """A device-drafted verify step's outcome and the next step's inputs, computed on the device
        (ngram_device.advance_ngram): (next ids, next positions) flat, and the drafts verified (for the host). A
        sequence's tokens go to the device where it starts (its step not lagged: all its tokens on the host)."""
        ngram = self.ngram
        k = step.num_drafts[0]
        if not step.lagged:
            keep = {seq.seq_id for seq in step.sampling}
            for seq_id in [s for s in ngram.rows if s not in keep]:
                ngram.release(seq_id)
            for seq in step.sampling:
                ngram.load(ngram.row(seq.seq_id), seq.token_ids[:len(seq.token_ids) - k])
        rows = ngram.rows_tensor([seq.seq_id for seq in step.sampling])
        ids, positions = step.inputs
        chunks = ids.view(-1, k + 1)
        drafts = chunks[:, 1:]
        next_ids, next_positions = self.backend.advance_ngram(
            sampled.view(-1, k + 1), drafts, positions.view(-1, k + 1)[:, 0], rows, ngram.history, ngram.lengths,
            *self._ngram_lookup)
        return (next_ids.view(-1), next_positions.view(-1)), drafts.reshape(-1)

    @torch.inference_mode()
    def _observed_forward(self, batch: ScheduledBatch, extra: torch.Tensor | None,
                          previous_tokens: PreviousTokens | None, record: StepRecord | None) -> tuple:
        """``ModelRunner.run`` in its two halves, with the marks between them (``record`` None: no marks), then
        the draft model's forward on the same inputs (its KV cache mirrors the model's: draft_model.py). Returns
        the logits and the inputs."""
        if record is not None:
            record.device_mark(self.backend, "launch")
        inputs = self.runner.prepare(batch, previous_tokens)
        if record is not None:
            record.mark("prepare")
            record.device_mark(self.backend, "forward")
        logits = self.runner.forward(batch, inputs, extra_indices=extra)
        if self.draft is not None:
            self.draft.shadow(batch, inputs, previous_tokens)
        if record is not None:
            record.mark("forward")
            record.device_mark(self.backend, "forwarded")
        return logits, inputs

    def prompt_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        return self.runner.run(batch, all_logits=True)

    def prompt_hidden(self, batch: ScheduledBatch) -> torch.Tensor:
        hidden_states = getattr(self.runner, "hidden_states", None)
        if hidden_states is None:   # FakeModelRunner (--fake-step-ms): there is no model
            raise ValueError("this engine runs no model (fake steps), so it cannot embed")
        return hidden_states(batch)

    def release(self, seq_id: int) -> None:
        self.penalties.release(seq_id)
        if self.ngram is not None:
            self.ngram.release(seq_id)

    def synchronize(self) -> None:
        self.backend.synchronize()

    def shutdown(self) -> None:
        if self.runner is None:
            return
        if self.draft is not None:
            self.draft.shutdown()
        self.runner = self.penalties = self.draft = None
        # the runner and its graphs reference each other (the graphs replay the runner's bound forward)
        gc.collect()
        self.backend.empty_cache()
