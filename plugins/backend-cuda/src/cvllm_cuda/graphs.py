"""CUDA graphs of the decode step (forward pass and LM head), one per padded batch size; of speculative
decoding's verify step (every sequence runs its last token and Q - 1 drafts, every row gives logits), one per
padded batch size and Q; and of a lone sequence's short prefill chunk (a short prompt, or what the prefix cache left
of one), one per padded chunk length.

A decode step of a small model is dozens of kernels per layer, each a few microseconds: launched
one by one from Python the GPU waits on the host. A graph replays the whole step in one launch.
Graphs read their inputs from fixed addresses, so every input lives in a persistent buffer that
each step copies into; a batch of B sequences runs the graph of the smallest captured size >= B,
the padding rows writing nothing (slot -1) and attending to Q keys. Everything a graph runs was
fixed at capture: the attention kernels' grids depend only on the batch size, never on context
length, and nothing in the step reads a value back to the host.

A prefill chunk of q tokens runs eagerly in ~15 launches a layer, 27-60 ms of host time on the 135M demo model
for well under 1 ms of kernels; in a graph of Q >= q rows it is one launch. Its sequence is told it has q queries
(query_start_loc [0, q]), so the attention kernel leaves rows q..Q-1 alone (spare tiles) and the real rows are
computed as eagerly; the spare rows write no KV (slot -1) and hold garbage that no real row reads (every other
layer works row by row), and only the real rows' logits are returned.
"""

from __future__ import annotations

import bisect
import gc
import logging
import os
import time
from collections.abc import Callable

import torch

from cvllm.forward_context import ForwardContext
from cvllm_cuda.staging import StepStaging

logger = logging.getLogger(__name__)

# (input_ids, positions, ctx) -> one output row per input row (the runner passes its decode_logits)
Forward = Callable[[torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor]


def chunk_ladder(max_tokens: int) -> list[int]:
    """The padded lengths of lone prefill chunks captured: 8, 16, 32, ... up to ``max_tokens`` (itself included)."""
    sizes = [s for s in (8, 16, 32, 64, 128, 256, 512) if s < max_tokens]
    return sorted(set(sizes + [max_tokens])) if max_tokens > 1 else []


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 (vLLM's ladder): at most 7 padding rows above 8."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    def __init__(self, forward: Forward, backend, max_num_seqs: int, max_blocks_per_seq: int,
                 verify: tuple[int, int] | None = None, chunk_tokens: int = 0):
        """``verify``: (most sequences, largest Q) of the verify steps to capture as well; Q from 2 up.
        ``chunk_tokens``: the longest prefill chunk of a lone sequence to run in a graph (0: none)."""
        self.forward = forward
        self.backend = backend
        self.shapes = [(size, 1) for size in batch_size_ladder(max_num_seqs)]
        if verify is not None:
            verify_seqs, max_q = min(verify[0], max_num_seqs), verify[1]
            self.shapes += [(size, q) for q in range(2, max_q + 1) for size in batch_size_ladder(verify_seqs)]
        self.sizes = {q: sorted(size for size, q2 in self.shapes if q2 == q) for _, q in self.shapes}
        self.chunk_sizes = chunk_ladder(chunk_tokens)
        device = backend.device
        n = max(size for size, _ in self.shapes)
        rows = max([size * q for size, q in self.shapes] + self.chunk_sizes)
        # the graphs read their inputs from one region, where ModelRunner.prepare puts a step that fits (staging.py)
        # when ``input_staging`` offers it to the runner: CVLLM_STAGE_STEP_INPUTS=1 (+2.3% on the demo's plain
        # decoding on the H200; off by default until the whole GPU suite has run with it)
        self.staging = StepStaging(device, rows, n, max_blocks_per_seq)
        self.input_staging = self.staging if os.environ.get("CVLLM_STAGE_STEP_INPUTS", "0") == "1" else None
        self.input_ids, self.positions = self.staging.input_ids, self.staging.positions
        self.slot_mapping = self.staging.slot_mapping.fill_(-1)
        self.seq_lens = self.staging.seq_lens.fill_(1)
        # each sequence's Q queries start at a multiple of Q
        self.query_start_loc = {q: torch.arange(0, n * q + 1, q, dtype=torch.int32, device=device)
                                for q in self.sizes}
        # a lone chunk's queries: [0, q] at replay for a graph of Q >= q rows (a staged chunk's own query starts)
        self.chunk_start_loc = self.staging.query_start[:2]
        self.block_tables = self.staging.block_tables
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.chunk_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.replays = 0          # decode, verify and chunk steps served by a graph (the rest ran eagerly)
        self.verify_replays = 0   # of which verify steps
        self.chunk_replays = 0    # of which lone prefill chunks

    def _context(self, size: int, q: int) -> ForwardContext:
        return ForwardContext(
            backend=self.backend, query_start_loc=self.query_start_loc[q][:size + 1], seq_lens=self.seq_lens[:size],
            slot_mapping=self.slot_mapping[:size * q], block_tables=self.block_tables[:size],
            query_start_loc_cpu=list(range(0, size * q + 1, q)), query_lens_cpu=[q] * size, seq_lens_cpu=[q] * size,
            max_query_len=q, max_seq_len=self.block_tables.shape[1], is_decode_only=q == 1, capturing=True)

    def _chunk_context(self, q: int) -> ForwardContext:
        return ForwardContext(
            backend=self.backend, query_start_loc=self.chunk_start_loc, seq_lens=self.seq_lens[:1],
            slot_mapping=self.slot_mapping[:q], block_tables=self.block_tables[:1], query_start_loc_cpu=[0, q],
            query_lens_cpu=[q], seq_lens_cpu=[q], max_query_len=q, max_seq_len=self.block_tables.shape[1],
            is_decode_only=False, capturing=True)

    def capture_all(self) -> None:
        """Capture every shape, largest first so the smaller graphs reuse its memory pool."""
        started = time.perf_counter()
        gc.collect()   # dead engines' graphs freed now, not mid-capture (_capture)
        shapes = [(size, q, False) for size, q in self.shapes] + [(1, q, True) for q in self.chunk_sizes]
        for size, q, chunk in sorted(shapes, key=lambda shape: shape[0] * shape[1], reverse=True):
            self._capture(size, q, chunk)
        torch.cuda.synchronize(self.backend.device)
        verify = len(self.shapes) - len(self.sizes[1])
        chunks = f"; prefill chunks of up to {self.chunk_sizes[-1]} tokens" if self.chunk_sizes else ""
        logger.info("captured CUDA graphs for %d decode batch sizes (1..%d)%s%s in %.1fs", len(self.sizes[1]),
                    self.sizes[1][-1], f" and {verify} verify shapes" if verify else "", chunks,
                    time.perf_counter() - started)

    def _capture(self, size: int, q: int, chunk: bool = False) -> None:
        rows = size * q
        # verify shapes: the sequences' Q positions must fit their seq_lens (padding rows attend to Q keys)
        self.seq_lens[:size].fill_(q)
        self.slot_mapping[:rows].fill_(-1)   # (the first run below writes no KV)
        if chunk:
            self.chunk_start_loc[1].fill_(q)
        ids, positions = self.input_ids[:rows], self.positions[:rows]
        context = (lambda: self._chunk_context(q)) if chunk else (lambda: self._context(size, q))
        # a first run outside the graph: lazy initialisation (Triton compilation, rotary tables on the
        # device, cuBLAS workspaces) must not happen while capturing
        stream = torch.cuda.Stream(self.backend.device)
        stream.wait_stream(torch.cuda.current_stream(self.backend.device))
        with torch.cuda.stream(stream):
            self.forward(ids, positions, context())
        torch.cuda.current_stream(self.backend.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # no garbage collection while capturing: a cycle that holds an earlier engine's graphs, freed mid-capture,
        # destroys them, which the driver forbids during a capture and answers by invalidating this one (seen on the
        # H200 in the GPU tests: "operation not permitted when stream is capturing (function reset)")
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.forward(ids, positions, context())
        finally:
            if collecting:
                gc.enable()
        if self.pool is None:
            self.pool = graph.pool()
        (self.chunk_graphs if chunk else self.graphs)[q if chunk else (size, q)] = (graph, out)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """A decode step (every sequence one query) or a uniform verify step (every sequence ``max_query_len``
        queries, ModelRunner's is_decode_path): the graph of the smallest captured batch size that holds it."""
        batch, q = ctx.seq_lens.shape[0], ctx.max_query_len
        if ctx.block_tables.shape[1] > self.block_tables.shape[1]:
            return self.forward(input_ids, positions, ctx)   # (a longer context than captured: not reached)
        sizes = self.sizes.get(q, [])
        at = bisect.bisect_left(sizes, batch)
        if at == len(sizes):
            return self.forward(input_ids, positions, ctx)   # not a captured shape: run eagerly
        size, rows = sizes[at], input_ids.shape[0]
        staged = self.staging.owns(input_ids)   # (then its inputs and padding are in the buffers already)
        if (size, q) not in self.graphs:
            # a capture runs on placeholder inputs in the graphs' buffers: a staged step's are set aside meanwhile
            kept = self.staging.region.clone() if staged else None
            self._capture(size, q)
            if kept is not None:
                self.staging.region.copy_(kept)
        if not staged:
            self._copy_inputs(input_ids, positions, ctx)
            if size > batch:  # padding rows: write no KV, attend to Q keys of some block
                self.slot_mapping[rows:size * q].fill_(-1)
                self.seq_lens[batch:size].fill_(q)
        graph, out = self.graphs[size, q]
        graph.replay()
        self.replays += 1
        self.verify_replays += q > 1
        return out[:rows]

    def _copy_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> None:
        """A step uploaded the general way: its inputs into the graphs' buffers (their first rows and sequences)."""
        rows, batch = input_ids.shape[0], ctx.seq_lens.shape[0]
        self.block_tables[:batch, :ctx.block_tables.shape[1]].copy_(ctx.block_tables)
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        self.slot_mapping[:rows].copy_(ctx.slot_mapping)
        self.seq_lens[:batch].copy_(ctx.seq_lens)

    def prefill_chunk(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """A lone sequence's prefill chunk of q tokens in the graph of the shortest captured length Q >= q: logits
        of its q rows (the rows past q are spare, module docstring). Always a chunk graph, never a verify graph of
        the same q: a prompt's logits then do not depend on whether the engine speculates."""
        q = input_ids.shape[0]
        at = bisect.bisect_left(self.chunk_sizes, q)
        if at == len(self.chunk_sizes) or ctx.block_tables.shape[1] > self.block_tables.shape[1]:
            return self.forward(input_ids, positions, ctx)
        size = self.chunk_sizes[at]
        if not self.staging.owns(input_ids):   # (a staged chunk has its inputs, query starts and spare slots there)
            self._copy_inputs(input_ids, positions, ctx)
            self.slot_mapping[q:size].fill_(-1)   # spare rows: no KV written
            self.chunk_start_loc.copy_(ctx.query_start_loc)
        graph, out = self.chunk_graphs[size]
        graph.replay()
        self.replays += 1
        self.chunk_replays += 1
        return out[:q]
