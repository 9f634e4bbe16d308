"""The FP8 KV cache in the CUDA kernels (Triton's interpreter without a GPU): write_kv stores x / scale as e4m3,
saturated, exactly as the CPU path does; paged attention over e4m3 caches with their scales equals the reference
over the dequantized caches (decode, mixed batches, split KV)."""

from __future__ import annotations

import os

import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")

from cvllm.backends.cpu import paged_attention_reference  # noqa: E402
from cvllm.layers.kv_fp8 import quantize  # noqa: E402
from cvllm_cuda.kernels import paged_attention, write_kv  # noqa: E402
from cvllm_cuda.kernels.kv_cache import empty_value_cache  # noqa: E402
from cvllm_cuda.kernels.paged_attention import AttentionConfig  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
FP8 = torch.float8_e4m3fn


def test_write_kv_stores_scaled_saturated_e4m3(generator):
    tokens, heads, dim, blocks, block_size = 7, 2, 64, 3, 16
    scales = (torch.tensor([0.0625, 0.125]), torch.tensor([0.03125, 0.25]))   # per head; powers of two: x / scale exact
    k = torch.randn(tokens, heads, dim, generator=generator) * 3
    v = torch.randn(tokens, heads, dim, generator=generator)
    if DEVICE == "cpu":
        # Triton 3.6's interpreter converts float32 to e4m3 wrongly where rounding carries into the exponent
        # (31.4 -> 16): there the inputs are values e4m3 holds exactly, so only placement, scaling and saturation
        # are checked; the GPU rounds random values (to nearest even, as torch does)
        k = (k / scales[0][:, None]).to(FP8).float() * scales[0][:, None]
        v = (v / scales[1][:, None]).to(FP8).float() * scales[1][:, None]
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, 1e-6])   # beyond 448 * scale: saturated, not NaN
    slots = torch.tensor([3, 17, -1, 40, 5, 6, 33])
    k_cache = torch.zeros(blocks, block_size, heads, dim, dtype=FP8, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    write_kv(k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, slots.to(DEVICE), tuple(s.to(DEVICE) for s in scales))
    flat_k, flat_v = k_cache.cpu().view(-1, heads, dim).float(), v_cache.cpu().view(-1, heads, dim).float()
    kept = slots >= 0
    for flat, x, scale in ((flat_k, k, scales[0]), (flat_v, v, scales[1])):
        assert torch.equal(flat[slots[kept]], quantize(x[kept], scale).float())
    assert flat_k[3, 0, 0] == 448 and flat_k[3, 0, 1] == -448 and not flat_k.isnan().any()
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots[kept]] = False
    assert (flat_k[untouched] == 0).all() and (flat_v[untouched] == 0).all()


def poisoned(cache8: torch.Tensor, case, by_key: bool = False) -> torch.Tensor:
    """An e4m3 cache with NaN in every slot that holds no key of a sequence (spare pages, the tails of the last
    ones): no kernel may let those reach an output (0 * NaN = NaN). ``by_key``: laid out as the engine's FP8 V cache
    (kv_cache.empty_value_cache). Only the GPU reads them as NaN: Triton 3.6's interpreter converts e4m3's NaN to 480,
    so there a V slot read past a sequence's end is caught only where its probability is not zero."""
    blocks, block_size = cache8.shape[:2]
    used = torch.zeros(blocks, block_size, dtype=torch.bool)
    for table, seq_len in zip(case.block_tables.cpu().long(), case.seq_lens.cpu().tolist()):
        used.view(-1).index_fill_(0, (table[:-(-seq_len // block_size)][:, None] * block_size
                                      + torch.arange(block_size)).view(-1)[:seq_len], True)
    nan = cache8.cpu().clone()
    nan.view(torch.uint8)[~used] = 0x7F   # e4m3fn's NaN
    out = empty_value_cache(nan.shape, FP8, torch.device(DEVICE)) if by_key else torch.empty_like(nan, device=DEVICE)
    out.copy_(nan.to(DEVICE))
    return out


@pytest.mark.parametrize("query_lens,context_lens,splits", [
    ([1, 1, 1], [127, 0, 63], 1), ([1, 1, 1], [127, 0, 63], 4), ([1, 5, 1, 7], [37, 20, 9, 0], 1),
    ([1, 5, 1, 7], [37, 20, 9, 0], 2), ([1, 1], [200, 95], 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])   # bf16 queries: the products in float16
@pytest.mark.parametrize("values_by_key", [False, True], ids=["values-by-dim", "values-by-key"])
@pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (40, 30.0)])   # (40, 30.0): Gemma-2's kind
def test_attention_over_fp8_caches(make_attention_case, query_lens, context_lens, splits, dtype, values_by_key,
                                   sliding_window, soft_cap):
    case = make_attention_case(query_lens=query_lens, context_lens=context_lens, num_heads=4, num_kv_heads=2,
                               head_dim=64, block_size=16, dtype=dtype, device=DEVICE)
    k_scale, v_scale = torch.tensor([0.004, 0.006], device=DEVICE), torch.tensor([0.003, 0.002], device=DEVICE)
    k8 = quantize(case.k_cache.cpu(), k_scale.cpu())
    v8 = quantize(case.v_cache.cpu(), v_scale.cpu())
    out = paged_attention(case.q, poisoned(k8, case), poisoned(v8, case, values_by_key), *case.args()[3:],
                          sliding_window, soft_cap, num_splits=splits, kv_scales=(k_scale, v_scale))
    # the reference on the dequantized caches (what the stored bytes mean)
    k_deq = (k8.float() * k_scale.cpu()[:, None]).to(case.q.dtype)   # [blocks, block_size, Hkv, D] * per-head scales
    v_deq = (v8.float() * v_scale.cpu()[:, None]).to(case.q.dtype)
    positions = []
    for q_len, ctx in zip(query_lens, context_lens):
        positions.append(torch.arange(ctx, ctx + q_len))
    max_q = max(query_lens)
    query_pos = torch.full((len(query_lens), max_q), -1, dtype=torch.long)
    q_rows = torch.zeros(len(query_lens), max_q, *case.q.shape[1:])
    starts = case.query_start_loc.cpu().tolist()
    for i, pos in enumerate(positions):
        query_pos[i, :len(pos)] = pos
        q_rows[i, :len(pos)] = case.q.cpu()[starts[i]:starts[i + 1]]
    ref = paged_attention_reference(q_rows.float(), k_deq.float(), v_deq.float(), case.block_tables.cpu(),
                                    query_pos, case.seq_lens.cpu().long(), case.scale, sliding_window, soft_cap)
    expected = torch.cat([ref[i, :q] for i, q in enumerate(query_lens)])
    tolerance = 2e-4 if dtype == torch.float32 else 1e-2   # bf16: the output's rounding
    torch.testing.assert_close(out.cpu().float(), expected, rtol=tolerance, atol=tolerance)


def test_register_cap_leaves_fp8_attention_unchanged(make_attention_case):
    """AttentionConfig.max_registers (Triton's maxnreg) changes where values live, not what is computed. Compiled on
    a GPU (the device suite runs this file there; spills under a cap of 128); in the interpreter it shows only that
    the option reaches the launch (test_sm90_compile checks the cap holds in the compiled kernel)."""
    case = make_attention_case(query_lens=[1, 1], context_lens=[70, 33], num_heads=4, num_kv_heads=2, head_dim=64,
                               block_size=16, dtype=torch.float32, device=DEVICE)
    scales = (torch.full((2,), 0.004, device=DEVICE), torch.full((2,), 0.003, device=DEVICE))
    k8, v8 = (quantize(c.cpu(), s.cpu()).to(DEVICE) for c, s in zip((case.k_cache, case.v_cache), scales))
    runs = [paged_attention(case.q, k8, v8, *case.args()[3:], None, None, kv_scales=scales,
                            config=AttentionConfig(16, 32, 2, 2, max_registers=cap)) for cap in (None, 128)]
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)


def test_register_cap_only_past_one_wave(monkeypatch):
    """The tuned FP8 decode tile's cap (168 registers) holds for launches of more programs than 4 an SM (256
    streams: 2,048 programs) and is dropped for launches that fit one wave uncapped (64 streams: 512 on 132 SMs),
    where it measured slower (paged_attention.UNCAPPED_WAVE)."""
    from cvllm_cuda.kernels import gpu
    from cvllm_cuda.kernels.paged_attention import without_cap_in_one_wave

    monkeypatch.setattr(gpu, "num_sms", lambda index: 132)
    monkeypatch.setattr(gpu, "device_index", lambda device: 0)
    capped, cuda = AttentionConfig(16, 64, 2, 3, 168), torch.device("cuda")
    assert without_cap_in_one_wave(capped, 256 * 8, cuda) == capped
    assert without_cap_in_one_wave(capped, 64 * 8, cuda) == AttentionConfig(16, 64, 2, 3)
    assert without_cap_in_one_wave(capped, 4 * 132 + 1, cuda).max_registers == 168
    assert without_cap_in_one_wave(capped, 8, torch.device("cpu")) == capped


@pytest.mark.parametrize("rotary_dim", [64, 32])   # whole and partial rotary
@pytest.mark.parametrize("values_by_key", [False, True], ids=["values-by-dim", "values-by-key"])
def test_fused_rotary_write_stores_what_rotary_then_write_kv_stores(generator, rotary_dim, values_by_key):
    from cvllm_cuda.kernels.rotary import rotary, rotary_write_kv

    tokens, q_heads, kv_heads, dim, blocks, block_size = 6, 4, 2, 64, 2, 16
    positions = torch.tensor([0, 5, 9, 17, 3, 30])
    angles = torch.arange(40)[:, None] * torch.rand(rotary_dim // 2, generator=generator)[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1)
    q = torch.randn(tokens, q_heads * dim, generator=generator)
    k = torch.randn(tokens, kv_heads * dim, generator=generator) * 4
    v = torch.randn(tokens, kv_heads * dim, generator=generator)
    slots = torch.tensor([1, 7, -1, 20, 31, 2])
    scales = (torch.tensor([0.02, 0.05]), torch.tensor([0.01, 0.03]))
    on = lambda *ts: [t.to(DEVICE) for t in ts]   # noqa: E731
    caches = [torch.zeros(blocks, block_size, kv_heads, dim, dtype=FP8, device=DEVICE) for _ in range(4)]
    if values_by_key:   # the V caches as the engine lays them out (kv_cache.empty_value_cache): by key
        caches[1], caches[3] = (empty_value_cache(c.shape, FP8, torch.device(DEVICE)).copy_(c) for c in caches[1::2])
    fused_q = rotary_write_kv(*on(positions, q, k, v, cos_sin), dim, caches[0], caches[1], slots.to(DEVICE),
                              tuple(on(*scales)))
    plain_q, plain_k = rotary(*on(positions, q, k), cos_sin.to(DEVICE), dim)
    write_kv(plain_k.view(tokens, kv_heads, dim), v.to(DEVICE).view(tokens, kv_heads, dim), caches[2], caches[3],
             slots.to(DEVICE), tuple(on(*scales)))
    assert torch.equal(fused_q, plain_q)
    for fused, plain in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(fused.view(torch.uint8), plain.view(torch.uint8))
    if values_by_key:   # and where write_kv into a V cache by dim puts them
        by_dim = torch.zeros(caches[3].shape, dtype=FP8, device=DEVICE)
        write_kv(plain_k.view(tokens, kv_heads, dim), v.to(DEVICE).view(tokens, kv_heads, dim), caches[2], by_dim,
                 slots.to(DEVICE), tuple(on(*scales)))
        assert torch.equal(caches[3].contiguous().view(torch.uint8), by_dim.view(torch.uint8))
        assert caches[3].stride()[1] == 1 and not (caches[3].float() == 0).all()


def test_engine_keeps_only_fp8_values_by_key():
    """The caches the engine allocates on CUDA (Backend.empty_kv_cache): an FP8 V cache by key (a page's keys
    contiguous for each dimension), its K cache and every 16-bit cache contiguous; the logical shape is the same."""
    from cvllm_cuda.backend import CudaBackend

    shape, cpu = (3, 16, 2, 64), torch.device("cpu")
    values = CudaBackend.empty_kv_cache(None, shape, FP8, cpu, values=True)
    assert values.shape == shape and values.stride() == (2 * 64 * 16, 1, 64 * 16, 16)
    for dtype, is_values in ((FP8, False), (torch.bfloat16, True), (torch.bfloat16, False)):
        cache = CudaBackend.empty_kv_cache(None, shape, dtype, cpu, values=is_values)
        assert cache.shape == shape and cache.is_contiguous() and cache.dtype == dtype
