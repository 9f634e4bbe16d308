"""The CPU paged attention (the oracle for every other backend) against plain dense causal attention."""

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from cvllm.backends.cpu import CpuBackend, paged_attention_reference
from cvllm.forward_context import ForwardContext

HEADS, HEAD_DIM = 4, 16
SCALE = HEAD_DIM**-0.5
TOL = {"rtol": 1e-5, "atol": 1e-5}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    sliding_window: int | None = None, soft_cap: float | None = None) -> torch.Tensor:
    """q: [Lq, H, D] at absolute ``positions``; k, v: [S, Hkv, D] unpaged. Query i sees key j iff
    j <= i and i - j < window."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # head h uses kv head h // group
    scores = torch.einsum("qhd,shd->hqs", q, k) * SCALE
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    i, j = positions[:, None], torch.arange(k.shape[0])[None, :]
    visible = j <= i
    if sliding_window is not None:
        visible &= (i - j) < sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqs,shd->qhd", scores.softmax(-1), v)


@dataclass
class PagedSeqs:
    k_cache: torch.Tensor      # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    keys: list[torch.Tensor]    # per sequence, unpaged [S, Hkv, D]
    values: list[torch.Tensor]


def paginate(seq_lens: list[int], kv_heads: int, block_size: int, gen: torch.Generator) -> PagedSeqs:
    """Random K/V per sequence, scattered over shuffled blocks (block 0 left to the padding)."""
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 3
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    k_cache = torch.randn(num_blocks, block_size, kv_heads, HEAD_DIM, generator=gen)  # garbage in unused slots
    v_cache = torch.randn(num_blocks, block_size, kv_heads, HEAD_DIM, generator=gen)
    tables = torch.zeros(len(seq_lens), max(needed), dtype=torch.int32)
    keys, values = [], []
    for b, (n, nb) in enumerate(zip(seq_lens, needed)):
        blocks = [order.pop() for _ in range(nb)]
        tables[b, :nb] = torch.tensor(blocks)
        k, v = torch.randn(n, kv_heads, HEAD_DIM, generator=gen), torch.randn(n, kv_heads, HEAD_DIM, generator=gen)
        for t in range(n):
            k_cache[blocks[t // block_size], t % block_size] = k[t]
            v_cache[blocks[t // block_size], t % block_size] = v[t]
        keys.append(k)
        values.append(v)
    return PagedSeqs(k_cache, v_cache, tables, keys, values)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # GQA ratios 1, 2, 4
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_reference_matches_dense(kv_heads, block_size):
    gen = torch.Generator().manual_seed(kv_heads * 100 + block_size)
    seq_lens, query_lens = [23, 5, 40], [6, 5, 1]
    paged = paginate(seq_lens, kv_heads, block_size, gen)
    Lq = max(query_lens)
    q = torch.randn(len(seq_lens), Lq, HEADS, HEAD_DIM, generator=gen)
    query_pos = torch.full((len(seq_lens), Lq), -1, dtype=torch.int32)
    for b, (n, lq) in enumerate(zip(seq_lens, query_lens)):
        query_pos[b, :lq] = torch.arange(n - lq, n)
    out = paged_attention_reference(q, paged.k_cache, paged.v_cache, paged.block_tables, query_pos,
                                    torch.tensor(seq_lens, dtype=torch.int32), SCALE, None, None)
    for b, (n, lq) in enumerate(zip(seq_lens, query_lens)):
        expected = dense_attention(q[b, :lq], paged.keys[b], paged.values[b], torch.arange(n - lq, n))
        torch.testing.assert_close(out[b, :lq], expected, **TOL)
        if lq < Lq:  # padded query rows (position -1) see nothing and come out as zeros
            assert out[b, lq:].abs().max() == 0


@pytest.mark.parametrize("window", [1, 3, 8])
def test_paged_reference_sliding_window(window):
    gen = torch.Generator().manual_seed(window)
    seq_lens = [20]
    paged = paginate(seq_lens, 2, 4, gen)
    q = torch.randn(1, 20, HEADS, HEAD_DIM, generator=gen)
    positions = torch.arange(20)
    out = paged_attention_reference(q, paged.k_cache, paged.v_cache, paged.block_tables, positions[None],
                                    torch.tensor(seq_lens), SCALE, window, None)
    expected = dense_attention(q[0], paged.keys[0], paged.values[0], positions, sliding_window=window)
    torch.testing.assert_close(out[0], expected, **TOL)
    if window == 1:  # each position sees only itself: the output is its own value row
        torch.testing.assert_close(out[0], paged.values[0].repeat_interleave(2, dim=1), **TOL)
    unwindowed = dense_attention(q[0], paged.keys[0], paged.values[0], positions)
    assert (out[0] - unwindowed).abs().max() > 1e-3


def test_paged_reference_soft_cap():
    gen = torch.Generator().manual_seed(7)
    paged = paginate([12], 1, 4, gen)
    q = torch.randn(1, 12, HEADS, HEAD_DIM, generator=gen) * 8  # large logits, so the cap bites
    positions = torch.arange(12)
    out = paged_attention_reference(q, paged.k_cache, paged.v_cache, paged.block_tables, positions[None],
                                    torch.tensor([12]), SCALE, None, 5.0)
    expected = dense_attention(q[0], paged.keys[0], paged.values[0], positions, soft_cap=5.0)
    torch.testing.assert_close(out[0], expected, **TOL)
    uncapped = dense_attention(q[0], paged.keys[0], paged.values[0], positions)
    assert (out[0] - uncapped).abs().max() > 1e-2


# -- CpuBackend.write_kv and CpuBackend.attention over a hand-built ForwardContext --------------

def layer(window: int | None = None, soft_cap: float | None = None) -> SimpleNamespace:
    return SimpleNamespace(scale=SCALE, sliding_window=window, logits_soft_cap=soft_cap)


def make_context(backend: CpuBackend, context_lens: list[int], query_lens: list[int], block_tables: torch.Tensor,
                 block_size: int) -> ForwardContext:
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    slots = []
    for b, (c, n) in enumerate(zip(context_lens, query_lens)):
        for pos in range(c, c + n):
            slots.append(int(block_tables[b, pos // block_size]) * block_size + pos % block_size)
    ctx = ForwardContext(
        backend=backend, query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=block_tables, query_start_loc_cpu=starts, query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        is_decode_only=all(n == 1 for n in query_lens), block_size=block_size)
    backend.prepare(ctx)   # what the model runner does at the start of each forward pass
    return ctx


# (context tokens already cached, new tokens this step) per sequence
MIXED = [(9, 1), (30, 7), (16, 1), (0, 5)]  # decode, prefill chunk after cached context, decode, fresh prefill


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window, soft_cap", [(None, None), (6, None), (None, 4.0), (3, 4.0)])
def test_backend_mixed_batch_matches_dense(kv_heads, block_size, window, soft_cap):
    gen = torch.Generator().manual_seed(kv_heads + 10 * block_size)
    context_lens, query_lens = [c for c, _ in MIXED], [n for _, n in MIXED]
    seq_lens = [c + n for c, n in MIXED]
    # Lay the full sequences out in shuffled blocks, then blank the new tokens' slots: write_kv must fill them.
    paged = paginate(seq_lens, kv_heads, block_size, gen)
    backend = CpuBackend()
    ctx = make_context(backend, context_lens, query_lens, paged.block_tables, block_size)
    k_flat = paged.k_cache.view(-1, kv_heads, HEAD_DIM)
    v_flat = paged.v_cache.view(-1, kv_heads, HEAD_DIM)
    k_flat[ctx.slot_mapping] = float("nan")
    v_flat[ctx.slot_mapping] = float("nan")
    new_k = torch.cat([k[c:] for k, c in zip(paged.keys, context_lens)])
    new_v = torch.cat([v[c:] for v, c in zip(paged.values, context_lens)])
    backend.write_kv(new_k, new_v, paged.k_cache, paged.v_cache, ctx.slot_mapping)
    torch.testing.assert_close(k_flat[ctx.slot_mapping], new_k, rtol=0, atol=0)
    torch.testing.assert_close(v_flat[ctx.slot_mapping], new_v, rtol=0, atol=0)

    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=gen) * 3
    out = backend.attention(q, paged.k_cache, paged.v_cache, ctx, layer(window, soft_cap))
    assert out.shape == q.shape
    for b, (c, n) in enumerate(MIXED):
        start = ctx.query_start_loc_cpu[b]
        expected = dense_attention(q[start:start + n], paged.keys[b], paged.values[b], torch.arange(c, c + n),
                                   sliding_window=window, soft_cap=soft_cap)
        torch.testing.assert_close(out[start:start + n], expected, **TOL)


def test_backend_decode_only_batch():
    gen = torch.Generator().manual_seed(3)
    context_lens = [0, 4, 15, 63]
    paged = paginate([c + 1 for c in context_lens], 2, 16, gen)
    backend = CpuBackend()
    ctx = make_context(backend, context_lens, [1] * 4, paged.block_tables, 16)
    assert ctx.is_decode_only
    q = torch.randn(4, HEADS, HEAD_DIM, generator=gen)
    out = backend.attention(q, paged.k_cache, paged.v_cache, ctx, layer())
    for b, c in enumerate(context_lens):
        expected = dense_attention(q[b:b + 1], paged.keys[b], paged.values[b], torch.tensor([c]))
        torch.testing.assert_close(out[b:b + 1], expected, **TOL)
    # a single visible token: the output is exactly its value
    torch.testing.assert_close(out[0], paged.values[0][0].repeat_interleave(2, dim=0), **TOL)


def test_write_kv_casts_and_skips_negative_slots():
    backend = CpuBackend()
    k_cache = torch.zeros(3, 4, 2, HEAD_DIM, dtype=torch.bfloat16)
    v_cache = torch.zeros(3, 4, 2, HEAD_DIM, dtype=torch.bfloat16)
    k, v = torch.randn(3, 2, HEAD_DIM), torch.randn(3, 2, HEAD_DIM)
    backend.write_kv(k, v, k_cache, v_cache, torch.tensor([5, -1, 11]))  # -1: padding, not written
    flat_k, flat_v = k_cache.view(-1, 2, HEAD_DIM), v_cache.view(-1, 2, HEAD_DIM)
    torch.testing.assert_close(flat_k[[5, 11]], k[[0, 2]].bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(flat_v[[5, 11]], v[[0, 2]].bfloat16(), rtol=0, atol=0)
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[[5, 11]] = False
    assert flat_k[untouched].abs().max() == 0 and flat_v[untouched].abs().max() == 0


# -- the decode rows' fused path (cpu_decode.py: SDPA over the gathered blocks) ------------------------------------

def poison_unused(paged: PagedSeqs, seq_lens: list[int], block_size: int) -> None:
    """NaN in every cache slot no sequence holds (the cache is never zero-filled): past each end, unused blocks."""
    held = torch.zeros(paged.k_cache.shape[:2], dtype=torch.bool)
    for b, n in enumerate(seq_lens):
        for t in range(n):
            held[paged.block_tables[b, t // block_size], t % block_size] = True
    paged.k_cache[~held] = float("nan")
    paged.v_cache[~held] = float("nan")


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the fused decode path's calls: the tests below must exercise it, not the reference."""
    import cvllm.backends.cpu as cpu

    calls = []
    real = cpu.decode_attention

    def spy(*args, **kwargs):
        calls.append(args[3])
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu, "decode_attention", spy)
    return calls


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("context_lens", [[37], [0, 4, 15, 63], [16, 16]])
def test_fused_decode_matches_dense(kv_heads, block_size, window, context_lens, fused_calls):
    gen = torch.Generator().manual_seed(kv_heads + 10 * block_size + len(context_lens))
    seq_lens = [c + 1 for c in context_lens]
    paged = paginate(seq_lens, kv_heads, block_size, gen)
    poison_unused(paged, seq_lens, block_size)
    backend = CpuBackend()
    ctx = make_context(backend, context_lens, [1] * len(seq_lens), paged.block_tables, block_size)
    q = torch.randn(len(seq_lens), HEADS, HEAD_DIM, generator=gen) * 3
    out = backend.attention(q, paged.k_cache, paged.v_cache, ctx, layer(window))
    for b, c in enumerate(context_lens):
        expected = dense_attention(q[b:b + 1], paged.keys[b], paged.values[b], torch.tensor([c]),
                                   sliding_window=window)
        torch.testing.assert_close(out[b:b + 1], expected, **TOL)
    assert len(fused_calls) == 1
    keys = fused_calls[0]
    if len(seq_lens) == 1:   # one sequence: a slice of its keys, no mask, nothing to zero
        assert keys.mask is None and keys.past_end is None and keys.stop - keys.start == min(seq_lens[0], window or 99)
    elif len(set(seq_lens)) > 1 or block_size > 1 and seq_lens[0] % block_size:
        assert keys.mask is not None and keys.past_end is not None
    if window and len(seq_lens) == 1 and block_size <= 4:   # blocks wholly before the window are not gathered
        assert keys.num_blocks < -(-seq_lens[0] // block_size)


def test_fused_decode_rows_of_a_mixed_batch(fused_calls):
    gen = torch.Generator().manual_seed(5)
    context_lens, query_lens = [c for c, _ in MIXED], [n for _, n in MIXED]
    seq_lens = [c + n for c, n in MIXED]
    paged = paginate(seq_lens, 2, 4, gen)
    poison_unused(paged, seq_lens, 4)
    backend = CpuBackend()
    ctx = make_context(backend, context_lens, query_lens, paged.block_tables, 4)
    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=gen)
    out = backend.attention(q, paged.k_cache, paged.v_cache, ctx, layer())
    for b, (c, n) in enumerate(MIXED):
        start = ctx.query_start_loc_cpu[b]
        expected = dense_attention(q[start:start + n], paged.keys[b], paged.values[b], torch.arange(c, c + n))
        torch.testing.assert_close(out[start:start + n], expected, **TOL)
    assert len(fused_calls) == 1   # the two decode rows, together


def test_fused_decode_bf16_and_reused_buffers():
    """A bf16 cache is read as bf16 (float32 accumulation): within bf16 rounding of the float32 reference; the
    gather buffers are allocated once and reused by the next layer and step."""
    gen = torch.Generator().manual_seed(11)
    context_lens = [100, 7, 50]
    seq_lens = [c + 1 for c in context_lens]
    paged = paginate(seq_lens, 2, 16, gen)
    poison_unused(paged, seq_lens, 16)
    k_cache, v_cache = paged.k_cache.bfloat16(), paged.v_cache.bfloat16()
    backend = CpuBackend()
    ctx = make_context(backend, context_lens, [1] * 3, paged.block_tables, 16)
    q = torch.randn(3, HEADS, HEAD_DIM, generator=gen).bfloat16()
    out = backend.attention(q, k_cache, v_cache, ctx, layer())
    assert out.dtype == torch.bfloat16
    buffer = backend._gather_buffers._flat[torch.bfloat16]
    ref = paged_attention_reference(q[:, None].float(), k_cache, v_cache, ctx.backend_data.decode_tables,
                                    ctx.backend_data.decode_positions, ctx.backend_data.decode_lens, SCALE, None, None)
    torch.testing.assert_close(out.float(), ref[:, 0].bfloat16().float(), rtol=2e-2, atol=4e-3)
    backend.attention(q, k_cache, v_cache, ctx, layer())
    assert backend._gather_buffers._flat[torch.bfloat16] is buffer


def test_fused_decode_off_uses_the_reference(fused_calls, monkeypatch):
    monkeypatch.setattr(CpuBackend, "fused_decode", False)
    gen = torch.Generator().manual_seed(2)
    paged = paginate([9, 20], 2, 4, gen)
    backend = CpuBackend()
    ctx = make_context(backend, [8, 19], [1, 1], paged.block_tables, 4)
    q = torch.randn(2, HEADS, HEAD_DIM, generator=gen)
    out = backend.attention(q, paged.k_cache, paged.v_cache, ctx, layer())
    for b, c in enumerate([8, 19]):
        torch.testing.assert_close(out[b:b + 1], dense_attention(q[b:b + 1], paged.keys[b], paged.values[b],
                                                                 torch.tensor([c])), **TOL)
    assert not fused_calls


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("block_size", [4, 16])
def test_short_chunk_rows_equal_decode_steps(window, block_size):
    """A speculative verify step's chunk (last token and drafts) attends row by row as the decode steps at those
    positions would, bit for bit in bf16: so greedy speculation yields plain decoding's tokens on the CPU."""
    gen = torch.Generator().manual_seed(block_size)
    context, n = 40, 5
    paged = paginate([context + n], 2, block_size, gen)
    k_cache, v_cache = paged.k_cache.bfloat16(), paged.v_cache.bfloat16()
    backend = CpuBackend()
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen).bfloat16()
    ctx = make_context(backend, [context], [n], paged.block_tables, block_size)
    chunk = backend.attention(q, k_cache, v_cache, ctx, layer(window))
    for j in range(n):
        ctx = make_context(backend, [context + j], [1], paged.block_tables, block_size)
        step = backend.attention(q[j:j + 1], k_cache, v_cache, ctx, layer(window))
        assert torch.equal(chunk[j:j + 1], step), j
    expected = dense_attention(q.float(), paged.keys[0], paged.values[0], torch.arange(context, context + n),
                               sliding_window=window)
    torch.testing.assert_close(chunk.float(), expected, rtol=2e-2, atol=2e-2)
