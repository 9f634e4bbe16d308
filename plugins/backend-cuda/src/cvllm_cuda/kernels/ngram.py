"""A verify step's outcome and the next step's n-gram drafts in one Triton launch: ``advance_ngram``.

The same results as the torch reference ``cvllm.engine.ngram_device.advance_ngram`` (read its docstrings for the
semantics): for each of S sequences, the accepted drafts (the leading ones equal to the sample before them), the K + 1
samples appended to the sequence's row of the device's token history, the new length, and the next step's input ids
(the bonus token, then the K drafts ``lookup_drafts`` finds in the updated history) and positions.

Why one launch: with asynchronous speculative decoding this runs right after step t is sampled and before step t + 1
can be launched, on the host's critical path. The reference is some 40 small torch ops and more (its lookup loops
over n, and over each n-gram's tokens), each a few microseconds of host launch cost for a few of GPU work: their
launches, not the lookup, would set the step's pace. Here one program a sequence does it all, with no host
synchronisation and no allocation besides the two outputs (CUDA-graph safe).

The lookup reads the history as updated by the same program. Rather than store the samples and then load them back
(which would need a barrier between the threads of the program, something Triton's interpreter cannot check), every
read of a position at or past the old length takes the token from ``samples``, the input the store writes from: the
loads never depend on this program's stores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels import pdl
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.sizes import next_power_of_2

BLOCK = 1024   # history positions compared per step of the scan (a module constant: tests shrink it)


@triton.jit
def _token(history_row, samples_row, p, old_len, width, K: tl.constexpr):
    """The updated history's token at positions ``p`` (a scalar or a block; 0 where p is out of the row). Positions
    old_len .. old_len + K hold the samples just written; the writes are clamped to width - 1, where the last one,
    sample K, stays (as the reference's index_put_ leaves it on the CPU). Those come from ``samples``: no address this
    program stores to is ever loaded, so no barrier is needed between its stores and this."""
    written = (p >= old_len) & (p - old_len <= K) & (p < width)
    j = tl.where(p == width - 1, K, p - old_len)
    new = tl.load(samples_row + j, mask=written, other=0)
    old = tl.load(history_row + p, mask=(p >= 0) & (p < width) & ~written, other=0)
    return tl.where(written, new, old)


@triton.jit
def _advance_ngram_kernel(samples_ptr, drafts_ptr, first_positions_ptr, rows_ptr, history_ptr, lengths_ptr,
                          next_ids_ptr, next_positions_ptr, width, stride_samples, stride_drafts, stride_history,
                          stride_first,
                          K: tl.constexpr, MIN_N: tl.constexpr, MAX_N: tl.constexpr, K1P: tl.constexpr,
                          NP: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    samples_row = samples_ptr + seq * stride_samples
    row = tl.load(rows_ptr + seq)
    history_row = history_ptr + row * stride_history
    old_len = tl.load(lengths_ptr + row)

    # accepted: the index of the first draft that differs from the sample before it (K where none does)
    steps = tl.arange(0, K1P)
    samples = tl.load(samples_row + steps, mask=steps <= K, other=0)
    drafts = tl.load(drafts_ptr + seq * stride_drafts + steps, mask=steps < K, other=0)
    accepted = tl.min(tl.where((steps < K) & (drafts != samples), steps, K), axis=0)
    bonus = tl.sum(tl.where(steps == accepted, samples, 0), axis=0)

    # every sample is stored at old_len + j, clamped to width - 1: of the ones the clamp puts on width - 1 only the
    # last (sample K) is stored, the one a sequential scatter leaves there (a block's store to one address from
    # several lanes would leave any of them)
    at = old_len + steps
    tl.store(history_row + tl.minimum(at, width - 1), samples,
             mask=((steps < K) & (at < width - 1)) | (steps == K))
    new_len = old_len + accepted + 1
    tl.store(lengths_ptr + row, new_len)
    last = new_len - 1

    # The lookup. An occurrence of the suffix of n tokens that ends at e (starts at e - n + 1) matches where
    # token[e - d] == token[last - d] for every d < n: the matches of n + 1 are those of n that also match at d = n,
    # so one pass over d gives every n. It must end before the last token (start + n <= last: e < last), and the
    # drafts start after it, at e + 1, whatever n is. best[n]: the latest e that matches n tokens, -1 for none.
    ns = tl.arange(0, NP)
    best = tl.full((NP,), -1, tl.int64)
    for block_start in range(0, last, BLOCK):
        ends = block_start + tl.arange(0, BLOCK)
        match = ends < last
        for d in tl.static_range(MAX_N):
            suffix_token = _token(history_row, samples_row, last - d, old_len, width, K)
            match &= (ends - d >= 0) & (_token(history_row, samples_row, ends - d, old_len, width, K) == suffix_token)
            if d + 1 >= MIN_N:
                latest = tl.max(tl.where(match, ends, -1), axis=0)
                best = tl.where(ns == d + 1, tl.maximum(best, latest), best)
    # the longest n with an occurrence wins; with none, every draft is the last token
    longest = tl.max(tl.where(best >= 0, ns, 0), axis=0)
    start = tl.sum(tl.where((ns == longest) & (longest > 0), best + 1, 0), axis=0)
    # next ids: the bonus, then draft j - 1 at start + j - 1, clamped to the last token (the padding rule)
    draft_at = tl.where(longest > 0, tl.minimum(start + steps - 1, last), last)
    drafts_next = _token(history_row, samples_row, draft_at, old_len, width, K)
    out = seq * (K + 1) + steps
    tl.store(next_ids_ptr + out, tl.where(steps == 0, bonus, drafts_next), mask=steps <= K)
    first_position = tl.load(first_positions_ptr + seq * stride_first)
    tl.store(next_positions_ptr + out, first_position + accepted + 1 + steps, mask=steps <= K)


def advance_ngram(samples: torch.Tensor, drafts: torch.Tensor, first_positions: torch.Tensor, rows: torch.Tensor,
                  history: torch.Tensor, lengths: torch.Tensor, min_n: int, max_n: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``cvllm.engine.ngram_device.advance_ngram`` in one launch: ``samples`` [S, K + 1], ``drafts`` [S, K],
    ``first_positions`` [S], ``rows`` [S] (distinct), ``history`` [R, H] and ``lengths`` [R] (both updated in place),
    all int64; returns the next step's (input ids, positions) [S, K + 1]. Each sequence's new length must fit its row
    (at most H), as the reference requires."""
    num_seqs, k1 = samples.shape
    k = k1 - 1
    assert k >= 1 and 1 <= min_n <= max_n, (k, min_n, max_n)
    assert drafts.shape == (num_seqs, k) and first_positions.shape == rows.shape == (num_seqs,)
    # (the engine passes views of a verify step's inputs: the drafts' rows and the first positions are strided)
    for t in (samples, drafts, rows, history, lengths):
        assert t.dtype == torch.int64 and t.stride(-1) == 1, (t.dtype, t.stride())
    assert first_positions.dtype == torch.int64
    next_ids = torch.empty(num_seqs, k1, dtype=torch.int64, device=samples.device)
    next_positions = torch.empty(num_seqs, k1, dtype=torch.int64, device=samples.device)
    if num_seqs == 0:
        return next_ids, next_positions
    width = history.shape[1]
    _advance_ngram_kernel[(num_seqs,)](
        samples, drafts, first_positions, rows, history, lengths, next_ids, next_positions, width,
        samples.stride(0), drafts.stride(0), history.stride(0), first_positions.stride(0),
        K=k, MIN_N=min_n, MAX_N=max_n, K1P=next_power_of_2(k1), NP=next_power_of_2(max_n + 1),
        BLOCK=min(BLOCK, max(16, next_power_of_2(width))), num_warps=8, **pdl.options(samples.device))
    return next_ids, next_positions
