"""Decode attention over an FP8 cache with e4m3 products (paged_attention_fp8, CVLLM_FP8_ATTENTION_DOTS), in
Triton's interpreter without a GPU: against the reference over the dequantized caches, and against the float16
path it stands in for; two terms must be about as close as that path, one term is allowed its e4m3 rounding."""

from __future__ import annotations

import os

import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")

from conftest import reference_attention  # noqa: E402
from test_kv_fp8 import poisoned  # noqa: E402

from cvllm.layers.kv_fp8 import quantize  # noqa: E402
from cvllm_cuda.kernels import paged_attention, paged_attention_fp8  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
FP8 = torch.float8_e4m3fn


def fp8_case(make_attention_case, context_lens, heads=8, kv_heads=2, dim=64, dtype=torch.bfloat16):
    """A decode batch (one query a sequence) over e4m3 caches with NaN in every slot no sequence owns, V by key
    (as the engine allocates it), and the reference over what the stored bytes mean."""
    case = make_attention_case(query_lens=[1] * len(context_lens), context_lens=context_lens, num_heads=heads,
                               num_kv_heads=kv_heads, head_dim=dim, block_size=16, dtype=dtype, device=DEVICE)
    scales = (torch.linspace(0.003, 0.006, kv_heads), torch.linspace(0.002, 0.004, kv_heads))
    k8, v8 = quantize(case.k_cache.cpu(), scales[0]), quantize(case.v_cache.cpu(), scales[1])
    case.k_cache, case.v_cache = (c.float() * s[:, None] for c, s in ((k8, scales[0]), (v8, scales[1])))
    case.q = case.q.cpu()
    case.block_tables, case.seq_lens = case.block_tables.cpu(), case.seq_lens.cpu()
    expected = reference_attention(case, None, None)
    caches = poisoned(k8, case), poisoned(v8, case, by_key=True)
    return case, caches, tuple(s.to(DEVICE) for s in scales), expected


def run(case, caches, scales, terms, splits, window=None, soft_cap=None):
    """paged_attention with the e4m3 products at ``terms`` (0: the float16 path)."""
    previous = paged_attention_fp8.TERMS
    paged_attention_fp8.TERMS = terms
    try:
        return paged_attention(case.q.to(DEVICE), *caches, case.query_start_loc, case.seq_lens.to(DEVICE),
                               case.block_tables.to(DEVICE), 1, case.scale, window, soft_cap, num_splits=splits,
                               kv_scales=scales).cpu().float()
    finally:
        paged_attention_fp8.TERMS = previous


def error(out, expected):
    return ((out - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_two_terms_are_as_close_as_the_float16_path(make_attention_case, splits, dtype):
    case, caches, scales, expected = fp8_case(make_attention_case, [127, 0, 63, 200, 64], dtype=dtype)
    float16_path = error(run(case, caches, scales, 0, splits), expected)
    two_terms = error(run(case, caches, scales, 2, splits), expected)
    one_term = error(run(case, caches, scales, 1, splits), expected)
    # (errors relative to the largest output: bf16's output rounding ~4e-3; one term's q and P in e4m3 ~3e-2)
    assert two_terms < max(2 * float16_path, 8e-3), (two_terms, float16_path)
    assert one_term < 0.06, one_term
    assert two_terms < one_term


@pytest.mark.parametrize("window,soft_cap", [(40, None), (None, 30.0), (40, 30.0)])
def test_windows_and_soft_caps(make_attention_case, window, soft_cap):
    case, caches, scales, _ = fp8_case(make_attention_case, [127, 0, 63, 200])
    float16_path = run(case, caches, scales, 0, 2, window, soft_cap)
    two_terms = run(case, caches, scales, 2, 2, window, soft_cap)
    assert error(two_terms, float16_path) < 8e-3


@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 2, 128), (4, 4, 32)])   # 16 query heads a KV head; MHA
def test_other_groups_and_head_dims(make_attention_case, heads, kv_heads, dim):
    case, caches, scales, expected = fp8_case(make_attention_case, [70, 5], heads, kv_heads, dim)
    assert error(run(case, caches, scales, 2, 1), expected) < 8e-3


def test_only_decodes_over_values_by_key_take_it(monkeypatch):
    applies = paged_attention_fp8.applies
    monkeypatch.setattr(paged_attention_fp8, "TERMS", 2)
    assert applies(True, True, 128, 4) and applies(True, True, 256, 16)
    for args in ((False, True, 128, 4), (True, False, 128, 4), (True, True, 96, 4), (True, True, 128, 32),
                 (True, True, 512, 4)):
        assert not applies(*args)
    monkeypatch.setattr(paged_attention_fp8, "TERMS", 0)   # the switch off (the default)
    assert not applies(True, True, 128, 4)
