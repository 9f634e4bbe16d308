"""The tensor-core W4A16 GEMV (kernels/quant_gemv_mma.py) against dequantize-then-matmul in float32: GPTQ/AWQ group
sizes, Q4_0 / Q4_1 / Q4_K, 1-16 rows, K splits, masked feature tails. In Triton's interpreter the MMAs are computed
from the lanes' registers by broadcasting, which checks the lanes' bookkeeping (which words, which x, which
features); compiled on a GPU, the PTX itself."""

from __future__ import annotations

import os

import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")

from test_quant_matmul import LAYOUTS, random_weight  # noqa: E402

from cvllm_cuda.kernels.quant_gemv_mma import applies, group_units, quant_gemv_mma  # noqa: E402
from cvllm_cuda.quant_planes import QuantLayout, dequantize_planes  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
needs_device = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                  reason="needs Triton's interpreter or a CUDA GPU")
needs_gpu = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")

MMA_LAYOUTS = {
    "gptq4_g128": LAYOUTS["gptq4_g128"],
    "gptq4_g32": QuantLayout(4, 0, 32, 32, b_mode=2, b_const=-1),
    "gptq4_g64": QuantLayout(4, 0, 64, 64, b_mode=2, b_const=-1),
    "gptq4_per_channel": QuantLayout(4, 0, 512, 512, b_mode=2, b_const=-1),
    "q4_0": QuantLayout(4, 0, 32, 32, b_const=-8),
    "q4_1": LAYOUTS["q4_1"],
    "q4_k": LAYOUTS["q4_k"],
}


def relative_error(weight, t: int, seed: int = 0, **kwargs) -> float:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, weight.in_features, generator=gen).to(torch.bfloat16).to(weight.low.device)
    ref = x.float() @ dequantize_planes(weight).T
    out = torch.full((t, weight.out_features), float("nan"), dtype=torch.bfloat16, device=weight.low.device)
    quant_gemv_mma(x, weight, out, **kwargs)
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def test_which_layouts_it_takes():
    assert applies(LAYOUTS["gptq4_g128"], torch.bfloat16, 4096)
    assert applies(LAYOUTS["q4_k"], torch.bfloat16, 256)
    assert not applies(LAYOUTS["gptq4_g128"], torch.float16, 4096)     # the MMA's operands are bf16
    assert not applies(LAYOUTS["q6_k"], torch.bfloat16, 4096)          # a high plane
    assert not applies(LAYOUTS["q8_0"], torch.bfloat16, 4096)
    assert not applies(QuantLayout(4, 0, 48, 96, b_mode=2, b_const=-1), torch.bfloat16, 4800)   # 48-input groups
    assert not applies(LAYOUTS["gptq4_g128"], torch.bfloat16, 4160)    # K not whole K steps
    assert group_units(LAYOUTS["gptq4_g128"]) == 4 and group_units(LAYOUTS["q4_k"]) == 1
    assert group_units(MMA_LAYOUTS["gptq4_g64"]) == 2 and group_units(MMA_LAYOUTS["gptq4_per_channel"]) == 4


@needs_device
@pytest.mark.parametrize("name", sorted(MMA_LAYOUTS))
@pytest.mark.parametrize("t", [1, 3, 8, 13])
def test_matches_dequantize_then_matmul(name, t):
    weight = random_weight(MMA_LAYOUTS[name], 128, 512, DEVICE, seed=t)
    # bf16 output of float32 sums: one rounding
    assert relative_error(weight, t, warps=2, splits=1) < 1e-2


@needs_device
@pytest.mark.parametrize("splits", [2, 4])
def test_k_splits_add_up(splits):
    weight = random_weight(MMA_LAYOUTS["gptq4_g128"], 64, 1024, DEVICE, seed=splits)
    assert relative_error(weight, 2, warps=2, splits=splits) < 1e-2


@needs_device
@pytest.mark.parametrize("name,t,n,splits", [("gptq4_g128", 1, 72, 3), ("gptq4_g32", 9, 40, 1), ("q4_k", 4, 64, 2)])
def test_early_weights_change_no_bit(monkeypatch, name, t, n, splits):
    """quant_tiles.EARLY_WEIGHTS: the first K step's words and factors read before the PDL wait, the step peeled
    from the loop; in the interpreter the same bits (compiled, ptxas may contract the peeled step's multiply-adds
    otherwise: the GPU test allows an ulp), with K splits and a feature tail."""
    from cvllm_cuda.kernels import quant_tiles
    weight = random_weight(MMA_LAYOUTS[name], n, 512, DEVICE, seed=5)
    x = torch.randn(t, 512, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(DEVICE)
    outs = []
    for early in (False, True):
        monkeypatch.setattr(quant_tiles, "EARLY_WEIGHTS", early)
        outs.append(torch.full((t, n), float("nan"), dtype=torch.bfloat16, device=DEVICE))
        quant_gemv_mma(x, weight, outs[-1], warps=2, splits=splits)
    assert not outs[0].isnan().any()
    if INTERPRET:
        assert torch.equal(outs[0], outs[1])
    else:
        assert ((outs[0].float() - outs[1].float()).abs() <= outs[0].float().abs() * 2.0 ** -7).all()


@needs_device
@pytest.mark.parametrize("name,t,n,k,splits", [("gptq4_g128", 3, 40, 1024, 3), ("gptq4_g32", 9, 72, 384, 2),
                                              ("q4_k", 1, 16, 768, 4)])
def test_prefetched_steps_change_no_bit(monkeypatch, name, t, n, k, splits):
    """PREFETCH (CVLLM_GEMV_MMA_PREFETCH): each K step's words and factors loaded during the step before, the loop
    carrying them, the load past a split's end masked off: the same bits as the plain loop in the interpreter, with
    the early weights and without, K splits of unequal length and a feature tail."""
    from cvllm_cuda.kernels import quant_tiles
    weight = random_weight(MMA_LAYOUTS[name], n, k, DEVICE, seed=n + t)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16).to(DEVICE)
    for early in (False, True):
        monkeypatch.setattr(quant_tiles, "EARLY_WEIGHTS", early)
        outs = []
        for prefetch in (False, True):
            outs.append(torch.full((t, n), float("nan"), dtype=torch.bfloat16, device=DEVICE))
            quant_gemv_mma(x, weight, outs[-1], warps=2, splits=splits, prefetch=prefetch)
        assert not outs[0].isnan().any()
        if INTERPRET:
            assert torch.equal(outs[0], outs[1]), early
        else:
            assert ((outs[0].float() - outs[1].float()).abs() <= outs[0].float().abs() * 2.0 ** -7).all()


@needs_device
@pytest.mark.parametrize("name,t,n,k,splits", [("gptq4_g128", 1, 64, 1024, 3), ("gptq4_g128", 3, 40, 1024, 2),
                                              ("gptq4_g32", 9, 72, 384, 4), ("q4_k", 1, 16, 768, 5)])
def test_splits_added_in_the_launch_change_no_bit(monkeypatch, name, t, n, k, splits):
    """fused_sums (CVLLM_IN_LAUNCH_SPLIT_SUMS): the split that draws the last ticket adds the partials in split order,
    as sum_splits_kernel does: the same bits, into rows of any stride, a feature tail; the tickets back at zero."""
    import cvllm_cuda.kernels.quant_gemv_mma as mma
    from cvllm_cuda.kernels import split_tickets
    separate = []
    real = mma.add_splits
    monkeypatch.setattr(mma, "add_splits", lambda *a: separate.append(a[2]) or real(*a))
    weight = random_weight(MMA_LAYOUTS[name], n, k, DEVICE, seed=n + t)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16).to(DEVICE)
    outs = []
    for fused in (False, True, True):   # (twice: the tickets are reusable)
        outs.append(torch.full((t, n + 6), float("nan"), dtype=torch.bfloat16, device=DEVICE))
        quant_gemv_mma(x, weight, outs[-1][:, 3:3 + n], warps=2, splits=splits, fused_sums=fused)
    assert separate == [splits]   # (only the first launch had sum_splits_kernel after it)
    inner = [out[:, 3:3 + n] for out in outs]
    assert not inner[0].isnan().any()
    assert torch.equal(inner[0], inner[1]) and torch.equal(inner[1], inner[2])
    assert outs[1][:, :3].isnan().all() and outs[1][:, 3 + n:].isnan().all()   # nothing outside the rows' span
    assert not split_tickets.counters(torch.device(DEVICE), 1).any()


@needs_device
@pytest.mark.parametrize("n", [9, 40, 100])
def test_feature_tails_are_masked(n):
    weight = random_weight(MMA_LAYOUTS["gptq4_g32"], n, 256, DEVICE, seed=n)
    assert relative_error(weight, 5, warps=4, splits=1) < 1e-2


@needs_device
def test_nothing_past_the_output_is_written():
    weight = random_weight(MMA_LAYOUTS["gptq4_g128"], 40, 256, DEVICE)
    x = torch.randn(3, 256).to(torch.bfloat16).to(DEVICE)
    buffer = torch.full((3 * 40 + 64,), 7.0, dtype=torch.bfloat16, device=DEVICE)
    quant_gemv_mma(x, weight, buffer[:120].view(3, 40), warps=2, splits=1)
    assert (buffer[120:] == 7).all() and not (buffer[:120] == 7).all()
    wide = torch.full((3, 50), 7.0, dtype=torch.bfloat16, device=DEVICE)   # rows 50 apart, one split: stored directly
    quant_gemv_mma(x, weight, wide[:, 5:45], warps=2, splits=1)
    assert (wide[:, :5] == 7).all() and (wide[:, 45:] == 7).all()
    assert torch.equal(wide[:, 5:45], buffer[:120].view(3, 40))


def test_warps_an_sm_override_keeps_the_tile(monkeypatch):
    """CVLLM_GEMV_MMA_WARPS_PER_SM: the K split's aim changes, the tile (words, warps a program) does not."""
    import cvllm_cuda.kernels.quant_gemv_mma as module

    for rows in (1, 3, 8, 13):
        words, warps, per_sm = module.tile(rows)
        monkeypatch.setattr(module, "WARPS_PER_SM", 12)
        assert module.tile(rows) == (words, warps, 12)
        monkeypatch.setattr(module, "WARPS_PER_SM", None)
        assert module.tile(rows) == (words, warps, per_sm)


def test_rejects_what_it_cannot_take():
    weight = random_weight(LAYOUTS["q6_k"], 32, 256, "cpu")
    with pytest.raises(ValueError, match="4-bit"):
        quant_gemv_mma(torch.zeros(1, 256, dtype=torch.bfloat16), weight, torch.empty(1, 32, dtype=torch.bfloat16))
    weight = random_weight(LAYOUTS["gptq4_g128"], 32, 256, "cpu")
    with pytest.raises(ValueError, match="rows"):
        quant_gemv_mma(torch.zeros(17, 256, dtype=torch.bfloat16), weight, torch.empty(17, 32, dtype=torch.bfloat16))


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gptq4_g128", "gptq4_g32", "q4_1", "q4_k"])
@pytest.mark.parametrize("t", [1, 2, 5, 8, 11, 16])
def test_gpu_mma_gemv_on_llama_shapes(name, t):
    for n, k in ((6144, 4096), (4096, 14336), (1000, 512)):
        weight = random_weight(MMA_LAYOUTS[name], n, k, "cuda", seed=n + t)
        assert relative_error(weight, t) < 1e-2, (name, t, n, k)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("t", [1, 3, 8])
def test_gpu_splits_added_in_the_launch(monkeypatch, prefetch, t):
    """fused_sums on the GPU: the same bits as sum_splits_kernel after the launch, every time, eagerly and replayed
    from a CUDA graph (the tickets must be back at zero after each launch); the default split counts do split these
    shapes, and no fused launch, captured ones included, falls back to the separate sums."""
    import cvllm_cuda.kernels.quant_gemv_mma as mma
    separate_sums = []
    real = mma.add_splits
    monkeypatch.setattr(mma, "add_splits", lambda *a: separate_sums.append(a[2]) or real(*a))
    for n, k in ((6144, 4096), (4096, 14336), (28672, 4096)):
        weight = random_weight(MMA_LAYOUTS["gptq4_g128"], n, k, "cuda", seed=n + t)
        x = torch.randn(t, k, device="cuda").to(torch.bfloat16)
        separate = torch.empty(t, n, dtype=torch.bfloat16, device="cuda")
        quant_gemv_mma(x, weight, separate, prefetch=prefetch, fused_sums=False)
        assert len(separate_sums) == 1 and separate_sums[0] > 1, (n, k, separate_sums)
        separate_sums.clear()
        out = torch.empty_like(separate)
        for _ in range(3):
            out.zero_()
            quant_gemv_mma(x, weight, out, prefetch=prefetch, fused_sums=True)
            assert torch.equal(out, separate), (n, k)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            quant_gemv_mma(x, weight, out, prefetch=prefetch, fused_sums=True)
        for _ in range(5):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, separate), (n, k)
        assert not separate_sums, (n, k, separate_sums)


@needs_gpu
@pytest.mark.gpu
def test_gpu_mma_gemv_is_deterministic_and_graph_safe():
    weight = random_weight(MMA_LAYOUTS["gptq4_g128"], 4096, 4096, "cuda")
    x = torch.randn(1, 4096, device="cuda").to(torch.bfloat16)
    out = torch.empty(1, 4096, dtype=torch.bfloat16, device="cuda")
    quant_gemv_mma(x, weight, out)
    first = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quant_gemv_mma(x, weight, out)
    for _ in range(5):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)


@needs_device
def test_quant_matmul_routes_gptq_rows_to_it(monkeypatch):
    """CVLLM_GEMV_MMA (quant_gemv_mma.ENABLED, on by default): quant_matmul's 1-ROUTED_ROWS rows of a GPTQ weight go
    through it, into an output of any row stride; more rows keep the GEMM, and the switch off keeps them all."""
    import cvllm_cuda.kernels.quant_gemv_mma as mma
    from cvllm_cuda.kernels.quant_matmul import quant_matmul
    calls = []
    real = mma.quant_gemv_mma
    monkeypatch.setattr(mma, "ENABLED", True)
    monkeypatch.setattr(mma, "quant_gemv_mma", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    weight = random_weight(MMA_LAYOUTS["gptq4_g128"], 64, 256, DEVICE, seed=3)
    x = torch.randn(16, 256).to(torch.bfloat16).to(DEVICE)
    ref = x.float() @ dequantize_planes(weight).T
    monkeypatch.setattr(mma, "ROUTED_ROWS", 16)
    for t in (1, 5, 16):
        out = quant_matmul(x[:t], weight)
        assert ((out.float() - ref[:t]).abs().max() / ref[:t].abs().max()).item() < 1e-2
    odd = torch.cat([torch.zeros(1, dtype=torch.bfloat16, device=DEVICE), x[:3].flatten()])[1:].view(3, 256)
    out = quant_matmul(odd, weight)   # x at an odd element: read as int32 pairs from a copy
    assert ((out.float() - ref[:3]).abs().max() / ref[:3].abs().max()).item() < 1e-2
    wide = torch.zeros(2, 100, dtype=torch.bfloat16, device=DEVICE)
    quant_matmul(x[:2], weight, wide[:, 10:74])
    assert ((wide[:, 10:74].float() - ref[:2]).abs().max() / ref[:2].abs().max()).item() < 1e-2
    assert (wide[:, :10] == 0).all() and (wide[:, 74:] == 0).all()
    assert calls == [1, 5, 16, 3, 2]
    quant_matmul(torch.randn(17, 256).to(torch.bfloat16).to(DEVICE), weight)
    monkeypatch.setattr(mma, "ROUTED_ROWS", 8)
    quant_matmul(x[:9], weight)
    monkeypatch.setattr(mma, "ENABLED", False)
    quant_matmul(x[:1], weight)
    assert calls == [1, 5, 16, 3, 2]
