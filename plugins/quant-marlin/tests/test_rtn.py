"""The round-to-nearest quantizer behind ``--isq gptq`` and ``cvllm convert`` against the tests' independent
reference (marlin_reference.rtn: a loop per group), and its edge cases."""

from __future__ import annotations

import pytest
import torch
from marlin_reference import rtn

from cvllm_marlin.rtn import quantize_rtn


@pytest.mark.parametrize("bits,group,sym", [(4, 32, True), (4, 64, False), (8, 32, False), (4, -1, True)])
def test_matches_the_reference_quantizer(bits, group, sym):
    weight = torch.randn(24, 128, generator=torch.Generator().manual_seed(bits + group)) * 0.05
    ours = quantize_rtn(weight, bits, group, sym)
    theirs = rtn(weight, bits, group, sym)
    assert torch.equal(ours.q.t().long(), theirs.q)
    assert torch.equal(ours.scales, theirs.scales)
    assert torch.equal(ours.zeros.long(), theirs.zeros)
    assert torch.equal(ours.dequantized(), theirs.dequantized())


def test_error_is_within_half_a_step():
    weight = torch.randn(16, 256, generator=torch.Generator().manual_seed(3))
    q = quantize_rtn(weight, 4, 128, sym=False)
    step = q.scales.t().float().repeat_interleave(128, dim=1)
    assert ((q.dequantized() - weight).abs() <= step / 2 + 1e-6).all()


def test_zero_groups_and_bad_shapes():
    weight = torch.zeros(4, 64)
    q = quantize_rtn(weight, 4, 32)
    assert torch.equal(q.dequantized(), weight)
    with pytest.raises(ValueError, match="whole groups"):
        quantize_rtn(torch.zeros(4, 60), 4, 32)
    with pytest.raises(ValueError, match="3 bits"):
        quantize_rtn(weight, 3, 32)
