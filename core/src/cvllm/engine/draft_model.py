"""The draft model of draft-model speculation: a small model with the target's tokenizer, in the engine's process on the
same backend, that proposes K tokens greedily per speculating sequence (speculative.py verifies them).

Its KV cache mirrors the target's: as many blocks of the same size, addressed by the target's block tables and slots.
So the target's block manager does all the bookkeeping, and prefix-cache hits, preemption and the rollback of rejected
drafts (``num_computed_tokens`` lowered) need nothing of their own. Two things keep the mirror true:

- every batch the target runs, the draft runs as well (``shadow``: its forward pass on the same input tensors, no LM
  head), so a block the target has computed holds the draft's KV of the same tokens: a prefix-cache hit finds both;
- ``propose`` runs K + 1 decode rounds over the speculating sequences, batched: round j feeds position L - 1 + j
  (the last token, then draft j, taken from round j - 1's argmax on the device) and its argmax is draft j + 1; the
  last round only writes draft K's KV. The draft's cache then covers the whole verify chunk, so the shadow of the
  verify step leaves those sequences out. The drafts come back to the host in one read.

A slot past ``num_computed_tokens`` is never read before it is written again, so the KV of rejected drafts needs no
cleanup. The cost: the draft's KV per block comes out of the KV pool (fewer blocks for the same memory), and its
forward pass runs with every step, speculating or not (a decode-only one as a CUDA graph where the backend has them).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from cvllm import plugins
from cvllm.checkpoint.base import Checkpoint
from cvllm.engine.model_runner import ModelRunner, build_model
from cvllm.engine.sampler import torch_argmax
from cvllm.engine.scheduler import ScheduledBatch
from cvllm.engine.speculative import SpeculativeConfig
from cvllm.engine.step_inputs import PreviousTokens
from cvllm.forward_context import forward_context
from cvllm.layers.kv_fp8 import kv_cache_torch_dtype

logger = logging.getLogger(__name__)

# encoded by both tokenizers at start: the same ids, or the drafts would be another language to the target
TOKENIZER_PROBE = "Speculative decoding: 12 drafts, 3 accepted. def f(x):\n    return x * 2  # ok?"


class ProposalRow:
    """A speculating sequence as one of ``propose``'s rows reads it: its tokens, its block table, and the position
    that the current round feeds (``num_computed_tokens``)."""

    __slots__ = ("seq_id", "token_ids", "block_table", "num_computed_tokens")
    num_drafts = 0

    def __init__(self, seq):
        self.seq_id, self.token_ids, self.block_table = seq.seq_id, seq.token_ids, seq.block_table
        self.num_computed_tokens = 0


class DraftModel:
    def __init__(self, runner: ModelRunner, argmax=None, max_model_len: int = 0):
        """``runner``: the draft's model runner (its model and KV cache); ``argmax``: the backend's kernel where it
        has one; ``max_model_len``: the draft's context (the target's may not be longer)."""
        self.runner = runner
        self.argmax = argmax or torch_argmax
        self.max_model_len = max_model_len

    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def capture_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        self.runner.enable_decode_graphs(max_num_seqs, max_model_len)

    @torch.inference_mode()
    def shadow(self, batch: ScheduledBatch, inputs, previous_tokens=None) -> None:
        """The draft's KV for what the target's forward pass over ``batch`` (on ``inputs``, its prepared tensors)
        wrote, except for the sequences verifying drafts: ``propose`` wrote theirs."""
        if not batch.num_draft_chunk_tokens:
            input_ids, positions, ctx, _ = inputs
            self._forward(input_ids, positions, ctx)
            return
        rest = [i for i, seq in enumerate(batch.seqs) if not seq.num_drafts]
        if rest:
            num_tokens = [batch.num_tokens[i] for i in rest]
            decode_only = all(n == 1 for n in num_tokens)
            sub = ScheduledBatch([batch.seqs[i] for i in rest], num_tokens,
                                 num_prefill_tokens=0 if decode_only else sum(num_tokens))
            input_ids, positions, ctx, _ = self.runner.prepare(sub, previous_tokens)
            self._forward(input_ids, positions, ctx)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> None:
        # a context of its own: what layers cache in it per forward pass (rotary tables, the backend's plan) is the
        # target's
        ctx = dataclasses.replace(ctx, backend_data=None, per_step={})
        if ctx.is_decode_only:   # the draft's decode graphs (its LM head runs as well, for nothing)
            self.runner.decode_forward(input_ids, positions, ctx)
            return
        with forward_context(ctx):
            self.runner.backend.prepare(ctx)
            self.runner.model(input_ids, positions)

    @torch.inference_mode()
    def propose(self, seqs: list, ks: list[int]) -> list[list[int]]:
        """``ks[i]`` greedy drafts for each sequence ``seqs[i]``, whose last token is the first not in the cache
        and whose block table covers its tokens and ``ks[i]`` more."""
        rows = [ProposalRow(seq) for seq in seqs]
        rounds = []   # (argmax ids [B_j] on the device, seq_id -> row) of each round that proposes
        previous = None
        for j in range(max(ks) + 1):
            live = [row for row, k in zip(rows, ks) if j <= k]
            for row in live:
                row.num_computed_tokens = len(row.token_ids) - 1 + j
            batch = ScheduledBatch(live, [1] * len(live), num_decodes=len(live), sample_indices=list(range(len(live))))
            ids = self.argmax(self.runner.run(batch, previous_tokens=previous))
            previous = PreviousTokens(ids, {row.seq_id: i for i, row in enumerate(live)})
            rounds.append(previous)
        host = torch.cat([round_.ids for round_ in rounds[:-1]]).tolist()   # the last round only wrote KV
        starts = [0]
        for round_ in rounds[:-1]:
            starts.append(starts[-1] + round_.ids.shape[0])
        return [[host[starts[j] + rounds[j].rows[row.seq_id]] for j in range(k)] for row, k in zip(rows, ks)]

    def shutdown(self) -> None:
        self.runner = None


def build_draft(config, checkpoint: Checkpoint, backend, dtype: torch.dtype) -> DraftModel | None:
    """The draft model ``config.speculative_config`` names (None for any other method), built and loaded as the
    target is, in the target's dtype and KV cache dtype. Refused: a vocabulary other than the target's."""
    spec = SpeculativeConfig.from_dict(config.speculative_config)
    if spec is None or spec.method != "draft_model":
        return None
    if config.tensor_parallel_size > 1:
        raise ValueError("speculative_config: the draft_model method does not run with tensor parallelism yet; use "
                         "the ngram method, or tensor_parallel_size 1")
    if config.fake_step_ms is not None:
        raise ValueError("speculative_config: the draft_model method needs a model (not fake steps)")
    draft = spec.model if isinstance(spec.model, Checkpoint) else plugins.open_checkpoint(str(spec.model))
    check_vocabulary(checkpoint, draft)
    runner = ModelRunner(build_model(draft, backend, dtype), backend, config.block_size, dtype,
                         kv_cache_torch_dtype(config.kv_cache_dtype, dtype))
    context = draft.config.get("max_position_embeddings") or 2048
    logger.info("speculative decoding: draft model %s (%s), %d tokens per step", draft.path, draft.architecture,
                spec.num_speculative_tokens)
    return DraftModel(runner, backend.argmax, context)


def check_vocabulary(target: Checkpoint, draft: Checkpoint) -> None:
    """The draft must speak the target's token ids: the same vocabulary size (else refused), and where both have
    tokenizers, the same encoding of a probe text (else a warning: its drafts would rarely be accepted)."""
    sizes = target.config.vocab_size, draft.config.vocab_size
    if sizes[0] != sizes[1]:
        raise ValueError(f"speculative_config: the draft model {draft.path} has a vocabulary of {sizes[1]} tokens and "
                         f"the target {target.path} one of {sizes[0]}: a draft model must use the target's tokenizer")
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.encode(TOKENIZER_PROBE, False) != draft.tokenizer.encode(TOKENIZER_PROBE, False):
            logger.warning("speculative_config: the draft model %s tokenizes text differently from the target %s; "
                           "its drafts will rarely be accepted", draft.path, target.path)
