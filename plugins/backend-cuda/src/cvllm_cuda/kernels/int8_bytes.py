"""The dp4a operands of the int8-activation GEMV (quant_gemv_int8.py): a tile's low-plane words, with their high plane
where the layout has one, as bytes each holding one element's whole unsigned integer (at most 6 bits), in the order of
the activation packs. Byte-level PTX (``prmt``, ``lop3``) where Triton's arithmetic would take more instructions;
plain Triton in the interpreter, which runs no inline PTX.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _byte_perm(a, b, selector, INTERPRET: tl.constexpr):
    """``prmt``: byte k of the result is byte ``n & 7`` of the eight bytes of ``a`` (0-3) and ``b`` (4-7), n the
    k-th nibble of ``selector``; where n & 8, that byte's sign bit copied to all eight bits."""
    if INTERPRET:
        out = tl.zeros_like(a)
        for k in tl.static_range(4):
            n = (selector >> (4 * k)) & 0xF
            byte = ((tl.where((n & 4) == 0, a, b) >> (8 * (n & 3))) & 0xFF)
            byte = tl.where(n >= 8, -(byte >> 7) & 0xFF, byte)
            out |= byte << (8 * k)
        return out
    else:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, selector], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def _bit_select(a, b, MASK: tl.constexpr, INTERPRET: tl.constexpr):
    """``(a & MASK) | (b & ~MASK)`` in one ``lop3`` (LLVM's spelling of it took two)."""
    if INTERPRET:
        return (a & MASK) | (b & ~MASK)
    else:
        return tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xE4;", "=r,r,r,r",
                                         [a, b, tl.full(a.shape, MASK, tl.int32)], dtype=tl.int32, is_pure=True,
                                         pack=1)


@triton.jit
def _two_bit_highs(high, part, INTERPRET: tl.constexpr):
    """Q6_K's high bits (2 per element, 16 elements a high word, two low words) where each phase needs them: per
    phase s, byte j's bits 4-5 hold element ``s + 2j``'s of the low word, bits 6-7 zero (bits 0-3 are the low
    plane's: don't care). A byte of the high word holds elements 4b .. 4b + 3, and the phase's bytes j = 0..3 are
    elements 4b, 4b + 2 of bytes b = 2 * part and 2 * part + 1 (s = 0; 4b + 1, 4b + 3 for s = 1): four masked
    copies of the high word, each with one of those elements at bits 4-5 of every byte (computed once per high
    word when a group of the tile is one, GROUP_WORDS 2), then one byte permute per phase picks the word's bytes."""
    even = high & 0x33333333                  # elements 4b + 2 at bits 4-5 (4b at 0-1), bits 6-7 zero
    odd = (high >> 2) & 0x33333333            # 4b + 3 at bits 4-5 (4b + 1 at 0-1)
    # bytes (even << 4).b, even.b, (even << 4).b', even.b' with b = 2 * part, b' = b + 1
    selector = 0x5140 + 0x2222 * part
    return _byte_perm(even << 4, even, selector, INTERPRET), _byte_perm(odd << 4, odd, selector, INTERPRET)


@triton.jit
def _one_bit_halves(high, part, LOW_BITS: tl.constexpr, INTERPRET: tl.constexpr):
    """A low word's high bits (1 per element: 8 of them for Q5_*, byte ``part`` of the high word; 16 for Q3_K,
    bytes 2 part and 2 part + 1) in two halves: the first half of them at bit 0, the second at bit 16, the rest
    zero. One byte permute a word."""
    if LOW_BITS == 4:
        # nibbles to bytes (once per high word where a factor group is one): byte 0 the low nibble of byte
        # ``part``, byte 2 its high nibble, bytes 1 and 3 a nibble byte's sign (zero)
        nibbles = high & 0x0F0F0F0F
        upper = (high >> 4) & 0x0F0F0F0F
        return _byte_perm(nibbles, upper, 0x8480 + 0x0101 * part, INTERPRET)
    else:
        return _byte_perm(high, tl.zeros_like(high), 0x4140 + 0x0202 * part, INTERPRET)   # bytes 4: zero


@triton.jit
def weight_bytes(low, high, part, LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, INTERPRET: tl.constexpr):
    """The tile's dp4a operands, a tuple of one per phase s (computed once per tile for all the rows of x): byte j
    of phase s is the unsigned integer q of element ``s + P*j`` of each word (P = 8 / LOW_BITS), low bits and the
    high plane's above them, the order of the activation pack (word, s). ``high``: each word's high-plane word
    (or one per group, broadcast), of which the word holds part ``part``."""
    LOW_MASK: tl.constexpr = 0x0F0F0F0F if LOW_BITS == 4 else 0x03030303 if LOW_BITS == 2 else -1
    PHASES: tl.constexpr = 8 // LOW_BITS
    if HIGH_BITS == 2:
        highs = _two_bit_highs(high, part, INTERPRET)
    elif HIGH_BITS == 1:
        # chunk j (the bits of elements P*j .. P*j + P - 1) to byte j, from bit 0: there each phase finds its four
        # elements' bits at one position of every byte. Above each chunk the next ones' bits: the phases mask.
        halves = _one_bit_halves(high, part, LOW_BITS, INTERPRET)
        if LOW_BITS == 4:
            # 2-bit chunks: the copies do not overlap, so an add, which LLVM merges with each phase's shift into
            # one multiply
            spread = halves + (halves << 6)
        else:
            spread = halves | (halves << 4)
    phases = ()
    for s in tl.static_range(PHASES):
        lows = low >> (s * LOW_BITS) if s > 0 else low    # arithmetic shift: the mask drops the copied sign bits
        if HIGH_BITS == 0:
            q = lows & LOW_MASK
        elif HIGH_BITS == 2:
            # bits 4-5 from the high plane, 6-7 zero: one bit select, a single lop3
            q = _bit_select(lows, highs[s], LOW_MASK, INTERPRET)
        else:
            # every chunk moved so that element s + P*j's high bit sits at bit LOW_BITS of byte j
            placed = spread << (LOW_BITS - s) if s <= LOW_BITS else spread >> (s - LOW_BITS)
            q = (lows & LOW_MASK) | (placed & ((1 << LOW_BITS) * 0x01010101))
        phases = phases + (q,)
    return phases
