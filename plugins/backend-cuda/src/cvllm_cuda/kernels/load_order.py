"""Two loads of a short kernel in flight together.

The gated activation (silu(gate) * up) loads gate and up, then computes silu(gate) with an IEEE division, whose slow
path ptxas expands into branches; ptxas then issues the load of up after the first of them, i.e. after silu's math
has waited for gate: two round trips to memory where one suffices (a barrier after the loads does not stop it, nor
does loading up first). ``joined(a, b)`` is ``a`` made to depend on ``b`` (a byte permute that keeps ``a``'s four
bytes): whatever uses it waits for both, so ptxas issues both loads before it. It costs one PRMT an element; the bits
are ``a``'s. Triton's interpreter (no inline PTX) gets ``a`` itself.
"""

from __future__ import annotations

import triton
import triton.language as tl

_INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def joined(a, b):
    """``a`` (32-bit elements), computed only once ``b`` (the same shape) is in."""
    if _INTERPRETED:
        return a
    else:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x3210;", "=r,r,r", [a, b], dtype=a.dtype,
                                         is_pure=True, pack=1)
