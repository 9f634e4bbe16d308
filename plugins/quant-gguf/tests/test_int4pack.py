"""torch's int4-packed CPU matmul convention, and Q4_0/Q4_1 blocks repacked for it."""

import pytest
import torch

from cvllm_gguf.dequant import dequantize
from cvllm_gguf.int4pack import int4pack_linear, pack_q4_for_int4mm, packable
from cvllm_gguf.quant_types import GGMLType
from cvllm_gguf.quantize import quantize


def test_op_computes_q_minus_8_times_scale_plus_zero(one_torch_thread):
    # small integers and power-of-two scales: every product and partial sum is exact in fp32 and only
    # the output is rounded to bf16, so the op must equal the convention exactly (q * scale + zero
    # would be off by 8 * scale)
    g = torch.Generator().manual_seed(0)
    n, k = 32, 64
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scale = 2.0 ** torch.randint(-2, 2, (k // 32, n), generator=g).float()
    zero = torch.randint(-4, 5, (k // 32, n), generator=g).float()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    x = torch.randint(-2, 3, (3, k), generator=g).float()
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.bfloat16(), packed, 32, torch.stack([scale, zero], -1).bfloat16())
    w = (q - 8).float() * scale.repeat_interleave(32, 0).T + zero.repeat_interleave(32, 0).T
    assert torch.equal(out, (x @ w.T).bfloat16())


def exact_blocks(qtype: GGMLType, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Raw Q4 rows whose d, m (and m + 8 d) are exact in bf16: half-integers and powers of two."""
    fmt_bytes = 18 if qtype == GGMLType.Q4_0 else 20
    blocks = torch.randint(0, 256, (n * k // 32, fmt_bytes), generator=g, dtype=torch.uint8)
    d = 2.0 ** torch.randint(-3, 1, (n * k // 32, 1), generator=g).half()
    blocks[:, :2] = d.view(torch.uint8)
    if qtype == GGMLType.Q4_1:
        m = torch.randint(-16, 16, (n * k // 32, 1), generator=g).half() / 2
        blocks[:, 2:4] = m.view(torch.uint8)
    return blocks.view(n, -1)


@pytest.mark.parametrize("qtype", [GGMLType.Q4_0, GGMLType.Q4_1], ids=lambda t: t.name)
def test_repacked_blocks_equal_the_dequantized_weight_exactly(qtype, one_torch_thread):
    g = torch.Generator().manual_seed(int(qtype))
    n, k = 48, 128
    raw = exact_blocks(qtype, n, k, g)
    w = dequantize(raw, qtype, (n, k))
    x = torch.randint(-2, 3, (5, k), generator=g).float()
    out = int4pack_linear(x, *pack_q4_for_int4mm(raw, qtype, k))
    assert out.dtype == torch.bfloat16
    # integer activations, weights on a 1/16 grid below 16: every partial sum is exact in fp32
    assert torch.equal(out, (x @ w.T).bfloat16())


@pytest.mark.parametrize("qtype", [GGMLType.Q4_0, GGMLType.Q4_1], ids=lambda t: t.name)
def test_real_weights_agree_within_bf16_tolerance(qtype, one_torch_thread):
    torch.manual_seed(1)
    w = torch.randn(96, 576) * 0.04 + 0.01
    raw = quantize(w, qtype)
    x = torch.randn(4, 576)
    exact = x @ dequantize(raw, qtype, w.shape).T
    out = int4pack_linear(x, *pack_q4_for_int4mm(raw, qtype, 576)).float()
    torch.testing.assert_close(out, exact, rtol=2e-2, atol=2e-2 * exact.abs().mean().item())
    assert (out - exact).abs().max() > 0  # bf16 really was used: not the fp32 path by accident


def test_only_multiples_of_16_output_rows_pack():
    assert packable(192) and packable(49152) and not packable(100)
