"""The batch-1 low-bit GEMV with int8 activations: llama.cpp's numerics for its formats (its CUDA backend rounds x
to int8 per 32 inputs, "q8_1", before every quantized matrix-vector product; so do vLLM's GGUF kernels).

Why: the float GEMV (quant_matmul._gemv_kernel) spends about four instructions per weight element (place the bits,
or in the exponent, multiply-add, and its share of x), which on the H200 is more time than reading the 4-bit weight
(bench/results/2026-12-02-h200-*: a load-only kernel of the same tiling takes ~60% of its time). With x in int8,
one ``dp4a`` multiplies four weight bytes by four activation bytes and adds them to an int32: a word of eight
4-bit weights is two masks, a shift and two ``dp4a``, under one instruction per element.

- ``quantize_activations`` (int8_activations.py): x [T, K] -> per 32 inputs d = max|x| / 127 and q = round(x / d),
  packed four per int32 in the order the weight words' bytes come out (below), and the sums the offsets multiply;
  made by the RMSNorm, silu * up or attention that produced x where the model links them (``input_bits``,
  ``hand_over``; unless CVLLM_QUANT_PRODUCER_ACTIVATIONS=0), else by its own kernel before the GEMV.
- ``_gemv_int8_kernel`` (int8_gemv_kernel.py): a low-plane word of ``32 / bits`` elements masked with 0x0F0F0F0F
  (4-bit; 0x03030303 2-bit; the word itself 8-bit) at shift ``s * bits`` holds elements ``s, s + P, s + 2P,
  s + 3P`` (P = 8 / bits) in its four bytes; the activation pack (word, s) holds the same elements' int8s. Per word
  ``scale * d_x * sum(q_w q_x) + offset * sum(x)``, the float formula with x rounded.
- High planes (Q6_K 4 + 2 bits, Q5_0, Q5_1, Q5_K 4 + 1, Q3_K 2 + 1: int8_bytes.weight_bytes): each byte then holds the
  element's whole integer, its high bits above the low ones (6 bits at most, so unsigned bytes times int8 still
  fit dp4a exactly); the activation packs are the same. A high-plane word spans 2 or 4 low words and is loaded
  once per factor group where a group is one (Q6_K, Q5_*). Q6_K's 2-bit pairs are masked into four copies of
  the high word once per high word, and one byte permute (``prmt``) per word and phase picks the bytes it
  needs, merged under the low bits with a single ``lop3``; the 1-bit planes are spread a chunk of elements per
  byte (a byte permute and a multiply), then shifted and masked per phase. SASS instructions in the main loop per
  weight element (sm_90, bench/sass_stats.py int8-gemv; the 4-bit tile (32, 64, 4, 3), the 2-bit (32, 32, 4)):
  Q4_K 2.0, Q6_K 3.5, Q5_K 2.8, Q5_0 2.5, Q3_K 2.6, Q2_K 2.1; the float GEMV's Q6_K 9.2 (its (32, 32, 4, 3)).

Layouts that set ``int8_activations`` (GGUF's) and whose planes fit a byte (not an 8-bit low plane with a high
one); FP8 and GPTQ/AWQ (W4A16) keep the float GEMV. ``CVLLM_QUANT_INT8_ACTIVATIONS=0`` keeps every layout on the
float GEMV (bit-comparable with the CPU path's dequantize-then-matmul). Triton's interpreter has no inline PTX:
there ``dp4a``, ``prmt`` and ``lop3`` are spelled out with shifts and masks (the tests run that; the GPU tests
run the instructions).
"""

from __future__ import annotations

import os

import torch
import triton

from cvllm_cuda.kernels import gpu, quant_tiles
from cvllm_cuda.kernels.int8_activations import (
    BLOCK,
    buffers,
    producers_on,
    quantize_activations,
)
from cvllm_cuda.kernels.int8_gemv_kernel import _gemv_int8_kernel
from cvllm_cuda.kernels.pdl import options as pdl_options
from cvllm_cuda.kernels.quant_gemv import GEMV_CONFIGS
from cvllm_cuda.kernels.quant_tiles import (
    add_splits,
    even_tiles,
    group_words,
    groups_in_thread,
    kernel_tensors,
    split_k,
)
from cvllm_cuda.kernels.sizes import cdiv
from cvllm_cuda.kernels.tuned_matmul import TUNED_QUANT_GEMV, quant_gemv_key
from cvllm_cuda.quant_planes import QuantLayout, QuantWeight

# rows of x up to which quant_matmul takes this GEMV (decode batches, a batch-1 speculative verify step of the
# default 4 drafts): a row's numerics then do not depend on how many rows share the step. 5, not 8 (llama.cpp's
# q8_1 matrix-vector limit): with the rows together in a program (ROWS_PER_PROGRAM) the GEMV ties the swapped GEMM
# at 5 rows and loses at 8 (H200, a Llama-3-8B layer in a CUDA graph, 2026-12-04-h200-gemm_swapped_probe-gemvrows:
# Q4_K 128.1 us at 5 rows and 181.9 at 8 against 126.7-127.0; Q8_0 131.8 and 203.4 against the unpacked GEMM's
# 147-148, the swapped one's 130-132)
MAX_ROWS = 5
# (BLOCK_N, BLOCK_W, num_warps[, stages]) by low-plane bits, from bench/quant_gemv_stack.py (a stack of Llama-3-8B
# layers in one CUDA graph, H200, 2026-12-03): Q4_K 56.4 us a layer (the float GEMV's tiles (32, 32, 4): 60.7),
# Q8_0 79.3 (106.6); Q8_0 with three stages and one program per SM since 2026-12-04 (bench/tune_quant_gemv.py, each
# shape in a stack of 8 in a CUDA graph: qkv 13.6 -> 10.9 us, o 12.7 -> 8.8, gate_up 34.4 -> 33.6, down
# 24.4 -> 21.4); 2-bit unswept
INT8_GEMV_CONFIGS = {2: GEMV_CONFIGS[2], 4: (32, 64, 4, 3), 8: (64, 64, 4, 3)}
# programs per SM the K split aims at, by low-plane bits: Q4_K 54.7 us a layer at 1 (every SM one program), 56.8 at
# 4, 56.5 never split (2026-12-03, quant_gemv_stack.py); Q8_0 at 1 with three stages (above; with one stage 4 had won)
INT8_PROGRAMS_PER_SM = {2: 4, 4: 1, 8: 1}
# the widths (low bits, high bits) of the high planes the kernel unpacks (GGUF's Q6_K, Q5_*, Q3_K: an integer of at
# most 6 bits, within a byte of dp4a) and their (tile, programs per SM), not yet timed: Q5_* and Q3_K those of their
# low width (at MAX_ROWS rows 168 registers, no spill). Not Q6_K's: its 16-input groups keep a sum per word and row,
# and the 4-bit tile spills at MAX_ROWS rows (255 registers and 16 B of stack, as it did before this kernel took high
# planes); the same tile in 8 warps holds them (204 registers), and was the float GEMV's best Q6_K tile (GEMV_CONFIGS)
INT8_HIGH_PLANE_CONFIGS = {(4, 2): ((32, 64, 8, 3), 1), (4, 1): (INT8_GEMV_CONFIGS[4], INT8_PROGRAMS_PER_SM[4]),
                           (2, 1): (INT8_GEMV_CONFIGS[2], INT8_PROGRAMS_PER_SM[2])}
ENV = "CVLLM_QUANT_INT8_ACTIVATIONS"
# the high-plane layouts take this GEMV too (CVLLM_QUANT_INT8_HIGH_PLANES=0: the float GEMV, for A/B runs): on the
# H200 a Q4_K_M file's batch-1 decode 377 tok/s with it, 348 without (docs/benchmarks.md, 2026-12-05)
HIGH_PLANES_ENV = "CVLLM_QUANT_INT8_HIGH_PLANES"


def applies(layout: QuantLayout, in_features: int) -> bool:
    """Whether the batch-1 product of a weight in ``layout`` takes this path."""
    widths = (layout.low_bits, layout.high_bits)
    planes_ok = not widths[1] or (widths in INT8_HIGH_PLANE_CONFIGS and os.environ.get(HIGH_PLANES_ENV, "1") != "0")
    return (layout.int8_activations and not layout.float8 and planes_ok and in_features % BLOCK == 0
            and os.environ.get(ENV, "1") != "0")


def _weights(layer) -> list[QuantWeight]:
    """A low-bit linear layer's weights: its one, or its parts' (a fused layer whose parts have different types)."""
    weight = getattr(layer, "quant_weight", None)
    return [weight] if weight is not None else [part for _, part in getattr(layer, "quant_parts", ())]


def input_bits(layer, rows: int) -> int | None:
    """The low-plane width whose int8 form of x [rows, K] the low-bit linear ``layer`` takes (every part of a fused
    layer the same one), or None: a layer of another kind, more rows than MAX_ROWS, parts of different widths, or
    CVLLM_QUANT_PRODUCER_ACTIVATIONS=0. What a producer linked to ``layer`` makes beside its output."""
    weights = _weights(layer)
    if not weights or rows > MAX_ROWS or not producers_on():
        return None
    widths = {w.layout.low_bits if applies(w.layout, w.in_features) else None for w in weights}
    return widths.pop() if len(widths) == 1 else None


def output_form(out: torch.Tensor, feeds, rows: int) -> tuple[int, tuple[torch.Tensor, ...]]:
    """For a producer of ``out`` ([rows, K]) that feeds the layer ``feeds`` (None: unknown): the low-plane width of
    the int8 form to make beside it and room for it (int8_activations.buffers), or (0, ``out`` four times:
    placeholders the kernel never touches)."""
    bits = input_bits(feeds, rows) if feeds is not None and rows else None
    return (bits, buffers(out.numel(), bits, out.device)) if bits else (0, (out,) * 4)


def hand_over(out: torch.Tensor, feeds, low_bits: int, made: tuple[torch.Tensor, ...]) -> None:
    """Leave ``made`` (``out``'s int8 form, just filled by the kernel that wrote ``out``; ``output_form``) with the
    weights of ``feeds``, the layer ``out`` goes to next, for their next GEMV on ``out`` (``taken``).

    By weight and address, not on the tensor object: the engine runs in inference mode, where a view records no
    base, and between a producer and its GEMV come reshapes (the attention's [T, H, D] -> [T, H * D], a linear
    layer's [..., K] -> [T, K]) that make new tensor objects over the same memory. ``out`` itself is held until then,
    so that no other tensor can take its memory meanwhile and pass for it (a form left unused)."""
    for weight in _weights(feeds):
        weight.handed = (out, low_bits, made)


def taken(x: torch.Tensor, weight: QuantWeight) -> tuple[torch.Tensor, ...] | None:
    """The int8 form handed to ``weight`` for x (the same memory, size, dtype and width; x contiguous), taken once:
    a form left unused (its layer then ran on other input) is dropped at the next GEMV of that weight."""
    handed, weight.handed = weight.handed, None
    if handed is None or not x.is_contiguous():
        return None
    out, low_bits, made = handed
    same = (out.data_ptr() == x.data_ptr() and out.numel() == x.numel() and out.dtype == x.dtype
            and low_bits == weight.layout.low_bits)
    return made if same else None


def int8_group_words(layout: QuantLayout, block_w: int) -> int:
    """The kernel's GROUP_WORDS: words that share factors (quant_tiles.group_words), but a scale group of several
    32-input activation blocks (GPTQ's 128, a per-row scale) taken a block at a time, so that each block's products
    are summed as integers and turned into a float once a block and column (the kernel's ONE_BLOCK path), not once a
    word: compiled for sm_90, gptq4_g128 at (32, 64, 4, 3) 346 -> 228 loop instructions a thread
    (bench/sass_stats.py int8-gemv)."""
    words = group_words(layout, block_w)
    block = layout.low_bits   # words of one activation block
    return block if words > block and words % block == 0 else words


def default_tiles(layout: QuantLayout) -> tuple[tuple, int]:
    """(BLOCK_N, BLOCK_W, num_warps[, stages]) and the programs per SM the K split aims at, untuned."""
    if layout.high_bits:
        return INT8_HIGH_PLANE_CONFIGS[layout.low_bits, layout.high_bits]
    return INT8_GEMV_CONFIGS[layout.low_bits], INT8_PROGRAMS_PER_SM[layout.low_bits]



# rows of x a GEMV program takes: each weight tile then comes from memory and is unpacked once for all of them, and
# each row is summed as when alone (the same bits). All of them up to MAX_ROWS by default: a Llama-3-8B layer in a
# CUDA graph on the H200 (bench/results/2026-12-04-h200-gemm_swapped_probe-gemvrows-6ca7c93.json), us at 1 / 2 / 3 /
# 4 / 5 rows, a program a row -> rows together: Q4_K 58.5 / 79.7 / 110.4 / 137.8 / 165.2 -> 57.5 / 70.4 / 93.1 /
# 110.6 / 128.1; Q8_0 74.0 / 86.5 / 104.1 / 126.5 / 147.1 -> 74.9 / 79.6 / 102.0 / 116.1 / 131.8. But only where the
# weight stream is the cost: a small layer is read in a few us either way, and there a program a row runs five
# times the programs in parallel. The demo model's layers (576 wide: 0.3-1.8M weights) in a batch-1 verify step of
# 5 rows, on the H200 in CUDA graphs: forward pass 1.141 ms with the rows together, 0.976 ms a program a row
# (docs/benchmarks.md, session 24). So rows together from ROWS_TOGETHER_MIN_WEIGHTS (a Llama-3-8B layer has 16-117M;
# sizes in between are not measured). CVLLM_GEMV_ROWS_PER_PROGRAM=N sets it for every layer (1 = a program a row).
ROWS_TOGETHER_MIN_WEIGHTS = 1 << 22
ROWS_PER_PROGRAM = int(os.environ.get("CVLLM_GEMV_ROWS_PER_PROGRAM", "0")) or None


def program_rows(rows: int, n: int, k: int) -> int:
    """Rows of x a GEMV program takes for a weight [n, k] (ROWS_PER_PROGRAM where set)."""
    if ROWS_PER_PROGRAM:
        return max(1, min(rows, ROWS_PER_PROGRAM))
    return rows if n * k >= ROWS_TOGETHER_MIN_WEIGHTS else 1


def quant_gemv_int8(x: torch.Tensor, weight: QuantWeight, out: torch.Tensor, config: tuple | None = None,
                    splits: int | None = None, activations: tuple[torch.Tensor, ...] | None = None,
                    rows_per_program: int | None = None) -> None:
    """out[t] = weight @ x[t] with x rounded to int8 per 32 inputs, for x [T, K] (contiguous; T up to MAX_ROWS) and
    out [T, N] (last dimension contiguous). Every row's output is bit for bit what a call with that row alone
    gives: the tiles and K splits depend on the weight only. ``activations``: x already rounded by
    ``quantize_activations`` (benchmarks time the GEMV without its quantizer that way); ``rows_per_program``: rows
    of x a program takes (default: program_rows)."""
    block_n, block_w, warps, stages, programs_per_sm = _tiles(weight, x.device, config)
    splits, split_words = split_k(cdiv(weight.out_features, block_n), weight.in_features, weight.layout.low_bits,
                                  block_w, x.device, splits, programs_per_sm)
    _launch(x, weight, out, (block_n, block_w, warps, stages), splits, split_words, activations, rows_per_program)


def _tiles(weight: QuantWeight, device: torch.device, config: tuple | None = None) -> tuple:
    """(BLOCK_N, BLOCK_W, num_warps, stages, programs per SM of the K split): ``config`` (no split policy of its
    own: the layout's default), else the tuned entry for this GPU and shape, else the layout's default."""
    lay = weight.layout
    tuned = None if config else gpu.tuned_entry(TUNED_QUANT_GEMV, device,
                                                quant_gemv_key(weight.out_features, weight.in_features, lay, True))
    default, programs_per_sm = default_tiles(lay)
    block_n, block_w, warps, *stages = tuned[:4] if tuned else config or default
    return block_n, block_w, warps, stages[0] if stages else 1, tuned[4] if tuned else programs_per_sm


def _launch(x: torch.Tensor, weight: QuantWeight, out: torch.Tensor, tiles: tuple, splits: int, split_words: int,
            activations: tuple[torch.Tensor, ...] | None = None, rows_per_program: int | None = None) -> None:
    """One launch of _gemv_int8_kernel (and of sum_splits_kernel after it where K is split)."""
    lay = weight.layout
    n, k = weight.out_features, weight.in_features
    t = x.shape[0]
    block_n, block_w, warps, stages = tiles
    if not x.is_contiguous():
        x = x.contiguous()
    if activations is None:
        activations = taken(x, weight) or quantize_activations(x, lay.low_bits)
    partials = out if splits == 1 else torch.empty((splits, t, n), dtype=torch.float32, device=x.device)
    gw = int8_group_words(lay, block_w)
    rows = max(1, min(t, rows_per_program)) if rows_per_program else program_rows(t, n, k)
    grid = (cdiv(t, rows), cdiv(n, block_n), splits)
    _gemv_int8_kernel[grid](
        *activations, out, partials, *kernel_tensors(weight),
        n, k, split_words, t, out.stride(0), **lay.kernel_args(), BLOCK_N=block_n,
        BLOCK_W=block_w, GROUP_WORDS=gw, STAGES=stages, GROUP_SUM=groups_in_thread(block_n, block_w, gw, warps),
        EVEN=even_tiles(n, k, lay.low_bits, block_n, split_words),
        INTERPRET=bool(triton.knobs.runtime.interpret), ROWS=rows, EARLY=quant_tiles.EARLY_WEIGHTS, num_warps=warps,
        **pdl_options(x.device))
    if splits > 1:
        add_splits(partials, out, splits, n)
