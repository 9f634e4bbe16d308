"""The CUDA graphs' shapes and input staging (cvllm_cuda/graphs.py), without a GPU: the ladders of decode batch sizes
and lone prefill chunks, and what a replay finds in the graphs' buffers (the graph itself stubbed: its replay is
the GPU suite's, test_chunk_graphs_gpu.py)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from cvllm.engine.step_inputs import HostStep, pack, to_device
from cvllm.forward_context import ForwardContext
from cvllm_cuda.graphs import DecodeGraphs, batch_size_ladder, chunk_ladder
from cvllm_cuda.staging import StepStaging


def test_batch_sizes_pad_at_most_seven_rows_above_eight():
    assert batch_size_ladder(256)[:6] == [1, 2, 4, 8, 16, 24] and batch_size_ladder(256)[-1] == 256
    assert batch_size_ladder(3) == [1, 2, 3]


@pytest.mark.parametrize("most, sizes", [
    (64, [8, 16, 32, 64]), (100, [8, 16, 32, 64, 100]), (16, [8, 16]), (5, [5]), (1, []), (0, []),
])
def test_chunk_lengths_double_from_eight_up_to_the_longest(most, sizes):
    assert chunk_ladder(most) == sizes


class Replayed:
    """A captured graph's stand-in: counts replays; its output rows are what the graph would return."""

    def __init__(self, rows: int):
        self.replays, self.out = 0, torch.arange(rows, dtype=torch.float32)[:, None]

    def replay(self) -> None:
        self.replays += 1


def staged_graphs(chunk_tokens: int = 64) -> DecodeGraphs:
    graphs = DecodeGraphs(None, SimpleNamespace(device=torch.device("cpu")), 4, 8, (4, 5), chunk_tokens)
    for key in [(size, q) for size, q in graphs.shapes]:
        graphs.graphs[key] = (stub := Replayed(key[0] * key[1]), stub.out)
    for q in graphs.chunk_sizes:
        graphs.chunk_graphs[q] = (stub := Replayed(q), stub.out)
    return graphs


def context(q_lens: list[int], context_len: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    rows = starts[-1]
    ctx = ForwardContext(
        backend=None, query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([context_len + q for q in q_lens], dtype=torch.int32),
        slot_mapping=torch.arange(100, 100 + rows), block_tables=torch.arange(1, 1 + blocks * len(q_lens),
                                                                             dtype=torch.int32).view(-1, blocks),
        query_start_loc_cpu=starts, query_lens_cpu=q_lens, seq_lens_cpu=[context_len + q for q in q_lens],
        max_query_len=max(q_lens), max_seq_len=context_len + max(q_lens), is_decode_only=max(q_lens) == 1)
    return torch.arange(7, 7 + rows), torch.arange(context_len, context_len + rows), ctx


def test_a_lone_chunk_is_staged_in_the_next_chunk_graph_with_spare_rows_writing_nothing():
    graphs = staged_graphs()
    graphs.slot_mapping.fill_(5)   # what an earlier, longer step left
    ids, positions, ctx = context([11], 40, 4)
    logits = graphs.prefill_chunk(ids, positions, ctx)
    assert graphs.chunk_graphs[16][0].replays == 1 and graphs.chunk_replays == 1
    assert logits.shape[0] == 11 and torch.equal(logits[:, 0], torch.arange(11.0))
    assert torch.equal(graphs.input_ids[:11], ids) and torch.equal(graphs.positions[:11], positions)
    assert torch.equal(graphs.slot_mapping[:11], ctx.slot_mapping)
    assert (graphs.slot_mapping[11:16] == -1).all()   # the spare rows write no KV
    assert graphs.chunk_start_loc.tolist() == [0, 11] and graphs.seq_lens[0] == 51
    assert torch.equal(graphs.block_tables[0, :4], ctx.block_tables[0])


def test_a_padded_verify_batch_is_staged_in_its_graph():
    graphs = staged_graphs()
    graphs.slot_mapping.fill_(5)
    ids, positions, ctx = context([5, 5, 5], 30, 3)   # three sequences verifying 4 drafts: the graph of 4
    graphs(ids, positions, ctx)
    assert graphs.graphs[4, 5][0].replays == 1 and graphs.verify_replays == 1
    assert torch.equal(graphs.input_ids[:15], ids) and torch.equal(graphs.slot_mapping[:15], ctx.slot_mapping)
    assert (graphs.slot_mapping[15:20] == -1).all() and graphs.seq_lens.tolist()[:4] == [35, 35, 35, 5]
    assert torch.equal(graphs.block_tables[:3, :3], ctx.block_tables)


def test_a_chunk_longer_than_the_graphs_runs_eagerly():
    graphs = staged_graphs(chunk_tokens=16)
    graphs.forward = lambda ids, positions, ctx: torch.full((ids.shape[0], 1), -1.0)
    ids, positions, ctx = context([17], 0, 2)
    assert (graphs.prefill_chunk(ids, positions, ctx) == -1).all() and graphs.chunk_replays == 0


def host_step(q_lens: list[int], context_len: int, blocks: int, num_fill: int = 0) -> HostStep:
    """A step's host tensors as build_host_step lays them out (packed), sequences of ``q_lens`` queries each."""
    starts = [0, *itertools.accumulate(q_lens)]
    rows, seqs = starts[-1], len(q_lens)
    seq_lens = [context_len + q for q in q_lens]
    tensors = [torch.arange(7, 7 + rows), torch.arange(context_len, context_len + rows),
               torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
               torch.arange(100, 100 + rows), torch.arange(1, 1 + blocks * seqs, dtype=torch.int32).view(seqs, blocks),
               torch.tensor([s - 1 for s in starts[1:]]), torch.arange(2 * num_fill).view(2, num_fill)]
    return HostStep(tensors, starts, list(q_lens), seq_lens, max(q_lens) == 1, pack(tensors))


@pytest.mark.parametrize("q_lens, fill", [([1], 0), ([1, 1, 1], 2), ([5, 5, 5], 0), ([11], 0), ([30, 1, 1], 1)])
def test_a_staged_step_has_its_inputs_in_place_and_its_padding_written(q_lens, fill):
    staging = StepStaging(torch.device("cpu"), rows=40, seqs=8, max_blocks=6)
    staging.slot_mapping.fill_(5)                # what an earlier, longer step left
    staging.seq_lens.fill_(9)
    host = host_step(q_lens, 30, 3, fill)
    staged = staging.stage(host)
    assert all(torch.equal(a, b) for a, b in zip(staged, host.tensors))
    assert staging.owns(staged[0]) and not staging.owns(host.tensors[0])
    rows, seqs = sum(q_lens), len(q_lens)
    assert (staging.slot_mapping[rows:] == -1).all()
    assert (staging.seq_lens[seqs:] == max(q_lens)).all()   # a graph's padding sequences attend to Q keys
    ids, positions, ctx, logits_rows = to_device(host, SimpleNamespace(device=torch.device("cpu")), 16,
                                                 staging=staging)
    assert staging.owns(ids) and torch.equal(ctx.block_tables, host.tensors[5])


def test_a_step_that_does_not_fit_is_not_staged():
    staging = StepStaging(torch.device("cpu"), rows=8, seqs=4, max_blocks=6, table_bytes=3 * 6 * 4)
    assert staging.stage(host_step([9], 0, 1)) is None          # more tokens than rows
    assert staging.stage(host_step([1] * 4, 10, 1)) is None     # more sequences than the twins' table rows
    assert staging.stage(host_step([1, 1], 10, 7)) is None      # more blocks than captured
    assert staging.stage(host_step([1] * 3, 10, 6)) is not None
    ids, *_ = to_device(host_step([9], 0, 1), SimpleNamespace(device=torch.device("cpu")), 16, staging=staging)
    assert not staging.owns(ids)


def test_graphs_replay_a_staged_step_with_no_copies_of_its_inputs():
    graphs = staged_graphs()
    graphs.slot_mapping.fill_(5)
    graphs.seq_lens.fill_(9)
    backend = SimpleNamespace(device=torch.device("cpu"))
    graphs._copy_inputs = None   # (a staged step's replay copies nothing: calling it would fail)
    ids, positions, ctx, _ = to_device(host_step([5, 5, 5], 30, 3), backend, 16, staging=graphs.staging)
    assert ctx.block_tables.stride(0) == graphs.block_tables.stride(0)   # staged in the graphs' own table
    graphs(ids, positions, ctx)                           # three sequences verifying 4 drafts: the graph of 4
    assert graphs.graphs[4, 5][0].replays == 1
    assert torch.equal(graphs.input_ids[:15], torch.arange(7, 22))
    assert (graphs.slot_mapping[15:20] == -1).all() and graphs.seq_lens.tolist()[:4] == [35, 35, 35, 5]
    assert torch.equal(graphs.block_tables[:3, :3], ctx.block_tables)
    ids, positions, ctx, rows = to_device(host_step([11], 40, 4), backend, 16, staging=graphs.staging)
    logits = graphs.prefill_chunk(ids, positions, ctx)   # a lone chunk: the graph of 16, 5 spare rows
    assert graphs.chunk_graphs[16][0].replays == 1 and logits.shape[0] == 11
    assert graphs.chunk_start_loc.tolist() == [0, 11] and (graphs.slot_mapping[11:16] == -1).all()
    assert torch.equal(graphs.block_tables[0, :4], ctx.block_tables[0])


def test_the_runner_is_offered_the_staging_only_when_switched_on(monkeypatch):
    assert staged_graphs().input_staging is None   # (off until measured on the GPU: docs/cli.md)
    monkeypatch.setenv("CVLLM_STAGE_STEP_INPUTS", "1")
    graphs = staged_graphs()
    assert graphs.input_staging is graphs.staging


def test_a_shape_captured_at_its_first_staged_step_replays_the_steps_inputs():
    """A graph captured lazily runs on placeholder inputs in the very buffers a staged step is in: they are set aside
    and put back, so the replay reads the step's."""
    graphs = staged_graphs()
    del graphs.graphs[4, 5]

    def capture(size, q, chunk=False):   # what _capture does to the buffers
        graphs.slot_mapping[:size * q].fill_(-1)
        graphs.seq_lens[:size].fill_(q)
        graphs.input_ids.zero_()
        graphs.graphs[size, q] = (stub := Replayed(size * q), stub.out)

    graphs._capture = capture
    ids, positions, ctx, _ = to_device(host_step([5, 5, 5], 30, 3), SimpleNamespace(device=torch.device("cpu")), 16,
                                       staging=graphs.staging)
    graphs(ids, positions, ctx)
    assert graphs.graphs[4, 5][0].replays == 1
    assert torch.equal(graphs.input_ids[:15], torch.arange(7, 22))
    assert torch.equal(graphs.slot_mapping[:15], torch.arange(100, 115)) and graphs.seq_lens.tolist()[:3] == [35] * 3
