"""The MoE layer of a decode step over stacked low-bit experts (fused_moe_planes.py's planes) in two launches:
moe_gemv.py's expert GEMVs, each tile read and summed as quant_gemv.py's low-bit GEMV does it.

The grouped GEMM pads each (token, expert) pair to a 16-row tl.dot tile and rounds every dequantized weight for it:
at batch 1 a Q4_K Qwen3-30B-A3B decoded slower than bf16 although it reads ~3.5x fewer bytes. For up to
PAIR_GEMV_MAX pairs instead:

1. ``_gate_up``: program (pair, tile) sums BLOCK_N rows of the expert's gate and the same rows of its up projection
   over its token's hidden state and stores ``silu(gate) * up``. Gate and up are one part (the [2I, H] planes, up's
   rows I further) or two (GGUF files may store them in two types; GPTQ act-order gives each its input order).
2. ``_down``: program (token, tile) sums BLOCK_N output features of all k pairs at once (tiles [k, words, BLOCK_N]:
   k times the bytes in flight of a pair at a time), each times its routing weight, and stores their sum.

A K step of one part is quant_gemv.py's: plane words [GROUPS, GROUP_WORDS, BLOCK_N] (quant_tiles.py), each element
``1 + q / 2**bits`` (``_unit``: every layout, high planes and FP8 included) times x, the group's factors applied once
per group and column; the weights exact in float32, as the dense GEMV's. The roundings are moe_gemv.py's (the
grouped path's): each part's sums to the activations' dtype, silu to the dtype and its product with up, each pair's
output times its weight in the dtype, the k products summed in float32. A pair routed to another rank's expert
(id >= E_local) adds nothing. The planes are stacked contiguous ([E, rows, N]): an expert's offset is its index
times rows times N, computed here rather than passed as six strides per part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from cvllm_cuda.kernels import pdl
from cvllm_cuda.kernels.moe_planes_tile import expert_planes, part_step
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.quant_gemv import ONE_BITS
from cvllm_cuda.kernels.quant_tiles import group_words, groups_in_thread, kernel_tensors
from cvllm_cuda.kernels.sizes import cdiv, next_power_of_2
from cvllm_cuda.quant_planes import QuantLayout, QuantWeight

_INTERPRET = bool(triton.knobs.runtime.interpret)   # the interpreter has no libdevice and no inline PTX


@dataclass(frozen=True, slots=True)
class PartSpec:
    """What a kernel compiles for one part's planes (a constexpr: gate and up may differ in all of it)."""
    layout: QuantLayout
    group_words: int     # words sharing their factors in a tile (quant_tiles.group_words)
    group_sum: bool      # a group's words in one thread: summed before the factors (quant_tiles.groups_in_thread)
    has_perm: bool       # the planes hold the inputs in another order (GPTQ act-order)


@triton.jit
def _part_rows(x_ptr, low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, perm_ptr, expert, N, col, rows, num_rows, K,
               one_bits, P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, STAGES: tl.constexpr,
               EVEN: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 [BLOCK_N]: rows ``col + rows`` of ``expert``'s planes (N output features, K inputs) times x [K]."""
    PER_WORD: tl.constexpr = 32 // P.layout.low_bits
    GW: tl.constexpr = P.group_words
    GROUPS: tl.constexpr = BLOCK_W // GW
    low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr = expert_planes(low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr,
                                                                  expert, N, K, P)
    if P.has_perm:
        perm_ptr += expert.to(tl.int64) * K
    cols = (col + rows)[None, None, :]
    row_ok = (rows < num_rows)[None, None, :]
    group_first = tl.arange(0, GROUPS) * GW
    tile_words = group_first[:, None, None] + tl.arange(0, GW)[None, :, None]         # [GROUPS, GW, 1]
    acc = tl.zeros((GROUPS, 1 if P.group_sum else GW, BLOCK_N), dtype=tl.float32)
    num_words = K // PER_WORD
    for w0 in tl.range(0, num_words, BLOCK_W, num_stages=STAGES):
        words = w0 + tile_words
        gwords = (w0 + group_first)[:, None, None]
        if EVEN:   # every tile in bounds: no masks
            acc += part_step(low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, x_ptr, perm_ptr, words, gwords, cols,
                             None, None, None, N, one_bits, P, 1, INTERPRET)
        else:
            word_ok = words < num_words
            acc += part_step(low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, x_ptr, perm_ptr, words, gwords, cols,
                             word_ok, word_ok & row_ok, (gwords < num_words) & row_ok, N, one_bits, P, 1, INTERPRET)
    return tl.sum(tl.sum(acc, axis=1), axis=0)


@triton.jit
def _gate_up(x_ptr, ids_ptr, out_ptr, I, K, stride_x, one_bits,
             g_low, g_high, g_d, g_m, g_a, g_b, g_perm, g_n, g_col,
             u_low, u_high, u_d, u_m, u_a, u_b, u_perm, u_n, u_col,
             GATE: tl.constexpr, UP: tl.constexpr, NUM_LOCAL: tl.constexpr, TOP_K: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, STAGES: tl.constexpr, EVEN: tl.constexpr,
             INTERPRET: tl.constexpr, USE_PDL: tl.constexpr):
    """inner[pair, rows] = silu(gate rows . x) * (up rows . x), x the pair's token's hidden state."""
    wait_for_previous_kernel(USE_PDL)
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair)
    if expert >= NUM_LOCAL:   # another rank's expert: the down GEMV skips this pair
        return
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_ptr += (pair // TOP_K).to(tl.int64) * stride_x
    gate = _part_rows(x_ptr, g_low, g_high, g_d, g_m, g_a, g_b, g_perm, expert, g_n, g_col, rows, I, K, one_bits,
                      GATE, BLOCK_N, BLOCK_W, STAGES, EVEN, INTERPRET)
    up = _part_rows(x_ptr, u_low, u_high, u_d, u_m, u_a, u_b, u_perm, expert, u_n, u_col, rows, I, K, one_bits,
                    UP, BLOCK_N, BLOCK_W, STAGES, EVEN, INTERPRET)
    dtype = out_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    # silu as torch computes it (activation.py): gate / (1 + exp(-gate)) with libdevice's exp, rounded
    exp_neg = tl.exp(-gate) if INTERPRET else libdevice.exp(-gate)
    silu = tl.math.div_rn(gate, 1.0 + exp_neg).to(dtype).to(tl.float32)
    tl.store(out_ptr + pair.to(tl.int64) * I + rows, (silu * up).to(dtype), mask=rows < I)


@triton.jit
def _down(inner_ptr, ids_ptr, weights_ptr, out_ptr, H, I, one_bits, low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr,
          perm_ptr, P: tl.constexpr, NUM_LOCAL: tl.constexpr, TOP_K: tl.constexpr, BLOCK_P: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, STAGES: tl.constexpr, EVEN: tl.constexpr,
          INTERPRET: tl.constexpr, USE_PDL: tl.constexpr):
    """out[token, rows] = sum over the token's k pairs of weight * (down rows of the pair's expert . inner[pair]).
    Tiles [BLOCK_P, GROUPS, GW, BLOCK_N]: slot p the token's p-th pair (masked: another rank's, or past k)."""
    wait_for_previous_kernel(USE_PDL)
    PER_WORD: tl.constexpr = 32 // P.layout.low_bits
    GW: tl.constexpr = P.group_words
    GROUPS: tl.constexpr = BLOCK_W // GW
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slots = tl.arange(0, BLOCK_P)
    pairs = token * TOP_K + slots
    experts = tl.load(ids_ptr + pairs, mask=slots < TOP_K, other=NUM_LOCAL)
    here = experts < NUM_LOCAL                                                 # [BLOCK_P]
    expert4 = tl.where(here, experts, 0)[:, None, None, None]
    low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr = expert_planes(low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr,
                                                                  expert4, H, I, P)
    if P.has_perm:
        perm_ptr += expert4.to(tl.int64) * I
    x_ptr = inner_ptr + pairs.to(tl.int64)[:, None, None, None] * I
    here4 = here[:, None, None, None]
    cols = rows[None, None, None, :]
    row_ok = cols < H
    group_first = tl.arange(0, GROUPS) * GW
    tile_words = group_first[None, :, None, None] + tl.arange(0, GW)[None, None, :, None]   # [1, GROUPS, GW, 1]
    acc = tl.zeros((BLOCK_P, GROUPS, 1 if P.group_sum else GW, BLOCK_N), dtype=tl.float32)
    num_words = I // PER_WORD
    for w0 in tl.range(0, num_words, BLOCK_W, num_stages=STAGES):
        words = w0 + tile_words
        gwords = (w0 + group_first)[None, :, None, None]
        if EVEN:   # only the pair slots masked
            acc += part_step(low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, x_ptr, perm_ptr, words, gwords, cols,
                             here4, here4, here4, H, one_bits, P, 2, INTERPRET)
        else:
            word_ok = here4 & (words < num_words)
            acc += part_step(low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, x_ptr, perm_ptr, words, gwords, cols,
                             word_ok, word_ok & row_ok, here4 & (gwords < num_words) & row_ok, H, one_bits, P, 2,
                             INTERPRET)
    dtype = out_ptr.dtype.element_ty
    y = tl.sum(tl.sum(acc, axis=2), axis=1).to(dtype).to(tl.float32)                    # [BLOCK_P, BLOCK_N]
    weight = tl.load(weights_ptr + pairs, mask=here, other=0.0).to(dtype).to(tl.float32)
    products = (y * weight[:, None]).to(dtype).to(tl.float32)   # exact in float32, rounded as torch's product
    tl.store(out_ptr + token.to(tl.int64) * H + rows, tl.sum(products, axis=0).to(dtype), mask=rows < H)


@dataclass(frozen=True, slots=True)
class PlanesGemvTiles:
    """Rows per program, plane words per K step, warps and pipeline stages of each kernel (bench/moe_planes_gemv.py
    sweeps others). First guesses, not yet timed: at batch 1 Qwen3-30B-A3B gets 192 gate_up programs (8 pairs x 24
    row tiles) and 128 down programs."""
    gate_up_n: int = 32
    gate_up_w: int = 32
    gate_up_warps: int = 4
    gate_up_stages: int = 3
    down_n: int = 16
    down_w: int = 16
    down_warps: int = 4
    down_stages: int = 2


DEFAULT_TILES = PlanesGemvTiles()


def _spec(weight: QuantWeight, perm: torch.Tensor | None, block_n: int, block_w: int, warps: int) -> PartSpec:
    gw = group_words(weight.layout, block_w)
    return PartSpec(weight.layout, gw, groups_in_thread(block_n, block_w, gw, warps), perm is not None)


def _part_args(weight: QuantWeight, perm: torch.Tensor | None, col: int) -> tuple:
    """A part's kernel arguments: its six plane tensors, its input order (any tensor when none), N and the first
    column."""
    tensors = kernel_tensors(weight)
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("the expert GEMVs index stacked planes as contiguous [E, rows, N] tensors")
    return (*tensors, tensors[0] if perm is None else perm, weight.out_features, col)


def _even(n: int, k: int, layout: QuantLayout, block_n: int, block_w: int) -> bool:
    return n % block_n == 0 and (k * layout.low_bits // 32) % block_w == 0


def moe_planes_gemv(hidden: torch.Tensor, gate_up: list[QuantWeight], down: QuantWeight, topk_weights: torch.Tensor,
                    local_ids: torch.Tensor, perms: list[torch.Tensor | None] | None = None,
                    tiles: PlanesGemvTiles = DEFAULT_TILES) -> torch.Tensor:
    """fused_moe_planes' result (its arguments; silu) for a decode step of up to PAIR_GEMV_MAX pairs; hidden
    [T, H] with contiguous rows."""
    tokens, top_k = local_ids.shape
    hidden_size = hidden.shape[1]
    perms = perms or [None] * (len(gate_up) + 1)
    if len(gate_up) == 1:   # one [2I, H] part: up's rows follow the gate's
        inter = gate_up[0].out_features // 2
        gate, up = (gate_up[0], perms[0], 0), (gate_up[0], perms[0], inter)
    else:
        inter = gate_up[0].out_features
        gate, up = (gate_up[0], perms[0], 0), (gate_up[1], perms[1], 0)
    assert hidden.stride(1) == 1 and down.out_features == hidden_size and down.in_features == inter
    ids = local_ids.reshape(-1)
    t = tiles
    inner = torch.empty((ids.shape[0], inter), dtype=hidden.dtype, device=hidden.device)
    specs = [_spec(w, perm, t.gate_up_n, t.gate_up_w, t.gate_up_warps) for w, perm, _ in (gate, up)]
    even = all(_even(inter, hidden_size, w.layout, t.gate_up_n, t.gate_up_w) for w, _, _ in (gate, up))
    _gate_up[(ids.shape[0], cdiv(inter, t.gate_up_n))](
        hidden, ids, inner, inter, hidden_size, hidden.stride(0), ONE_BITS, *_part_args(*gate), *_part_args(*up),
        GATE=specs[0], UP=specs[1], NUM_LOCAL=down.low.shape[0], TOP_K=top_k, BLOCK_N=t.gate_up_n,
        BLOCK_W=t.gate_up_w, STAGES=t.gate_up_stages, EVEN=even, INTERPRET=_INTERPRET, num_warps=t.gate_up_warps,
        enable_fp_fusion=False, **pdl.options(hidden.device))
    out = torch.empty((tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    _down[(tokens, cdiv(hidden_size, t.down_n))](
        inner, ids, topk_weights.reshape(-1), out, hidden_size, inter, ONE_BITS, *_part_args(down, perms[-1], 0)[:7],
        P=_spec(down, perms[-1], t.down_n, t.down_w, t.down_warps), NUM_LOCAL=down.low.shape[0], TOP_K=top_k,
        BLOCK_P=next_power_of_2(top_k), BLOCK_N=t.down_n, BLOCK_W=t.down_w, STAGES=t.down_stages,
        EVEN=_even(hidden_size, inter, down.layout, t.down_n, t.down_w), INTERPRET=_INTERPRET,
        num_warps=t.down_warps, enable_fp_fusion=False, **pdl.options(hidden.device))
    return out
