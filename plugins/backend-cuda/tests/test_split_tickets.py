"""K splits added in the launch by the split that draws the last ticket (kernels/split_tickets.py,
CVLLM_IN_LAUNCH_SPLIT_SUMS) in the swapped GEMM of decode batches: the same bits as sum_splits_kernel after the
launch, in Triton's interpreter and compiled on a GPU. (The MMA GEMV's: test_quant_gemv_mma.py.)"""

from __future__ import annotations

import os

import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")

from test_quant_gemv_mma import DEVICE, needs_device, needs_gpu  # noqa: E402
from test_quant_matmul import LAYOUTS, random_weight  # noqa: E402

from cvllm_cuda.kernels import quant_gemm_swapped, split_tickets  # noqa: E402


def swapped_both_ways(name: str, t: int, n: int, k: int, splits: int | None, config=None) -> list[torch.Tensor]:
    """The swapped GEMM's output with the splits summed by sum_splits_kernel, then twice in the launch (the tickets
    must be back at zero for the second), each into the middle of wider rows."""
    weight = random_weight(LAYOUTS[name], n, k, DEVICE, seed=t + n)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16).to(DEVICE)
    outs = []
    for fused in (False, True, True):
        wide = torch.full((t, n + 6), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        quant_gemm_swapped.quant_gemm_swapped(x, weight, wide[:, 3:3 + n], config=config, splits=splits,
                                              fused_sums=fused)
        assert wide[:, :3].isnan().all() and wide[:, 3 + n:].isnan().all()   # nothing outside the rows' span
        outs.append(wide[:, 3:3 + n])
    return outs


@needs_device
@pytest.mark.parametrize("name,t,n,splits", [("q4_k", 20, 130, 3), ("gptq4_g128", 5, 64, 2)])
def test_swapped_gemm_splits_added_in_the_launch_change_no_bit(monkeypatch, name, t, n, splits):
    calls = []
    real = quant_gemm_swapped.add_splits
    monkeypatch.setattr(quant_gemm_swapped, "add_splits", lambda *a: calls.append(a[2]) or real(*a))
    outs = swapped_both_ways(name, t, n, 512, splits, config=(64, 16, 4, 1, 16))
    assert len(calls) == 1 and calls[0] > 1   # split; only the first launch had sum_splits_kernel after it
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    assert not split_tickets.counters(torch.device(DEVICE), 1).any()


def test_which_launches_add_their_splits_themselves():
    """launch_tickets: a split launch asked to (or, unasked, under its kernel's switch) gets the counters; one split,
    a launch asked not to, or more tiles than counters gets none (sum_splits_kernel then). By default the MMA GEMV
    adds its own splits and the swapped GEMM does not (timed, split_tickets.py)."""
    cpu = torch.device("cpu")
    assert split_tickets.launch_tickets(cpu, 8, 4, None, False) is None
    assert split_tickets.launch_tickets(cpu, 8, 4, True, False) is split_tickets.counters(cpu, 8)
    assert split_tickets.launch_tickets(cpu, 8, 4, None, True) is split_tickets.counters(cpu, 8)
    assert split_tickets.launch_tickets(cpu, 8, 4, False, True) is None
    assert split_tickets.launch_tickets(cpu, 8, 1, True, True) is None
    assert split_tickets.launch_tickets(cpu, split_tickets.SLOTS + 1, 4, True, True) is None
    if "CVLLM_IN_LAUNCH_SPLIT_SUMS" not in os.environ:
        assert split_tickets.ENABLED and not split_tickets.SWAPPED_ENABLED


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("t", [16, 48, 64])
def test_gpu_swapped_gemm_splits_added_in_the_launch(monkeypatch, t):
    """Llama-3-8B's projections at decode-batch rows, the default tiles and splits: the same bits as the separate
    sums, eagerly and replayed from a CUDA graph; the default split counts do split these shapes, and no fused
    launch, captured ones included, falls back to the separate sums."""
    separate_sums = []
    real = quant_gemm_swapped.add_splits
    monkeypatch.setattr(quant_gemm_swapped, "add_splits", lambda *a: separate_sums.append(a[2]) or real(*a))
    for n, k in ((6144, 4096), (4096, 4096), (4096, 14336)):
        outs = swapped_both_ways("q4_k", t, n, k, None)
        assert len(separate_sums) == 1 and separate_sums[0] > 1, (t, n, k, separate_sums)   # the unfused launch
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2]), (t, n, k)
        weight = random_weight(LAYOUTS["q4_k"], n, k, DEVICE, seed=t + n)
        x = torch.randn(t, k, device=DEVICE).to(torch.bfloat16)
        separate = torch.empty(t, n, dtype=torch.bfloat16, device=DEVICE)
        quant_gemm_swapped.quant_gemm_swapped(x, weight, separate, fused_sums=False)
        separate_sums.clear()
        out = torch.empty_like(separate)
        quant_gemm_swapped.quant_gemm_swapped(x, weight, out, fused_sums=True)   # (eager first: the tickets)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            quant_gemm_swapped.quant_gemm_swapped(x, weight, out, fused_sums=True)
        for _ in range(5):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, separate), (t, n, k)
        assert not separate_sums, (t, n, k, separate_sums)
