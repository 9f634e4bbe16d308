"""The Triton kernels on small shapes against the CPU oracle: in Triton's CPU interpreter without a GPU
(conftest.py sets TRITON_INTERPRET=1), compiled on the GPU where there is one."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")  # a skip locally, an error under CI=true

from cvllm_cuda.kernels import paged_attention, write_kv  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"

# 2 decodes, a prefill chunk after 20 cached tokens, a fresh prefill: every kind of row in one launch
MIXED = dict(query_lens=[1, 5, 1, 7], context_lens=[37, 20, 9, 0])


def scatter_reference(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Direct per-token scatter, the obvious way."""
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            block, offset = divmod(slot, k_cache.shape[1])
            k_cache[block, offset] = k[t].to(k_cache.dtype)
            v_cache[block, offset] = v[t].to(v_cache.dtype)


@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (3, 80), (2, 16)])
# (input, cache) dtypes; not fp32 -> bf16 here: the interpreter truncates where the GPU rounds to nearest
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.float16)])
def test_write_kv_matches_a_scatter(generator, num_kv_heads, head_dim, dtype, cache_dtype):
    num_tokens, num_blocks, block_size = 9, 4, 16
    # k and v as strided views of one fused projection output, like a model's qkv split
    fused = torch.randn(num_tokens, 3 * num_kv_heads * head_dim + 5, generator=generator).to(dtype)
    k = fused[:, :num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = fused[:, num_kv_heads * head_dim:2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[[2, 6]] = -1  # padding tokens: not stored
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=generator).to(cache_dtype)
    v_cache = torch.randn(cache_shape, generator=generator).to(cache_dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    scatter_reference(k, v, k_expected, v_expected, slots)

    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    write_kv(k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, slots.to(DEVICE))
    # exact: written slots hold the (cast) inputs, every other slot is untouched
    assert torch.equal(k_cache.cpu(), k_expected) and torch.equal(v_cache.cpu(), v_expected)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (2, 2)])
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch(make_attention_case, check_attention, num_heads, num_kv_heads, head_dim, block_size):
    case = make_attention_case(**MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               block_size=block_size, dtype=torch.float32, device=DEVICE)
    check_attention(case)


@pytest.mark.parametrize("sliding_window,soft_cap", [(8, None), (None, 2.0), (13, 3.0), (1, None)])
def test_sliding_window_and_soft_cap(make_attention_case, check_attention, sliding_window, soft_cap):
    case = make_attention_case(**MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                               dtype=torch.float32, device=DEVICE)
    check_attention(case, sliding_window, soft_cap)


@pytest.mark.parametrize("num_splits", [2, 3])
@pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (24, 2.5)])
def test_split_kv_mixed_batch(make_attention_case, check_attention, num_splits, sliding_window, soft_cap):
    case = make_attention_case(**MIXED, num_heads=4, num_kv_heads=2, head_dim=80, block_size=16,
                               dtype=torch.float32, device=DEVICE)
    check_attention(case, sliding_window, soft_cap, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 4, 16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_only_batch(make_attention_case, check_attention, num_splits, block_size):
    # max_query_len == 1 takes the decode path: one tile per sequence, G = 4 heads per KV head;
    # with 16 splits most slices of the short contexts are empty and must not disturb the result
    case = make_attention_case(query_lens=[1, 1, 1], context_lens=[127, 0, 63], num_heads=8, num_kv_heads=2,
                               head_dim=64, block_size=block_size, dtype=torch.float32, device=DEVICE)
    check_attention(case, num_splits=num_splits)


def test_strided_query_and_output(make_attention_case, check_attention, generator):
    """q as a view of a fused QKV output (row stride > H * D), written into a strided output."""
    case = make_attention_case(**MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                               dtype=torch.float32, device=DEVICE)
    fused = torch.randn(case.q.shape[0], 6 * 64, generator=generator).to(DEVICE)
    case.q = fused[:, :4 * 64].view(-1, 4, 64)
    out = check_attention(case)
    wide = torch.full((case.q.shape[0], 4, 96), float("nan"), device=DEVICE)
    paged_attention(*case.args(), None, None, wide[:, :, :64])
    torch.testing.assert_close(wide[:, :, :64], out, rtol=0, atol=0)
    assert torch.isnan(wide[:, :, 64:]).all()  # nothing written outside the view


def test_half_precision(make_attention_case, check_attention):
    """fp16 here: triton 3.6's interpreter multiplies bf16 tiles as raw uint16 bits (bf16 runs on the GPU)."""
    case = make_attention_case(**MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                               dtype=torch.float16 if DEVICE == "cpu" else torch.bfloat16, device=DEVICE)
    check_attention(case, num_splits=2)


def test_tuned_tiles_are_looked_up_by_gpu_name(monkeypatch):
    """The committed table's entries reach attention_config for their GPU; other GPUs, head dims and
    dtypes take the defaults."""
    module = importlib.import_module("cvllm_cuda.kernels.paged_attention")   # the package exports the function
    gpu = importlib.import_module("cvllm_cuda.kernels.gpu")

    cuda = torch.device("cuda", 0)
    default = module.attention_config(128, torch.bfloat16, True, torch.device("cpu"))
    for name, entries in module.TUNED.items():
        monkeypatch.setattr(gpu, "device_name", lambda index, name=name: name)
        for (head_dim, dtype, decode), tile in entries.items():
            fp8 = dtype == "float8_e4m3fn"   # an FP8 cache's entries: queries stay bf16
            got = module.attention_config(head_dim, torch.bfloat16 if fp8 else getattr(torch, dtype), decode,
                                          cuda, fp8_cache=fp8)
            assert got == module.AttentionConfig(*tile)
            block_m, block_n = tile[:2]
            assert block_m >= 16 and block_m & (block_m - 1) == 0 and block_n & (block_n - 1) == 0
    for name, entries in module.TUNED_SPARSE_DECODE.items():
        monkeypatch.setattr(gpu, "device_name", lambda index, name=name: name)
        for (head_dim, dtype), tile in entries.items():
            assert module.attention_config(head_dim, getattr(torch, dtype), True, cuda, sparse=True) == \
                module.AttentionConfig(*tile)
            # only sparse decodes take it: a full decode grid and prefill keep their own entries
            assert module.attention_config(head_dim, getattr(torch, dtype), True, cuda) == \
                module.attention_config(head_dim, getattr(torch, dtype), True, cuda, sparse=False)
            assert module.attention_config(head_dim, getattr(torch, dtype), False, cuda, sparse=True) == \
                module.attention_config(head_dim, getattr(torch, dtype), False, cuda)
    monkeypatch.setattr(gpu, "device_name", lambda index: "a GPU nobody tuned")
    assert module.attention_config(128, torch.bfloat16, True, cuda) == default
    assert module.attention_config(128, torch.bfloat16, True, cuda, sparse=True) == default


@pytest.mark.parametrize("num_splits", [1, 4, 16])
def test_verify_batch(make_attention_case, check_attention, num_splits):
    # speculative verify steps: every sequence its last token and 4 drafts (5 causal queries) over a context
    case = make_attention_case(query_lens=[5, 5, 5], context_lens=[90, 0, 33], num_heads=8, num_kv_heads=2,
                               head_dim=64, block_size=16, dtype=torch.float32, device=DEVICE)
    check_attention(case, num_splits=num_splits)


def test_sparse_decode_means_no_more_programs_than_sms(monkeypatch):
    module = importlib.import_module("cvllm_cuda.kernels.paged_attention")
    gpu = importlib.import_module("cvllm_cuda.kernels.gpu")
    monkeypatch.setattr(gpu, "num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)
    splits = module.default_num_splits(1, 8, 1, cuda)
    assert splits == 16 and module.is_sparse_decode(1, 8, splits, cuda)   # batch 1: 128 programs
    assert not module.is_sparse_decode(2, 8, module.default_num_splits(2, 8, 1, cuda), cuda)
    assert not module.is_sparse_decode(16, 8, module.default_num_splits(16, 8, 1, cuda), cuda)
    assert not module.is_sparse_decode(1, 8, 16, torch.device("cpu"))
    # a verify step's few queries per sequence split as a decode does; prefill chunks do not
    assert module.default_num_splits(1, 8, 5, cuda) == 16 and module.default_num_splits(1, 8, 9, cuda) == 1


def test_launch_size_arithmetic_matches_triton():
    import triton

    from cvllm_cuda.kernels.sizes import cdiv, next_power_of_2

    for n in [0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 80, 96, 127, 128, 129, 1000, 4096, 14336, 65535, 65536, 1 << 40]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 1000):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
