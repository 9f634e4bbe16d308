"""Activations rounded to int8 per 32 inputs (llama.cpp's "q8_1"), the int8-activation GEMV's input
(quant_gemv_int8.py), and where they are made.

- ``quantize_blocks``: the rounding itself, a Triton function: per 32 inputs d = max|x| / 127 and q = round(x / d)
  (half away from zero), packed four per int32 in the order the weight words' bytes come out (quant_gemv_int8.py),
  and per weight word the sum of its inputs ``d * sum(q)`` (the formats' offsets multiply it).
- ``quantize_activations``: a launch of it over x [T, K], before a GEMV.
- Made where x is made: at a batch-1 decode step every GEMV's quantizer is a launch of its own (four a layer), ~1.6
  us each in a chain of dependent kernels (H200, bench/quant_gemv_stack.py: a Q4_K layer's GEMVs 54.1 us with
  them, 47.5 us with x rounded beforehand). The RMSNorm and SiLU-and-mul kernels round their own output as well
  where an int8-activation GEMV of that input size and few enough rows will read it (``wanted``: the layers note
  their input sizes as they are prepared, ``note_consumer``), and ``offer`` it; the GEMV ``take``s it if its x is
  that very output, unchanged, and rounds x itself otherwise. Both ways run the same function on the same rounded
  values, so the GEMV's output is the same bits. ``CVLLM_FUSED_ACTIVATION_QUANT=0`` turns the fused form off.
"""

from __future__ import annotations

import os
import weakref

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels.pdl import options as pdl_options
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel

BLOCK = 32   # inputs per activation scale
QUANTIZE_BLOCKS = 8   # 32-input blocks per program of the standalone quantizer
FUSED_ENV = "CVLLM_FUSED_ACTIVATION_QUANT"

Activations = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def quantize_blocks(x, blocks, ok, packs_ptr, d_ptr, sums_ptr, block_sums_ptr, NB: tl.constexpr,
                    LOW_BITS: tl.constexpr):
    """x float32 [NB, 32]: the values of blocks ``blocks`` ([NB] indices among the rows' blocks, K / 32 a row; ``ok``
    [NB]: which to store). Stores their scales and block sums [K / 32], packs [K / 4] and word sums [K * LOW_BITS /
    32], row after row. Launched with ``enable_fp_fusion=False`` everywhere: a contracted multiply-add would round
    otherwise than the separate products of another caller."""
    PER_WORD: tl.constexpr = 32 // LOW_BITS
    PHASES: tl.constexpr = 8 // LOW_BITS
    WORDS: tl.constexpr = 32 // PER_WORD   # a block's weight words
    d = tl.max(tl.abs(x), axis=1) / 127.0
    inv = tl.where(d > 0, 1.0 / d, 0.0)
    scaled = x * inv[:, None]
    q = tl.where(scaled < 0, scaled - 0.5, scaled + 0.5).to(tl.int32)        # to int truncates: half away from 0
    tl.store(d_ptr + blocks, d, mask=ok)
    tl.store(block_sums_ptr + blocks, tl.sum(q, axis=1).to(tl.float32) * d, mask=ok)
    # element e of a word sits in byte e // PHASES of pack e % PHASES: [words, 4 bytes, PHASES]
    q3 = tl.reshape(q, (NB * WORDS, 4, PHASES))
    shifts = (tl.arange(0, 4) * 8)[None, :, None]
    packs = tl.reduce((q3 & 0xFF) << shifts, 1, _bit_or)                       # [words, PHASES]
    words = tl.reshape(blocks[:, None] * WORDS + tl.arange(0, WORDS)[None, :], (NB * WORDS,))
    word_ok = tl.reshape(tl.broadcast_to(ok[:, None], (NB, WORDS)), (NB * WORDS,))
    tl.store(packs_ptr + words[:, None] * PHASES + tl.arange(0, PHASES)[None, :], packs, mask=word_ok[:, None])
    word_d = tl.reshape(tl.broadcast_to(d[:, None], (NB, WORDS)), (NB * WORDS,))
    word_sums = tl.sum(tl.reshape(q, (NB * WORDS, PER_WORD)), axis=1).to(tl.float32) * word_d
    tl.store(sums_ptr + words, word_sums, mask=word_ok)


@triton.jit
def _quantize_kernel(x_ptr, packs_ptr, d_ptr, sums_ptr, block_sums_ptr, K, LOW_BITS: tl.constexpr,
                     BLOCKS: tl.constexpr, USE_PDL: tl.constexpr):
    """BLOCKS blocks of 32 inputs per program (x [T, K] contiguous, seen as T * K / 32 blocks)."""
    wait_for_previous_kernel(USE_PDL)
    blocks = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    ok = blocks < K // 32
    x = tl.load(x_ptr + blocks[:, None] * 32 + tl.arange(0, 32)[None, :], mask=ok[:, None], other=0.0).to(
        tl.float32)
    quantize_blocks(x, blocks, ok, packs_ptr, d_ptr, sums_ptr, block_sums_ptr, BLOCKS, LOW_BITS)


def empty_activations(rows: int, k: int, low_bits: int, device: torch.device) -> Activations:
    """Uninitialised (packs int32 [rows * k / 4], scales float32 [rows * k / 32], word sums float32
    [rows * k * low_bits / 32], block sums float32 [rows * k / 32])."""
    n = rows * k
    return (torch.empty(n // 4, dtype=torch.int32, device=device),
            torch.empty(n // BLOCK, dtype=torch.float32, device=device),
            torch.empty(n * low_bits // 32, dtype=torch.float32, device=device),
            torch.empty(n // BLOCK, dtype=torch.float32, device=device))


def quantize_activations(x: torch.Tensor, low_bits: int) -> Activations:
    """x [T, K] (contiguous) rounded, in ``empty_activations``' form."""
    k = x.numel()
    out = empty_activations(1, k, low_bits, x.device)
    grid = (triton.cdiv(k // BLOCK, QUANTIZE_BLOCKS),)
    _quantize_kernel[grid](x, *out, k, LOW_BITS=low_bits, BLOCKS=QUANTIZE_BLOCKS, num_warps=4,
                           enable_fp_fusion=False, **pdl_options(x.device))
    return out


def dequantized_activations(x: torch.Tensor) -> torch.Tensor:
    """The reference: the float32 values the kernel multiplies by (x rounded to int8 per 32 inputs)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, blocks / torch.where(d > 0, d, 1), 0)
    q = torch.where(q < 0, q - 0.5, q + 0.5).trunc()
    return (q * d).reshape(x.shape)


# input size -> (low bits, most rows) of the int8-activation GEMVs that read inputs of that size; low bits None
# where two of them want different ones. Process-wide, as the kernels' caches are: a stale entry costs a rounding
# nobody reads, never a wrong one (``take`` checks)
_consumers: dict[int, tuple[int | None, int]] = {}
# the last output rounded where it was made: (a weak reference to it, its address, size and version, low bits,
# the rounded form)
_offered: tuple | None = None


def note_consumer(in_features: int, low_bits: int, max_rows: int) -> None:
    """An int8-activation GEMV of ``in_features`` inputs takes up to ``max_rows`` rows of x rounded to ``low_bits``'
    pack order."""
    bits, _ = _consumers.get(in_features, (low_bits, max_rows))
    _consumers[in_features] = (bits if bits == low_bits else None, max_rows)


def wanted(k: int, rows: int) -> int | None:
    """The low bits to round an output of ``rows`` rows of ``k`` features to where it is made; None: not wanted."""
    bits, max_rows = _consumers.get(k, (None, 0))
    if bits is None or rows > max_rows or k % BLOCK or os.environ.get(FUSED_ENV, "1") == "0":
        return None
    return bits


def offer(out: torch.Tensor, low_bits: int, activations: Activations) -> None:
    """``out``, just made, rounded as ``activations``: for the GEMV that reads it next."""
    global _offered
    _offered = (weakref.ref(out), out.data_ptr(), out.numel(), out._version, low_bits, activations)


def take(x: torch.Tensor, low_bits: int) -> Activations | None:
    """The rounded form of ``x`` if it is the last offered output (or a view of all of it), unchanged since, in
    ``low_bits``' pack order; else None."""
    if _offered is None:
        return None
    ref, address, numel, version, bits, activations = _offered
    out = ref()
    if (out is None or bits != low_bits or x.data_ptr() != address or x.numel() != numel or not x.is_contiguous()
            or out._version != version):
        return None
    return activations
