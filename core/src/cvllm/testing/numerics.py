"""Comparing a kernel's floating-point output with a reference's, in units in the last place (ulp): kernel tests
on the GPU and in Triton's interpreter bound how many roundings apart a fused kernel may land from the torch code
it replaces."""

from __future__ import annotations

import torch

_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Representable numbers between ``a`` and ``b`` elementwise (0: bit-equal; +0 and -0 are equal), on the CPU."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    bits = _BITS[a.dtype]
    magnitude = (1 << (torch.finfo(a.dtype).bits - 1)) - 1

    def ordered(t: torch.Tensor) -> torch.Tensor:  # sign-magnitude bits to a monotonic integer
        i = t.detach().cpu().contiguous().view(bits).long()
        return torch.where(i < 0, -(i & magnitude), i)

    return (ordered(a) - ordered(b)).abs()


def assert_ulp_close(out: torch.Tensor, ref: torch.Tensor, max_ulp: int, max_mismatch_fraction: float = 1.0) -> None:
    """Every element within ``max_ulp`` of the reference, and at most ``max_mismatch_fraction`` of them not
    bit-equal (a flipped rounding must stay rare)."""
    ulps = ulp_distance(out, ref)
    mismatches = (ulps > 0).float().mean().item()
    assert ulps.max().item() <= max_ulp, f"{ulps.max().item()} ulp apart (<= {max_ulp}); {mismatches:.3%} differ"
    assert mismatches <= max_mismatch_fraction, f"{mismatches:.3%} of elements differ (<= {max_mismatch_fraction})"
