"""Which steps take the model runner's ``decode_forward`` (CUDA graphs where the backend has them): decode steps,
uniform verify steps, and the last prefill chunk of a lone sequence no longer than the graphs' chunks
(model_runner.is_decode_path); never a step that needs more rows' logits than its samples'."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cvllm.engine.model_runner import is_decode_path
from cvllm.engine.scheduler import ScheduledBatch


def seq(num_drafts: int = 0):
    return SimpleNamespace(num_drafts=num_drafts)


def prefill(*lengths: int, sampling: bool = True) -> ScheduledBatch:
    return ScheduledBatch([seq() for _ in lengths], list(lengths), num_prefill_tokens=sum(lengths),
                          sample_indices=list(range(len(lengths))) if sampling else [])


def ctx(batch: ScheduledBatch):
    decode_only = batch.num_decodes == len(batch.seqs)
    return SimpleNamespace(is_decode_only=decode_only, max_query_len=max(batch.num_tokens))


@pytest.mark.parametrize("length, chunk_tokens, taken", [
    (12, 64, True), (64, 64, True), (65, 64, False), (1, 64, True), (12, 0, False),
])
def test_a_lone_last_chunk_takes_the_graphs_up_to_their_length(length, chunk_tokens, taken):
    batch = prefill(length)
    assert is_decode_path(batch, ctx(batch), False, None, chunk_tokens) is taken


def test_chunks_that_need_other_rows_or_share_the_step_run_eagerly():
    lone = prefill(12)
    assert not is_decode_path(lone, ctx(lone), True, None, 64)                          # every row's logits
    assert not is_decode_path(lone, ctx(lone), False, torch.tensor([3]), 64)            # prompt logprobs
    middle = prefill(12, sampling=False)                                                # not its last chunk
    assert not is_decode_path(middle, ctx(middle), False, None, 64)
    two = prefill(12, 7)
    assert not is_decode_path(two, ctx(two), False, None, 64)
    mixed = ScheduledBatch([seq(), seq()], [1, 12], num_prefill_tokens=12, num_decodes=1, sample_indices=[0, 1])
    assert not is_decode_path(mixed, ctx(mixed), False, None, 64)


def test_decode_and_uniform_verify_steps_take_them_as_before():
    decode = ScheduledBatch([seq(), seq()], [1, 1], num_decodes=2, sample_indices=[0, 1])
    assert is_decode_path(decode, ctx(decode), False, None)
    verify = ScheduledBatch([seq(4), seq(4)], [5, 5], num_prefill_tokens=10, num_draft_chunk_tokens=10,
                            sample_indices=[0, 1])
    assert is_decode_path(verify, ctx(verify), False, None)
    ragged = ScheduledBatch([seq(4), seq(2)], [5, 3], num_prefill_tokens=8, num_draft_chunk_tokens=8,
                            sample_indices=[0, 1])
    assert not is_decode_path(ragged, ctx(ragged), False, None, 64)
