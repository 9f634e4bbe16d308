"""The metal backend's KV write and paged attention, on CPU tensors (on MPS with CVLLM_METAL_TEST_DEVICE=mps), against
the CPU reference backend (core's oracle for every backend): many shapes, GQA ratios, block boundaries, prefill chunks
over a cached prefix next to decodes, sliding windows, soft-caps, 16-bit caches, MLA's shared cache, work in pieces."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cvllm.backends.cpu import CpuBackend
from cvllm_metal import paged_attention
from cvllm_metal.backend import MetalBackend

HEADS, HEAD_DIM = 4, 16
SCALE = HEAD_DIM**-0.5

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def metal(metal_device) -> MetalBackend:
    return MetalBackend(device=metal_device)


def layer(window: int | None = None, soft_cap: float | None = None) -> SimpleNamespace:
    return SimpleNamespace(scale=SCALE, sliding_window=window, logits_soft_cap=soft_cap)


def run_both(batch, attention_layer, metal: MetalBackend, shared_kv: bool = False):
    """Write this step's K/V and attend, once with each backend on its own copy of the caches (the metal backend's
    on its device): (metal's output, the CPU reference's), both on the CPU, after checking that both wrote the same
    caches."""
    outputs = []
    for backend in (metal, CpuBackend()):
        device = backend.device
        k_cache, v_cache = batch.caches(device)
        if shared_kv:   # MLA: one cache is both K and V (write_kv gets the latent twice)
            v_cache = k_cache
        new_k, new_v = batch.new_k.to(device), (batch.new_k if shared_kv else batch.new_v).to(device)
        ctx = batch.context(backend)
        backend.write_kv(new_k, new_v, k_cache, v_cache, ctx.slot_mapping)
        out = backend.attention(batch.q.to(device), k_cache, v_cache, ctx, attention_layer)
        outputs.append((out.cpu(), k_cache.cpu(), v_cache.cpu()))
    (out, k, v), (ref, ref_k, ref_v) = outputs
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "NaN from the never-written slots reached the output"
    torch.testing.assert_close(k, ref_k, rtol=0, atol=0, equal_nan=True)   # the KV write: bit for bit
    torch.testing.assert_close(v, ref_v, rtol=0, atol=0, equal_nan=True)
    return out, ref


# (context tokens already cached, new tokens this step) per sequence
MIXED = [(9, 1), (30, 7), (16, 1), (0, 5)]  # decode, prefill chunk after a cached prefix, decode, fresh prefill


@pytest.mark.parametrize("kv_heads", [4, 2, 1])   # GQA ratios 1, 2, 4
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window, soft_cap", [(None, None), (6, None), (None, 4.0), (3, 4.0)])
def test_mixed_batch_matches_the_cpu_reference(paged_batch, metal, kv_heads, block_size, window, soft_cap):
    batch = paged_batch([c for c, _ in MIXED], [n for _, n in MIXED], HEADS, kv_heads, HEAD_DIM, block_size,
                        seed=kv_heads + 10 * block_size)
    out, ref = run_both(batch, layer(window, soft_cap), metal)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_block_boundaries(paged_batch, metal):
    """Sequences that end on, just before and just after block edges; a decode opening a new block; a prefill
    chunk that starts on a block edge and one that fills whole blocks."""
    context_lens = [3, 4, 7, 8, 0, 8, 5]
    query_lens = [1, 1, 1, 1, 8, 4, 3]
    batch = paged_batch(context_lens, query_lens, HEADS, 2, HEAD_DIM, 4, seed=5)
    out, ref = run_both(batch, layer(), metal)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("context_lens", [[0, 4, 15, 63], [31]])
def test_decode_only_batch(paged_batch, metal, context_lens):
    batch = paged_batch(context_lens, [1] * len(context_lens), HEADS, 2, HEAD_DIM, 16, seed=3)
    assert batch.context(metal).backend_data.whole_batch   # no scatter: the decode part is the output
    out, ref = run_both(batch, layer(), metal)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("context_len", [0, 21])
def test_one_prefill_alone(paged_batch, metal, context_len):
    batch = paged_batch([context_len], [19], HEADS, 1, HEAD_DIM, 8, seed=context_len)
    out, ref = run_both(batch, layer(window=5), metal)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_work_is_split_into_pieces(paged_batch, metal_device, monkeypatch):
    """A budget of 256 bytes cuts the decodes into groups of one sequence and the prefills into chunks of one or two
    queries; the result is the reference's all the same."""
    gathers = []
    gather = paged_attention.gather_blocks
    monkeypatch.setattr(paged_attention, "gather_blocks", lambda *args: gathers.append(1) or gather(*args))
    chunks = []
    chunk = paged_attention._attend_chunk
    monkeypatch.setattr(paged_attention, "_attend_chunk", lambda *args: chunks.append(1) or chunk(*args))
    batch = paged_batch([c for c, _ in MIXED], [n for _, n in MIXED], HEADS, 2, HEAD_DIM, 4, seed=11)
    out, ref = run_both(batch, layer(window=6), MetalBackend(device=metal_device, work_bytes=256))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # gathers: the 2 decodes one by one and the 2 prefills, K and V each; chunks: the decodes one by one, the
    # 7 queries over 40 keys one at a time, the 5 over 8 keys two at a time
    assert (len(gathers), len(chunks)) == (8, 2 + 7 + 3)


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 1e-3), (torch.bfloat16, 1e-2)])
def test_16_bit_caches(paged_batch, metal, dtype, tol):
    """fp16 and bf16 (what a Mac serves in): float32 inside both, so only the output's rounding may differ."""
    batch = paged_batch([c for c, _ in MIXED], [n for _, n in MIXED], HEADS, 2, HEAD_DIM, 4, seed=7, dtype=dtype)
    out, ref = run_both(batch, layer(window=6, soft_cap=4.0), metal)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def test_shared_kv_cache(paged_batch, metal):
    """MLA's latent cache: v_cache is k_cache (one gather serves both)."""
    batch = paged_batch([c for c, _ in MIXED], [n for _, n in MIXED], HEADS, 1, HEAD_DIM, 4, seed=9)
    out, ref = run_both(batch, layer(), metal, shared_kv=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_write_kv_casts_and_skips_negative_slots(metal):
    k, v = torch.randn(3, 2, HEAD_DIM), torch.randn(3, 2, HEAD_DIM)
    caches = []
    for backend in (metal, CpuBackend()):
        device = backend.device
        k_cache = torch.zeros(3, 4, 2, HEAD_DIM, dtype=torch.bfloat16, device=device)
        v_cache = torch.zeros(3, 4, 2, HEAD_DIM, dtype=torch.bfloat16, device=device)
        slots = torch.tensor([5, -1, 11], device=device)   # -1: a token whose K/V is not stored
        backend.write_kv(k.to(device), v.to(device), k_cache, v_cache, slots)
        caches.append((k_cache.cpu(), v_cache.cpu()))
    (k_cache, v_cache), (ref_k, ref_v) = caches
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    flat = k_cache.view(-1, 2, HEAD_DIM)
    assert torch.equal(flat[[5, 11]], k[[0, 2]].bfloat16())
    assert flat[[0, 1, 2, 3, 4, 6, 7, 8, 9, 10]].abs().max() == 0


def test_no_fp8_cache():
    cache = torch.zeros(2, 4, 1, HEAD_DIM, dtype=torch.float8_e4m3fn)
    scales = (torch.ones(1), torch.ones(1))
    with pytest.raises(NotImplementedError, match="--kv-cache-dtype auto"):
        MetalBackend(device="cpu").write_kv(torch.zeros(1, 1, HEAD_DIM), torch.zeros(1, 1, HEAD_DIM), cache, cache,
                                            torch.tensor([0]), scales)
