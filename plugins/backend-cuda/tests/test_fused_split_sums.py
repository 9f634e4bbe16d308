"""The GEMVs' K splits added by the split that finishes last (quant_tiles.FUSED_SPLITS_ENV): the same bits as the
separate sum kernel, for the int8 GEMV (1 to MAX_ROWS rows, strided output rows), the float GEMV (GPTQ, FP8) and the
swapped GEMM of decode batches, the split-KV attention combined in its launch, and the ticket counters zero again
after every launch; the weight prefetch's budget. In Triton's interpreter (programs run one after another: the last
split is the last program) and compiled for sm_90 (test_sm90_compile.py); on a GPU where one is."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")

from test_quant_matmul import DEVICE, LAYOUTS, needs_gpu, random_weight  # noqa: E402

from cvllm_cuda.kernels import quant_tiles  # noqa: E402
from cvllm_cuda.kernels.quant_gemm_swapped import quant_gemm_swapped  # noqa: E402
from cvllm_cuda.kernels.quant_gemv import quant_gemv  # noqa: E402
from cvllm_cuda.kernels.quant_gemv_int8 import MAX_ROWS, quant_gemv_int8  # noqa: E402


def fused(monkeypatch, on: bool) -> None:
    monkeypatch.setenv(quant_tiles.FUSED_SPLITS_ENV, "1" if on else "0")


def counters_are_zero() -> bool:
    return all(int(c.abs().sum()) == 0 for c in quant_tiles._counters.values())


@pytest.mark.parametrize("name,rows,splits", [("q4_k", 1, 2), ("q4_k", MAX_ROWS, 3), ("q8_0", 3, 3), ("q6_k", 2, 3)])
def test_int8_gemv_fused_split_sum_gives_the_separate_sums_bits(monkeypatch, name, rows, splits):
    """Output rows written at a stride (a slice of a wider tensor) and 40 output features (a masked last tile)."""
    layout = dataclasses.replace(LAYOUTS[name], int8_activations=True)
    weight = random_weight(layout, 40, 768, DEVICE, seed=rows + splits)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows)).to(DEVICE).to(torch.bfloat16)
    outs = {}
    for on in (False, True):
        fused(monkeypatch, on)
        wide = torch.full((rows, 56), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        quant_gemv_int8(x, weight, wide[:, 8:48], config=(16, 8, 4), splits=splits)
        outs[on] = wide
    assert not outs[True][:, 8:48].isnan().any()
    assert torch.equal(outs[True][:, 8:48], outs[False][:, 8:48])
    assert outs[True][:, :8].isnan().all() and outs[True][:, 48:].isnan().all()   # nothing written past its rows
    assert quant_tiles._counters and counters_are_zero()


@pytest.mark.parametrize("name", ["gptq4_g128", "fp8_block128", "q6_k"])
def test_float_gemv_fused_split_sum_gives_the_separate_sums_bits(monkeypatch, name):
    weight = random_weight(LAYOUTS[name], 40, 768, DEVICE, seed=5)
    x = torch.randn(1, 768, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    outs = {}
    for on in (False, True):
        fused(monkeypatch, on)
        outs[on] = torch.full((1, 40), float("nan"), device=DEVICE)
        quant_gemv(x, weight, outs[on], config=(16, 8, 4), splits=3)
    assert not outs[True].isnan().any() and torch.equal(outs[True], outs[False])
    assert counters_are_zero()


@pytest.mark.parametrize("name,rows", [("q4_k", 3), ("gptq4_g128", 20), ("q8_0", 5)])
def test_swapped_gemm_fused_split_sum_gives_the_separate_sums_bits(monkeypatch, name, rows):
    """The swapped GEMM of decode batches (lane order for 4-bit, position order for Q8_0), rows in a masked tile and
    output rows at a stride."""
    weight = random_weight(LAYOUTS[name], 40, 512, DEVICE, seed=rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(DEVICE).to(torch.bfloat16)
    outs = {}
    for on in (False, True):
        fused(monkeypatch, on)
        wide = torch.full((rows, 56), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        quant_gemm_swapped(x, weight, wide[:, 8:48], splits=2)
        outs[on] = wide
    assert not outs[True][:, 8:48].isnan().any() and outs[True][:, :8].isnan().all()
    assert torch.equal(outs[True][:, 8:48], outs[False][:, 8:48]) and counters_are_zero()


@pytest.mark.parametrize("splits,head_dim,contexts", [(4, 64, [127, 0, 63]), (16, 80, [40, 3, 200])])
def test_attention_splits_combined_in_its_launch(monkeypatch, make_attention_case, check_attention, splits,
                                                 head_dim, contexts):
    """The split-KV decode attention with its splits combined by the last of a tile's programs: the oracle's output
    (16 splits: most slices of the short contexts empty; head_dim 80: masked lanes), the separate combining kernel's
    within float32 rounding (a split at a time here, a tree there), the counters zero again."""
    from cvllm_cuda.kernels.paged_attention import paged_attention
    case = make_attention_case(query_lens=[1, 1, 1], context_lens=contexts, num_heads=8, num_kv_heads=2,
                               head_dim=head_dim, block_size=16, dtype=torch.float32, device=DEVICE)
    fused(monkeypatch, False)
    apart = paged_attention(*case.args(), None, None, num_splits=splits)
    fused(monkeypatch, True)
    module = importlib.import_module("cvllm_cuda.kernels.paged_attention")   # (not the package's function)
    monkeypatch.setattr(module, "combine_splits", None)   # not called
    together = check_attention(case, num_splits=splits)
    torch.testing.assert_close(together, apart, rtol=1e-6, atol=1e-6)
    assert counters_are_zero()


@pytest.mark.parametrize("head_dim", [64, 96])   # 96: 128 lanes, the last block masked
def test_attention_combined_in_its_launch_makes_the_int8_form(monkeypatch, make_attention_case, head_dim):
    from cvllm_cuda.kernels.int8_activations import attached, quantize_activations
    from cvllm_cuda.kernels.paged_attention import paged_attention
    fused(monkeypatch, True)
    module = importlib.import_module("cvllm_cuda.kernels.paged_attention")   # (not the package's function)
    monkeypatch.setattr(module, "combine_splits", None)   # not called
    case = make_attention_case(query_lens=[1, 1, 1], context_lens=[70, 0, 33], num_heads=8, num_kv_heads=2,
                               head_dim=head_dim, block_size=16, dtype=torch.float16, device=DEVICE)
    out = paged_attention(*case.args(), None, None, num_splits=4, int8_bits=4)
    flat = out.reshape(3, 8 * head_dim)   # as the output projection takes it
    for got, want in zip(attached(flat, 4), quantize_activations(flat, 4), strict=True):
        assert torch.equal(got, want)


def test_no_counters_without_the_switch_or_past_their_number(monkeypatch):
    fused(monkeypatch, False)
    assert quant_tiles.split_counters(torch.device(DEVICE), 4) is None
    fused(monkeypatch, True)
    assert quant_tiles.split_counters(torch.device(DEVICE), quant_tiles.COUNTER_SLOTS + 1) is None
    counters = quant_tiles.split_counters(torch.device(DEVICE), 4)
    assert counters is quant_tiles.split_counters(torch.device(DEVICE), 4)   # one buffer a device, kept
    assert counters.dtype == torch.int32 and counters.numel() == quant_tiles.COUNTER_SLOTS


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["q4_k", "q8_0", "gptq4_g128"])
def test_gpu_fused_split_sums_equal_the_separate_sums_over_many_launches(monkeypatch, name):
    """Compiled, a Llama-3-8B down projection's shape at the default tiles and splits, launched 50 times: every
    launch the separate sums' bits (a race between the splits, or a counter left behind, would show as a launch
    that differs), the counters zero at the end."""
    layout = dataclasses.replace(LAYOUTS[name], int8_activations=name != "gptq4_g128")
    weight = random_weight(layout, 4096, 14336, DEVICE, seed=3)
    x = torch.randn(1, 14336, device=DEVICE, dtype=torch.bfloat16)
    run = quant_gemv_int8 if layout.int8_activations else quant_gemv
    fused(monkeypatch, False)
    ref = torch.empty(1, 4096, device=DEVICE, dtype=torch.bfloat16)
    run(x, weight, ref, splits=4)
    fused(monkeypatch, True)
    outs = torch.empty(50, 1, 4096, device=DEVICE, dtype=torch.bfloat16)
    for i in range(50):
        run(x, weight, outs[i], splits=4)
    torch.cuda.synchronize()
    assert torch.equal(outs, ref.expand_as(outs)) and counters_are_zero()


@needs_gpu
@pytest.mark.gpu
def test_gpu_attention_combined_in_its_launch_over_many_launches(monkeypatch, make_attention_case):
    """Compiled, a batch-1 decode of Llama-3-8B's heads over 2k keys at the default splits, 50 launches: each the
    same bits (a race between the splits would show as a launch that differs), within rounding of the separate
    combining kernel's, the counters zero at the end."""
    from cvllm_cuda.kernels.paged_attention import paged_attention
    case = make_attention_case(query_lens=[1], context_lens=[2047], num_heads=32, num_kv_heads=8, head_dim=128,
                               block_size=16, dtype=torch.bfloat16, device=DEVICE)
    fused(monkeypatch, False)
    apart = paged_attention(*case.args(), None, None)
    fused(monkeypatch, True)
    outs = torch.stack([paged_attention(*case.args(), None, None) for _ in range(50)])
    torch.cuda.synchronize()
    assert torch.equal(outs, outs[0].expand_as(outs)) and counters_are_zero()
    torch.testing.assert_close(outs[0], apart, rtol=1e-2, atol=1e-2)


def test_prefetch_budget_is_split_over_the_programs(monkeypatch):
    """quant_tiles.prefetch_words (the weight prefetch before the PDL wait, CVLLM_GEMV_PREFETCH_MB): the budget over
    the programs' tiles, a power of two, within the program's K range and the cap; nothing off, without PDL (the
    interpreter, GPUs before Hopper) or below 8 words."""
    pdl_on = {"USE_PDL": True, "launch_pdl": True}
    monkeypatch.setenv(quant_tiles.PREFETCH_ENV, "4")
    assert quant_tiles.prefetch_words(192, 32, 4096, torch.device("cpu")) == 0          # no PDL: nothing to overlap
    monkeypatch.setattr(quant_tiles, "pdl_options", lambda device: pdl_on)
    # 4 MB over 192 tiles of 32 features (128 bytes a word row): 170 words -> 128
    assert quant_tiles.prefetch_words(192, 32, 4096, torch.device("cuda")) == 128
    assert quant_tiles.prefetch_words(192, 32, 100, torch.device("cuda")) == 64          # the program's range
    assert quant_tiles.prefetch_words(8, 32, 4096, torch.device("cuda")) == quant_tiles.PREFETCH_MAX_WORDS
    assert quant_tiles.prefetch_words(8192, 64, 4096, torch.device("cuda")) == 0         # under 8 words a program
    monkeypatch.setenv(quant_tiles.PREFETCH_ENV, "0")
    assert quant_tiles.prefetch_words(192, 32, 4096, torch.device("cuda")) == 0
