"""The split-KV decode attention with its splits combined by the last of a tile's programs, in its own launch
(CVLLM_ATTENTION_FUSED_COMBINE=1, attention_splits.FUSED_COMBINE; off by default): the oracle's output, the combining
kernel's within float32 rounding, the int8 form it makes for the output projection, the ticket counters zero again
after every launch. In Triton's interpreter (programs run one after another: the last split is the last program),
compiled for sm_90 (test_sm90_compile.py) and on a GPU where one is (50 launches: a race between the splits would
show)."""

from __future__ import annotations

import importlib

import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")  # a skip locally, an error under CI=true

from test_int8_activations import assert_same_form, int8_layer, taken  # noqa: E402
from test_quant_matmul import DEVICE, needs_gpu  # noqa: E402

from cvllm_cuda.kernels import attention_splits  # noqa: E402
from cvllm_cuda.kernels.int8_activations import quantize_activations  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")


def fused(monkeypatch, on: bool) -> None:
    monkeypatch.setattr(attention_splits, "FUSED_COMBINE", on)


def without_combining_kernel(monkeypatch) -> None:
    module = importlib.import_module("cvllm_cuda.kernels.paged_attention")   # (not the package's function)
    monkeypatch.setattr(module, "combine_splits", None)   # a call would fail


def counters_are_zero() -> bool:
    return all(int(c.abs().sum()) == 0 for c in attention_splits._counters.values())


@pytest.mark.parametrize("splits,head_dim,contexts", [(4, 64, [127, 0, 63]), (16, 80, [40, 3, 200])])
def test_attention_splits_combined_in_its_launch(monkeypatch, make_attention_case, check_attention, splits,
                                                 head_dim, contexts):
    """16 splits: most slices of the short contexts empty; head_dim 80: masked lanes."""
    from cvllm_cuda.kernels.paged_attention import paged_attention
    case = make_attention_case(query_lens=[1, 1, 1], context_lens=contexts, num_heads=8, num_kv_heads=2,
                               head_dim=head_dim, block_size=16, dtype=torch.float32, device=DEVICE)
    fused(monkeypatch, False)
    apart = paged_attention(*case.args(), None, None, num_splits=splits)
    fused(monkeypatch, True)
    without_combining_kernel(monkeypatch)
    together = check_attention(case, num_splits=splits)   # against the oracle
    torch.testing.assert_close(together, apart, rtol=1e-6, atol=1e-6)
    assert counters_are_zero()


@pytest.mark.parametrize("sliding_window", [None, 24])
def test_mixed_batch_and_window_combined_in_its_launch(monkeypatch, make_attention_case, check_attention,
                                                       sliding_window):
    """Prefill chunks beside decodes (tiles of several queries, each row its own heads' splits) and a sliding
    window (slices that see no key): the oracle's output, the counters zero again."""
    case = make_attention_case(query_lens=[5, 1, 3], context_lens=[40, 90, 0], num_heads=8, num_kv_heads=2,
                               head_dim=64, block_size=16, dtype=torch.float32, device=DEVICE)
    fused(monkeypatch, True)
    without_combining_kernel(monkeypatch)
    check_attention(case, sliding_window=sliding_window, num_splits=4)
    assert counters_are_zero()


@pytest.mark.parametrize("head_dim", [64, 96])   # 96: 128 lanes, the last block masked
@pytest.mark.parametrize("low_bits", [4, 8])
def test_attention_combined_in_its_launch_makes_the_quantizers_bits(monkeypatch, make_attention_case, head_dim,
                                                                   low_bits):
    from cvllm_cuda.kernels.paged_attention import paged_attention
    case = make_attention_case(query_lens=[1, 1, 1], context_lens=[70, 0, 33], num_heads=8, num_kv_heads=2,
                               head_dim=head_dim, block_size=16, dtype=torch.float16, device=DEVICE)
    layer = int8_layer(low_bits, 8, 8 * head_dim)
    fused(monkeypatch, True)
    without_combining_kernel(monkeypatch)
    out = paged_attention(*case.args(), None, None, num_splits=4, feeds=layer)
    flat = out.reshape(3, 8 * head_dim)   # as the output projection takes it
    assert_same_form(taken(layer, flat), quantize_activations(flat, low_bits))
    assert counters_are_zero()


def test_no_counters_without_the_switch_or_past_their_number(monkeypatch):
    device = torch.device(DEVICE)
    fused(monkeypatch, False)
    assert attention_splits.split_counters(device, 4) is None
    fused(monkeypatch, True)
    assert attention_splits.split_counters(device, attention_splits.COUNTER_SLOTS + 1) is None
    counters = attention_splits.split_counters(device, 4)
    assert counters is attention_splits.split_counters(device, 4)   # one buffer a device, kept
    assert counters.dtype == torch.int32 and counters.numel() == attention_splits.COUNTER_SLOTS


@needs_gpu
@pytest.mark.gpu
def test_gpu_attention_combined_in_its_launch_over_many_launches(monkeypatch, make_attention_case):
    """Compiled, a batch-1 decode of Llama-3-8B's heads over 2k keys at the default splits, 50 launches: each the
    same bits, within rounding of the separate combining kernel's, the counters zero at the end."""
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
