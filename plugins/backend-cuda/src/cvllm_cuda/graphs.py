"""CUDA graphs of the decode step (forward pass and LM head), one per padded batch size.

A decode step of a small model is dozens of kernels per layer, each a few microseconds: launched
one by one from Python the GPU waits on the host. A graph replays the whole step in one launch.
Graphs read their inputs from fixed addresses, so every input lives in a persistent buffer that
each step copies into; a batch of B sequences runs the graph of the smallest captured size >= B,
the padding rows writing nothing (slot -1) and attending to one key. Everything a graph runs was
fixed at capture: the attention kernels' grids depend only on the batch size, never on context
length, and nothing in the step reads a value back to the host.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from cvllm.forward_context import ForwardContext

logger = logging.getLogger(__name__)

# (input_ids, positions, ctx) -> one output row per input row (the runner passes its decode_logits)
Forward = Callable[[torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor]


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 (vLLM's ladder): at most 7 padding rows above 8."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    def __init__(self, forward: Forward, backend, max_num_seqs: int, max_blocks_per_seq: int):
        self.forward = forward
        self.backend = backend
        self.sizes = batch_size_ladder(max_num_seqs)
        device, n = backend.device, self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # one query per row
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.replays = 0      # decode steps served by a graph (the rest ran eagerly)

    def _context(self, size: int) -> ForwardContext:
        return ForwardContext(
            backend=self.backend, query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            query_start_loc_cpu=list(range(size + 1)), query_lens_cpu=[1] * size, seq_lens_cpu=[1] * size,
            max_query_len=1, max_seq_len=self.block_tables.shape[1], is_decode_only=True)

    def capture_all(self) -> None:
        """Capture every size, largest first so the smaller graphs reuse its memory pool."""
        started = time.perf_counter()
        for size in reversed(self.sizes):
            self._capture(size)
        torch.cuda.synchronize(self.backend.device)
        logger.info("captured CUDA graphs for %d decode batch sizes (1..%d) in %.1fs", len(self.sizes),
                    self.sizes[-1], time.perf_counter() - started)

    def _capture(self, size: int) -> None:
        ids, positions, ctx = self.input_ids[:size], self.positions[:size], self._context(size)
        # a first run outside the graph: lazy initialisation (Triton compilation, rotary tables on the
        # device, cuBLAS workspaces) must not happen while capturing
        stream = torch.cuda.Stream(self.backend.device)
        stream.wait_stream(torch.cuda.current_stream(self.backend.device))
        with torch.cuda.stream(stream):
            self.forward(ids, positions, ctx)
        torch.cuda.current_stream(self.backend.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.forward(ids, positions, self._context(size))
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[size] = (graph, out)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        batch = input_ids.shape[0]
        at = bisect.bisect_left(self.sizes, batch)
        if at == len(self.sizes) or ctx.block_tables.shape[1] > self.block_tables.shape[1]:
            return self.forward(input_ids, positions, ctx)   # larger than anything captured: run eagerly
        size = self.sizes[at]
        if size not in self.graphs:
            self._capture(size)
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(ctx.slot_mapping)
        self.seq_lens[:batch].copy_(ctx.seq_lens)
        self.block_tables[:batch, :ctx.block_tables.shape[1]].copy_(ctx.block_tables)
        if size > batch:  # padding rows: write no KV, attend to one key of some block
            self.slot_mapping[batch:size].fill_(-1)
            self.seq_lens[batch:size].fill_(1)
        graph, out = self.graphs[size]
        graph.replay()
        self.replays += 1
        return out[:batch]
