"""x rounded to int8 per 32 inputs (llama.cpp's "q8_1"), the form the int8-activation GEMV reads
(quant_gemv_int8.py), made by its own small kernel or by the kernel that produces x.

- ``quantize_activations``: x [T, K] -> per 32 inputs d = max|x| / 127 and q = round(x / d) (half away from zero),
  packed four per int32 in the order the weight words' bytes come out (quant_gemv_int8's docstring); per weight word
  the sum of its inputs ``d * sum(q)`` (the formats' offsets multiply it), per block the same sum.
- Made by the producer: at batch 1 a layer's four quantizer launches cost about as much as a small GEMV's arithmetic
  (H100, `bench/profile_decode.py --isq q4k` without PDL: 1.4 us each, plus the gaps on either side). An RMSNorm,
  a silu (or gelu) * up or the attention's split-KV combination whose output a model hands straight to a low-bit
  linear layer (``RMSNorm.feeds``, ``SiluAndMul.feeds``, ``GeluAndMul.feeds``, ``Attention.feeds``) rounds its own
  output tile the same way (``quantize_blocks``, the same code as the quantizer's) and hands the result to that
  layer's weights (quant_gemv_int8.hand_over); the layer's next GEMV takes it (quant_gemv_int8.taken) instead of
  quantizing again.

The form belongs to the memory it was made from: ``taken`` gives it only for input at the same address, of the same
size, dtype and low-bit width, once. It cannot see an in-place write to x between the producer and the GEMV
(inference tensors keep no version counter): a producer is linked only where the model hands its output straight on
(layers/decoder.py), and no model in the tree writes into a norm's or an activation's output.
On by default (the same bits either way; ``CVLLM_QUANT_PRODUCER_ACTIVATIONS=0`` turns the producers' part off): on
an H100, Llama-3-8B shape, q4k batch 1, the decode graph's GPU time 2.978 -> 2.774 ms a step, 350.8 -> 355.1 tok/s
(bench/results/2026-12-05-h100-latency-isq-q4k-producers*-9dc5be2.json; docs/benchmarks.md, session 34).
Every kernel here is compiled without FMA contraction (the norm and activation kernels are, for torch's roundings),
so the producers' rounding is the quantizer's to the bit.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels.pdl import options as pdl_options
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel

BLOCK = 32   # inputs per activation scale
QUANTIZE_BLOCKS = 8   # 32-input blocks per program of the activation quantizer
PRODUCERS_ENV = "CVLLM_QUANT_PRODUCER_ACTIVATIONS"


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def quantize_blocks(x, blocks, ok, packs_ptr, d_ptr, sums_ptr, block_sums_ptr, LOW_BITS: tl.constexpr):
    """Round ``x`` (float32 [NB, 32]: NB blocks of 32 inputs, at block indices ``blocks`` [NB] of the flattened
    [T, K] activations; ``ok`` [NB]: the blocks to store) and store its scales, packs, word sums and block sums."""
    NB: tl.constexpr = x.shape[0]
    PER_WORD: tl.constexpr = 32 // LOW_BITS
    PHASES: tl.constexpr = 8 // LOW_BITS
    WORDS: tl.constexpr = 32 // PER_WORD    # weight words a block spans
    d = tl.max(tl.abs(x), axis=1) / 127.0
    inv = tl.where(d > 0, 1.0 / d, 0.0)
    scaled = x * inv[:, None]
    q = tl.where(scaled < 0, scaled - 0.5, scaled + 0.5).to(tl.int32)        # to int truncates: half away from 0
    tl.store(d_ptr + blocks, d, mask=ok)
    tl.store(block_sums_ptr + blocks, tl.sum(q, axis=1).to(tl.float32) * d, mask=ok)
    # element e of a word sits in byte e // PHASES of pack e % PHASES: [words, 4 bytes, PHASES]
    q3 = tl.reshape(q, (NB * WORDS, 4, PHASES))
    shifts = (tl.arange(0, 4) * 8)[None, :, None]
    packs = tl.reduce((q3 & 0xFF) << shifts, 1, _bit_or)                        # [words, PHASES]
    words = tl.reshape(blocks[:, None] * WORDS + tl.arange(0, WORDS)[None, :], (NB * WORDS,))
    word_ok = tl.reshape(tl.broadcast_to(ok[:, None], (NB, WORDS)), (NB * WORDS,))
    tl.store(packs_ptr + words[:, None] * PHASES + tl.arange(0, PHASES)[None, :], packs, mask=word_ok[:, None])
    word_d = tl.reshape(tl.broadcast_to(d[:, None], (NB, WORDS)), (NB * WORDS,))
    word_sums = tl.sum(tl.reshape(q, (NB * WORDS, PER_WORD)), axis=1).to(tl.float32) * word_d
    tl.store(sums_ptr + words, word_sums, mask=word_ok)


@triton.jit
def _quantize_kernel(x_ptr, packs_ptr, d_ptr, sums_ptr, block_sums_ptr, K, LOW_BITS: tl.constexpr,
                     BLOCKS: tl.constexpr, USE_PDL: tl.constexpr):
    """BLOCKS blocks of 32 inputs per program of the flattened x [K]."""
    wait_for_previous_kernel(USE_PDL)
    blocks = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    ok = blocks < K // 32
    x = tl.load(x_ptr + blocks[:, None] * 32 + tl.arange(0, 32)[None, :], mask=ok[:, None], other=0.0)
    quantize_blocks(x.to(tl.float32), blocks, ok, packs_ptr, d_ptr, sums_ptr, block_sums_ptr, LOW_BITS)


def buffers(numel: int, low_bits: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Room for the int8 form of ``numel`` activations: (packs int32 [numel / 4], scales float32 [numel / 32], word
    sums float32 [numel * low_bits / 32], block sums float32 [numel / 32])."""
    return (torch.empty(numel // 4, dtype=torch.int32, device=device),
            torch.empty(numel // BLOCK, dtype=torch.float32, device=device),
            torch.empty(numel * low_bits // 32, dtype=torch.float32, device=device),
            torch.empty(numel // BLOCK, dtype=torch.float32, device=device))


def quantize_activations(x: torch.Tensor, low_bits: int) -> tuple[torch.Tensor, ...]:
    """x [T, K] (contiguous) -> ``buffers``' four tensors, row after row: a block of 32 never spans two rows."""
    k = x.numel()
    made = buffers(k, low_bits, x.device)
    grid = (triton.cdiv(k // BLOCK, QUANTIZE_BLOCKS),)
    _quantize_kernel[grid](x, *made, k, LOW_BITS=low_bits, BLOCKS=QUANTIZE_BLOCKS, num_warps=4,
                           enable_fp_fusion=False, **pdl_options(x.device))
    return made


def dequantized_activations(x: torch.Tensor) -> torch.Tensor:
    """The reference: the float32 values the kernel multiplies by (x rounded to int8 per 32 inputs)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, blocks / torch.where(d > 0, d, 1), 0)
    q = torch.where(q < 0, q - 0.5, q + 0.5).trunc()
    return (q * d).reshape(x.shape)


def producers_on() -> bool:
    return os.environ.get(PRODUCERS_ENV, "1") != "0"

