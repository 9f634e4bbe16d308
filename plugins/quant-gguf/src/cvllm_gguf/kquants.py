"""float32 to K-quant blocks (Q2_K..Q6_K) in torch, byte for byte what ggml's reference quantizers write.

These follow ``quantize_row_q{2..6}_K_ref`` in ggml-quants.c, the path ``ggml_quantize_chunk`` takes
without an importance matrix. Every group of 16 or 32 values runs the same scale search as ggml, with
all groups of all super-blocks processed at once; only the fixed-length loops of the algorithm (over the
elements of a group, the candidate scales, the refinement passes) are Python loops. Bytes match only if
the float32 arithmetic matches, so:

- sums are accumulated element by element, left to right (``torch.sum`` would reorder them);
- ``a*b*c`` is ``(a*b)*c`` and there is never a fused multiply-add, as in the C code built without FMA;
- ``nearest_int`` is ggml's float trick (add 1.5 * 2**23, read the mantissa bits): round half to even;
- constants such as ``0.1f * is`` are formed in float32 before they meet the data;
- square roots are taken in float64 and rounded, since torch's float32 sqrt is not always correctly rounded.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

F32 = torch.float32
GROUP_MAX_EPS = 1e-15  # ggml's threshold below which a group counts as all zero (compared in float32)


def _c(value: float) -> torch.Tensor:
    """A float32 constant, so that arithmetic on constants rounds as C's float arithmetic does."""
    return torch.tensor(value, dtype=F32)


def _divide(values: torch.Tensor, constant: float) -> torch.Tensor:
    """values / constant, correctly rounded: CUDA turns a division by a scalar into a multiplication
    by its reciprocal, which can differ in the last bit, so the divisor is a full tensor."""
    return values / torch.full_like(values, constant)


def _nearest_int(values: torch.Tensor) -> torch.Tensor:
    """ggml's nearest_int: round half to even through the float32 addition of 1.5 * 2**23 (int32)."""
    shifted = (values + _c(12582912.0)).view(torch.int32)
    return (shifted & 0x007FFFFF) - 0x00400000


def _running_sum(terms: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in C loop order: ((0 + t0) + t1) + ... (float32)."""
    total = torch.zeros(terms.shape[:-1], dtype=F32, device=terms.device)
    for i in range(terms.shape[-1]):
        total = total + terms[..., i]
    return total


def _sqrt(values: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 sqrt, as sqrtf. torch's vectorised float32 sqrt is off by an ulp for
    some inputs; the float64 root rounded to float32 is exact (53 bits cover the double rounding)."""
    return torch.sqrt(values.to(torch.float64)).to(F32)


def _signed_absmax(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(value of largest magnitude with its sign, that magnitude), the first on ties, over the last dim."""
    magnitude = values.abs()
    index = magnitude.argmax(dim=-1, keepdim=True)
    return values.gather(-1, index).squeeze(-1), magnitude.gather(-1, index).squeeze(-1)


def _qx_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qx_quants(rmse_type=1, no weights) on groups x [m, n]: (scale [m], quants [m, n] in 0..2*nmax-1).

    Starts from scale max/-nmax and tries 18 nearby ones, keeping the one that maximises the
    x²-weighted fit sum(w*x*l)² / sum(w*l²)."""
    top, amax = _signed_absmax(x)
    zero = amax < GROUP_MAX_EPS
    top = torch.where(zero, torch.ones_like(top), top)[:, None]
    weight_x = (x * x) * x
    weight = x * x

    def attempt(numerator: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        levels = _nearest_int((numerator / top) * x).clamp(-nmax, nmax - 1)
        as_float = levels.to(F32)
        return levels, _running_sum(weight_x * as_float), _running_sum((weight * as_float) * as_float)

    levels, sumlx, suml2 = attempt(_c(-nmax))
    scale = torch.where(suml2 != 0, sumlx / suml2, torch.zeros_like(sumlx))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        candidate, slx, sl2 = attempt(-(_c(nmax) + _c(0.1) * _c(step)))
        better = (sl2 > 0) & (slx * slx > best * sl2)
        levels = torch.where(better[:, None], candidate, levels)
        scale = torch.where(better, slx / sl2, scale)
        best = torch.where(better, scale * slx, best)
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    return scale, torch.where(zero[:, None], torch.zeros_like(levels), levels + nmax)


def _q3_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """make_q3_quants(do_rmse=True) on groups x [m, n]: (scale [m], quants [m, n] in 0..2*nmax-1).

    Rounds to scale max/-nmax, then up to five passes move single quants when that improves the
    x²-weighted fit. Inside a pass each element sees the sums as updated by the elements before it,
    so the loop runs over elements in order; a group whose pass changed nothing would not change in
    later passes either, so running every group for all five passes is what ggml's early exit does."""
    top, amax = _signed_absmax(x)
    zero = amax < GROUP_MAX_EPS
    top = torch.where(zero, torch.ones_like(top), top)[:, None]
    weight = x * x
    weight_x = weight * x
    levels = _nearest_int((_c(-nmax) / top) * x).clamp(-nmax, nmax - 1)
    as_float = levels.to(F32)
    sumlx = _running_sum(weight_x * as_float)
    suml2 = _running_sum((weight * as_float) * as_float)
    for _ in range(5):
        changed = torch.zeros_like(zero)
        for i in range(x.shape[1]):
            old = levels[:, i].to(F32)
            slx = sumlx - weight_x[:, i] * old
            sl2 = suml2 - (weight[:, i] * old) * old
            movable = slx > 0
            new = _nearest_int((x[:, i] * sl2) / slx).clamp(-nmax, nmax - 1)
            new_f = new.to(F32)
            slx = slx + weight_x[:, i] * new_f
            sl2 = sl2 + (weight[:, i] * new_f) * new_f
            accept = movable & (new != levels[:, i]) & (sl2 > 0) & ((slx * slx) * suml2 > (sumlx * sumlx) * sl2)
            levels[:, i] = torch.where(accept, new, levels[:, i])
            sumlx = torch.where(accept, slx, sumlx)
            suml2 = torch.where(accept, sl2, suml2)
            changed |= accept
        if not bool(changed.any()):
            break
    scale = torch.where(suml2 > 0, sumlx / suml2, torch.zeros_like(sumlx))
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    return scale, torch.where(zero[:, None], torch.zeros_like(levels), levels + nmax)


def _qkx2_quants(x: torch.Tensor, weights: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
                 use_mad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """make_qkx2_quants on groups x [m, n]: (scale [m], the_min [m] (>= 0), quants [m, n] in 0..nmax).

    Fits x ≈ scale * l - the_min: rounds on the full range, then tries nstep + 1 stretched ranges,
    solving least squares for scale and min each time and keeping the lowest weighted error. A better
    fit moves the min, and later candidates are measured from the moved min, as in ggml."""
    low = x.amin(dim=-1)
    high = x.amax(dim=-1)
    sum_w = _running_sum(weights)
    sum_x = _running_sum(weights * x)
    low = torch.where(low > 0, torch.zeros_like(low), low)
    flat = high == low
    span = torch.where(flat, torch.ones_like(high), high - low)

    def error(scale: torch.Tensor, offset: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        diff = ((scale[:, None] * levels.to(F32)) + offset[:, None]) - x
        return _running_sum(weights * (diff.abs() if use_mad else diff * diff))

    iscale = _c(nmax) / span
    scale = _c(1.0) / iscale
    levels = _nearest_int(iscale[:, None] * (x - low[:, None])).clamp(0, nmax)
    best = error(scale, low, levels)
    for step in range(nstep + 1):
        numerator = (_c(rmin) + _c(rdelta) * _c(step)) + _c(nmax)
        span = torch.where(flat, torch.ones_like(high), high - low)
        candidate = _nearest_int((numerator / span)[:, None] * (x - low[:, None])).clamp(0, nmax)
        as_float = candidate.to(F32)
        weighted = weights * as_float
        sum_l = _running_sum(weighted)
        sum_l2 = _running_sum(weighted * as_float)
        sum_xl = _running_sum(weighted * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive_min = this_min > 0
        this_min = torch.where(positive_min, torch.zeros_like(this_min), this_min)
        this_scale = torch.where(positive_min, sum_xl / sum_l2, this_scale)
        current = error(this_scale, this_min, candidate)
        better = (det > 0) & (current < best) & ~flat
        levels = torch.where(better[:, None], candidate, levels)
        best = torch.where(better, current, best)
        scale = torch.where(better, this_scale, scale)
        low = torch.where(better, this_min, low)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    return scale, -low, torch.where(flat[:, None], torch.zeros_like(levels), levels)


def _f16(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the f16 bytes [nb, 2], the f16 value back in float32 [nb]) of a per-block float32 scale."""
    half = values.to(torch.float16)
    return half.view(torch.uint8).reshape(-1, 2), half.to(F32)


def _positive_max(values: torch.Tensor) -> torch.Tensor:
    """max(0, largest value) over the last dim, +0 when nothing is positive (ggml starts from 0 and uses >)."""
    top = values.amax(dim=-1)
    return torch.where(top > 0, top, torch.zeros_like(top))


def _requantize(x: torch.Tensor, levels: torch.Tensor, step: torch.Tensor, offset: torch.Tensor | None,
                low: int, high: int) -> torch.Tensor:
    """Final quants from the stored (f16-rounded) scales: nearest_int((x + offset) / step) clamped, where
    step != 0; groups whose step is 0 keep the quants of the search (ggml skips them). Shapes [nb, g, n]."""
    shifted = x if offset is None else x + offset[..., None]
    fresh = _nearest_int(shifted / step[..., None]).clamp(low, high) - low
    return torch.where((step != 0)[..., None], fresh, levels)


def _weave(levels: torch.Tensor, groups: int, per_byte: int, bits: int) -> torch.Tensor:
    """Pack [nb, 256] quants: each run of ``per_byte * 32`` values fills 32 bytes, value k of a byte from
    the k-th 32-element slice, at bit offset k * bits."""
    nb = levels.shape[0]
    parts = levels.view(nb, groups, per_byte, 32)
    shifts = torch.arange(per_byte, device=levels.device, dtype=torch.int32).view(1, 1, -1, 1) * bits
    return (parts << shifts).sum(dim=2).reshape(nb, -1).to(torch.uint8)


def _pack_k4_scales(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit scales and mins [nb, 8] into ggml's 12 bytes (get_scale_min_k4 reads them back)."""
    first = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    second = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    third = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    return torch.cat([first, second, third], dim=1).to(torch.uint8)


def _q2_k(x: torch.Tensor) -> torch.Tensor:
    nb = x.shape[0]
    groups = x.view(nb, 16, 16)
    scales, mins, levels = _qkx2_quants(groups.reshape(-1, 16), groups.reshape(-1, 16).abs(), 3, -0.5, 0.1, 15, True)
    scales, mins, levels = scales.view(nb, 16), mins.view(nb, 16), levels.view(nb, 16, 16)
    max_scale, max_min = _positive_max(scales), _positive_max(mins)
    has_scale, has_min = max_scale > 0, max_min > 0
    safe_scale = torch.where(has_scale, max_scale, torch.ones_like(max_scale))
    safe_min = torch.where(has_min, max_min, torch.ones_like(max_min))
    low_nibble = _nearest_int((_c(15.0) / safe_scale)[:, None] * scales) & 0xFF
    high_nibble = (_nearest_int((_c(15.0) / safe_min)[:, None] * mins) << 4) & 0xFF
    packed = torch.where(has_scale[:, None], low_nibble, 0) | torch.where(has_min[:, None], high_nibble, 0)
    d_bytes, d = _f16(torch.where(has_scale, _divide(max_scale, 15.0), torch.zeros_like(max_scale)))
    m_bytes, dmin = _f16(torch.where(has_min, _divide(max_min, 15.0), torch.zeros_like(max_min)))
    step = d[:, None] * (packed & 0xF).to(F32)
    offset = dmin[:, None] * (packed >> 4).to(F32)
    levels = _requantize(groups, levels, step, offset, 0, 3).reshape(nb, 256)
    return torch.cat([packed.to(torch.uint8), _weave(levels, 2, 4, 2), d_bytes, m_bytes], dim=1)


def _q3_k(x: torch.Tensor) -> torch.Tensor:
    nb = x.shape[0]
    groups = x.view(nb, 16, 16)
    scales, levels = _q3_quants(groups.reshape(-1, 16), 4)
    scales, levels = scales.view(nb, 16), levels.view(nb, 16, 16)
    top, amax = _signed_absmax(scales)
    has_scale = amax > 0
    iscale = _c(-32.0) / torch.where(has_scale, top, torch.ones_like(top))
    six_bit = _nearest_int(iscale[:, None] * scales).clamp(-32, 31) + 32
    six_bit = torch.where(has_scale[:, None], six_bit, 0)
    # low nibbles: groups 0-7 in the low half of bytes 0-7, groups 8-15 in the high half;
    # the top two bits of group j at bit 2*(j // 4) of byte 8 + j % 4
    low = (six_bit[:, :8] & 0xF) | ((six_bit[:, 8:] & 0xF) << 4)
    top_bits = (six_bit >> 4).view(nb, 4, 4) << (2 * torch.arange(4, dtype=torch.int32, device=x.device)).view(1, 4, 1)
    packed_scales = torch.cat([low, top_bits.sum(dim=1)], dim=1).to(torch.uint8)
    d_bytes, d = _f16(torch.where(has_scale, _c(1.0) / iscale, torch.zeros_like(iscale)))
    step = d[:, None] * torch.where(has_scale[:, None], six_bit - 32, 0).to(F32)
    levels = _requantize(groups, levels, step, None, -4, 3).reshape(nb, 256)
    high = (levels > 3).to(torch.int32)
    hmask = (high.view(nb, 8, 32) << torch.arange(8, dtype=torch.int32, device=x.device).view(1, 8, 1)).sum(dim=1)
    qs = _weave(levels - 4 * high, 2, 4, 2)
    return torch.cat([hmask.to(torch.uint8), qs, packed_scales, d_bytes], dim=1)


def _q45_numerators(nmax: int, rmin: float, nstep: int) -> torch.Tensor:
    """float32 [nstep + 1]: the candidate ranges' numerators of _qkx2_quants, rmin + 0.1 * step + nmax in float32."""
    return torch.stack([(_c(rmin) + _c(0.1) * _c(step)) + _c(nmax) for step in range(nstep + 1)])


def _fit_q45_groups(groups: torch.Tensor, nmax: int, rmin: float, nstep: int) -> tuple[torch.Tensor, ...]:
    """(scale, min, quants) of Q4_K / Q5_K groups [m, 32]: _qkx2_quants with weights rms + |x|. On a GPU one Triton
    kernel does it (kquants_cuda.py: the same bytes, the tensor read once instead of ~2,700 passes over it)."""
    if groups.device.type == "cuda":
        from cvllm_gguf.kquants_cuda import fit_groups

        return fit_groups(groups.contiguous(), _q45_numerators(nmax, rmin, nstep).to(groups.device), nmax)
    rms = _sqrt(_divide(_running_sum(groups * groups), 32.0))
    weights = rms[..., None] + groups.abs()
    return _qkx2_quants(groups, weights, nmax, rmin, 0.1, nstep, False)


def _q45_k(x: torch.Tensor, nmax: int, rmin: float, nstep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The part Q4_K and Q5_K share: (d, dmin and scale bytes [nb, 16], final quants [nb, 256])."""
    nb = x.shape[0]
    groups = x.view(nb, 8, 32)
    scales, mins, levels = _fit_q45_groups(groups.reshape(-1, 32), nmax, rmin, nstep)
    scales, mins, levels = scales.view(nb, 8), mins.view(nb, 8), levels.view(nb, 8, 32)
    max_scale, max_min = _positive_max(scales), _positive_max(mins)
    inv_scale = torch.where(max_scale > 0, _c(63.0) / max_scale, torch.zeros_like(max_scale))
    inv_min = torch.where(max_min > 0, _c(63.0) / max_min, torch.zeros_like(max_min))
    # stored as uint8 before MIN(63, ...): a negative int wraps to a large byte, then clamps to 63
    ls = (_nearest_int(inv_scale[:, None] * scales) & 0xFF).clamp(max=63)
    lm = (_nearest_int(inv_min[:, None] * mins) & 0xFF).clamp(max=63)
    d_bytes, d = _f16(_divide(max_scale, 63.0))
    m_bytes, dmin = _f16(_divide(max_min, 63.0))
    step = d[:, None] * ls.to(F32)
    offset = dmin[:, None] * lm.to(F32)
    levels = _requantize(groups, levels, step, offset, 0, nmax).reshape(nb, 256)
    return torch.cat([d_bytes, m_bytes, _pack_k4_scales(ls, lm)], dim=1), levels


def _q4_k(x: torch.Tensor) -> torch.Tensor:
    header, levels = _q45_k(x, 15, -1.0, 20)
    return torch.cat([header, _weave(levels, 4, 2, 4)], dim=1)


def _q5_k(x: torch.Tensor) -> torch.Tensor:
    header, levels = _q45_k(x, 31, -0.5, 15)
    fifth = (levels >> 4).view(-1, 8, 32)  # bit 4 of the value in slice s goes to bit s of qh[l]
    qh = (fifth << torch.arange(8, dtype=torch.int32, device=x.device).view(1, 8, 1)).sum(dim=1)
    return torch.cat([header, qh.to(torch.uint8), _weave(levels & 0xF, 4, 2, 4)], dim=1)


def _q6_k(x: torch.Tensor) -> torch.Tensor:
    nb = x.shape[0]
    groups = x.view(nb, 16, 16)
    scales, levels = _qx_quants(groups.reshape(-1, 16), 32)
    scales, levels = scales.view(nb, 16), levels.view(nb, 16, 16)
    top, amax = _signed_absmax(scales)
    zero = amax < GROUP_MAX_EPS
    iscale = _c(-128.0) / torch.where(zero, torch.ones_like(top), top)
    d_bytes, d = _f16(_c(1.0) / iscale)
    small = _nearest_int(iscale[:, None] * scales).clamp(max=127)
    step = d[:, None] * small.to(F32)
    levels = _requantize(groups, levels, step, None, -32, 31).reshape(nb, 256)
    halves = levels.view(nb, 2, 4, 32)
    low = halves & 0xF
    ql = torch.cat([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], dim=2).reshape(nb, 128)
    qh = _weave(levels >> 4, 2, 4, 2)
    block = torch.cat([ql.to(torch.uint8), qh, small.to(torch.int8).view(torch.uint8), d_bytes], dim=1)
    return torch.where(zero[:, None], torch.zeros_like(block), block)  # ggml zeroes the whole block


ENCODERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def quantize_k(blocks: torch.Tensor, type_name: str) -> torch.Tensor:
    """float32 super-blocks [nb, 256] → K-quant blocks uint8 [nb, type_size] of ``type_name`` ("Q4_K", ...)."""
    if blocks.dim() != 2 or blocks.shape[1] != 256:
        raise ValueError(f"{type_name} quantizes super-blocks of 256 values, got shape {list(blocks.shape)}")
    return ENCODERS[type_name](blocks.to(F32).contiguous())
