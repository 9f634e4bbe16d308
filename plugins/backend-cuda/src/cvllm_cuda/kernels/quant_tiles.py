"""What the low-bit plane kernels share (quant_matmul.py's GEMM, quant_gemv.py, quant_gemv_int8.py,
fused_moe_planes.py): loading a tile of plane words and their factors, one element of each word as a float, and the
host side of splitting K over programs.

A tile is words [BLOCK_W, BLOCK_N] (a word holds 32 / low_bits consecutive input features of one output feature;
consecutive output features are contiguous, so a warp's loads are wide). Element S of every word is one shift and
mask (plus the high plane's bits), made a float without a conversion instruction (``q | 0x4B000000`` is the float
2**23 + q; subtracting 2**23 is exact), then scaled: ``q * scale + offset``, the layout's reference values exactly.
"""

from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl
from triton.errors import TritonError

from cvllm_cuda.kernels import gpu
from cvllm_cuda.kernels.pdl import options as pdl_options
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.sizes import cdiv
from cvllm_cuda.quant_planes import QuantWeight

logger = logging.getLogger(__name__)

# The early weights (CVLLM_GEMV_EARLY_WEIGHTS=0 turns them off): each program of the batch-1 GEMVs (the low-bit
# ones, quant_gemv.py, int8_gemv_kernel.py and quant_gemv_mma.py, and gemv.py's bf16 / FP8 rows) reads its first K
# step's weights before the PDL wait (their EARLY), so that their memory latency passes while the previous kernel (a
# norm, the attention's combination, silu) still runs. Safe because no kernel launched with PDL writes weights: they
# change only while loading, by torch ops and kernels launched without it, which a PDL launch cannot overtake. On the
# H200 a batch-1 Llama-3-8B GEMV takes 5-7 us more than its bytes at the copy rate (the stack sweep, 4ae0d84), and the
# GEMVs are 1.61 of a q4k step's 2.29 ms of critical path (session 35's profile). On by default since session 39 (q4k
# batch 1 +6.5% on the H200, +2.7% on an H100); the peeled first step may contract its float multiply-adds otherwise
# than the loop, so a few outputs can differ from the plain kernel's by an ulp (Q3_K on the GPU), each launch still
# the same bits.
EARLY_WEIGHTS = os.environ.get("CVLLM_GEMV_EARLY_WEIGHTS", "1") != "0"
# the split kernels divide K until there are about this many programs per SM
PROGRAMS_PER_SM = 4


@triton.jit
def load_words(low_ptr, high_ptr, words, cols, ok, N, LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr):
    """The low-plane words [BLOCK_W, BLOCK_N] at word indices ``words`` ([BLOCK_W, 1]) of output features ``cols``
    ([1, BLOCK_N]), and for each the high-plane word holding its elements' high bits (``low`` again without one)."""
    low = tl.load(low_ptr + words * N + cols, mask=ok, other=0)
    if HIGH_BITS > 0:
        first = words * (32 // LOW_BITS)
        high = tl.load(high_ptr + first // (32 // HIGH_BITS) * N + cols, mask=ok, other=0)
    else:
        high = low
    return low, high


@triton.jit
def load_masked(ptr, ok, other):
    """``tl.load`` under mask ``ok``, or unmasked where ``ok`` is None (tiles known to be in bounds)."""
    if ok is None:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=ok, other=other)


@triton.jit
def word_factors(d_ptr, m_ptr, a_ptr, b_ptr, first, cols, ok, N, SCALE_GROUP: tl.constexpr,
                  SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr,
                  HAS_M: tl.constexpr):
    """scale and offset (float32 [BLOCK_W, BLOCK_N]) of the words whose first elements are ``first``
    ([BLOCK_W, 1]): a word never straddles a scale group. ``ok`` None: every load in bounds (no masks)."""
    d = load_masked(d_ptr + first // SUPER_GROUP * N + cols, ok, 0.0).to(tl.float32)
    if HAS_M:
        m = load_masked(m_ptr + first // SUPER_GROUP * N + cols, ok, 0.0).to(tl.float32)
    else:
        m = d
    if A_MODE == 0:
        scale = d
        a = d
    else:
        a = load_masked(a_ptr + first // SCALE_GROUP * N + cols, ok, 0).to(tl.float32)
        scale = d * a
    if B_MODE == 0:
        offset = m * B_CONST
    elif B_MODE == 1:
        offset = m * (a * B_CONST)
    else:
        b = load_masked(b_ptr + first // SCALE_GROUP * N + cols, ok, 0).to(tl.float32)
        offset = m * (b * B_CONST)
    return scale, offset


@triton.jit
def tile(low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, words, word_ok, cols, col_ok, N,
          LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, SCALE_GROUP: tl.constexpr, SUPER_GROUP: tl.constexpr,
          A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr, HAS_M: tl.constexpr):
    """A tile's words and factors [BLOCK_W, BLOCK_N] (``words`` [BLOCK_W], ``cols`` [BLOCK_N]), and each word's first
    element [BLOCK_W, 1]: what every kernel here starts a K step with."""
    ok = word_ok[:, None] & col_ok[None, :]
    first = (words * (32 // LOW_BITS))[:, None]
    low, high = load_words(low_ptr, high_ptr, words[:, None], cols[None, :], ok, N, LOW_BITS, HIGH_BITS)
    scale, offset = word_factors(d_ptr, m_ptr, a_ptr, b_ptr, first, cols[None, :], ok, N, SCALE_GROUP,
                                  SUPER_GROUP, A_MODE, B_MODE, B_CONST, HAS_M)
    return first, low, high, scale, offset


@triton.jit
def quant_element(low, high, first, S, LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, FLOAT8: tl.constexpr = False):
    """float32: the integer of element ``first + S`` of each word (exact, without a conversion instruction), or
    its FP8 e4m3 value (FLOAT8). ``S``: a position (a constexpr: a static_range index), or a tensor of positions
    broadcast against the words (dot_unpacked)."""
    q = (low >> (S * LOW_BITS)) & ((1 << LOW_BITS) - 1)
    if FLOAT8:
        return q.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if HIGH_BITS > 0:
        shift = (first % (32 // HIGH_BITS) + S) * HIGH_BITS
        q = q | (((high >> shift) & ((1 << HIGH_BITS) - 1)) << LOW_BITS)
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def dot_into(x, w, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + x @ w: IEEE float32 products for float32 operands; UPCAST, bf16 tiles multiplied as float32 (upcast)."""
    if UPCAST:
        return tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        return tl.dot(x, w, acc, input_precision="ieee")
    else:
        return tl.dot(x, w, acc)


@triton.jit
def dot_unpacked(x, low, high, first, scale, offset, acc, LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr,
                 FLOAT8: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + x [M, BLOCK_W * per word] @ the tile's words [BLOCK_W, BLOCK_N] unpacked in order: each word broadcast
    against its element positions and reshaped into [BLOCK_W * per word, BLOCK_N] (element k of the step is word
    k // per word's element k % per word), one ``tl.dot``."""
    PER_WORD: tl.constexpr = 32 // LOW_BITS
    w3 = quant_element(low[:, None, :], high[:, None, :], first[:, None, :], tl.arange(0, PER_WORD)[None, :, None],
                       LOW_BITS, HIGH_BITS, FLOAT8) * scale[:, None, :] + offset[:, None, :]
    w = tl.reshape(w3, (low.shape[0] * PER_WORD, low.shape[1]))
    return dot_into(x, w.to(x.dtype), acc, IEEE, UPCAST)


@triton.jit
def sum_splits_kernel(partial_ptr, out_ptr, N, SPLITS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(SPLITS):
        total += tl.load(partial_ptr + j * N + cols, mask=ok, other=0.0)
    tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=ok)


def upcast(dtype: torch.dtype) -> bool:
    """Triton 3.6's interpreter computes ``tl.dot`` of bfloat16 operands wrongly: there the bf16-rounded tiles are
    multiplied as float32, the same products."""
    return dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret)


def kernel_tensors(weight: QuantWeight) -> tuple[torch.Tensor, ...]:
    """The kernels' tensor arguments; an absent one is any tensor on the device (an unused pointer). QuantWeight
    checked at construction that int32 indexes them."""
    low = weight.low
    return (low, weight.high if weight.high is not None else low, weight.d, weight.m if weight.m is not None else low,
            weight.a if weight.a is not None else low, weight.b if weight.b is not None else low)


def k_splits(programs: int, k: int, low_bits: int, block_w: int, device: torch.device,
             programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """How many parts to split K into: enough programs to fill the GPU about ``programs_per_sm`` times over (a
    4096-row weight in 32-row tiles is 128 programs, fewer than the H200's 132 SMs), each still a few K steps long."""
    if device.type != "cuda":
        return 1 if k < 1024 else 2   # the interpreter: both paths
    steps = cdiv(k * low_bits // 32, block_w)
    return max(1, min(cdiv(programs_per_sm * gpu.num_sms(gpu.device_index(device)), programs), steps // 4, 16))


def row_tile(t: int) -> int:
    """The GEMMs' BLOCK_M for t rows of x: the smallest of 16, 32, 64, 128 that holds them."""
    return 16 if t <= 16 else 32 if t <= 32 else 64 if t <= 64 else 128


def group_words(layout, block_w: int) -> int:
    """Words of a GEMV tile that share factors: a scale group's words when whole groups fit a tile, the tile when it
    fits in a group, else 1 (factors per word)."""
    words = layout.scale_group * layout.low_bits // 32
    if block_w % words == 0:
        return words
    return block_w if words % block_w == 0 else 1


def split_k(programs: int, k: int, low_bits: int, block_w: int, device: torch.device,
           splits: int | None, programs_per_sm: int = PROGRAMS_PER_SM) -> tuple[int, int]:
    """(splits, words per split), the words a whole number of K steps."""
    words = k * low_bits // 32
    if splits is None:
        splits = k_splits(programs, k, low_bits, block_w, device, programs_per_sm)
    split_words = cdiv(cdiv(words, splits), block_w) * block_w
    return cdiv(words, split_words), split_words


def groups_in_thread(block_n: int, block_w: int, group_words: int, warps: int) -> bool:
    """Whether Triton's default layout of a [block_w / group_words, group_words, block_n] int32 tile (16-byte vectors
    along N, threads then warps along N, then the groups, then a group's words) keeps each group's words in one
    thread: then the GEMVs sum a group's products in registers every K step; otherwise (threads or warps across a
    group) that sum would go through shared memory each step, and they keep per-word sums to the end. Only speed
    depends on it."""
    groups = block_w // group_words
    along_n = min(32, max(1, block_n // 4))
    along_groups = min(32 // along_n, groups)
    if along_n * along_groups < 32:
        return False
    warps_n = min(warps, max(1, block_n // (4 * along_n)))
    return warps // warps_n <= max(1, groups // along_groups)


def even_tiles(n: int, k: int, low_bits: int, block_n: int, split_words: int) -> bool:
    """Whether every GEMV tile lies inside the weight (the kernels' unmasked form, EVEN)."""
    return n % block_n == 0 and (k * low_bits // 32) % split_words == 0


def add_splits(partials: torch.Tensor, out: torch.Tensor, splits: int, n: int) -> None:
    """out [T, N] (rows of any stride) = the sum of partials [splits, T, N] (float32)."""
    t = out.shape[0] if out.dim() == 2 else 1
    target = out if out.is_contiguous() else torch.empty((t, n), dtype=out.dtype, device=out.device)
    sum_splits_kernel[(cdiv(t * n, 1024),)](partials, target, t * n, SPLITS=splits, BLOCK=1024, num_warps=4,
                                       **pdl_options(out.device))
    if target is not out:
        out.copy_(target)


COMPILED: set = set()       # keys whose unpacked tile has run (run_or_fall_back)
DOES_NOT_FIT: set = set()   # keys whose unpacked tile failed to compile: their fallback serves them


def run_or_fall_back(key: tuple, run, fallback) -> None:
    """``run()``, a launch of an unpacked GEMM tile, or ``fallback()`` (the per-position kernel) where the first
    launch for ``key`` (kernel, layout, row tile) failed to compile: a tile this GPU cannot hold in shared memory
    (sass_stats.py gemm --table: every default tile fits the H200; a GPU of 100 KB a block does not hold the larger
    row tiles) fails before any work is queued. Logged once a key."""
    if key in COMPILED:
        run()
        return
    if key not in DOES_NOT_FIT:
        try:
            run()
            COMPILED.add(key)
            return
        except (TritonError, RuntimeError) as exc:
            DOES_NOT_FIT.add(key)
            logger.warning("the unpacked low-bit GEMM's tile does not compile for %s (%s: %s); the slower "
                           "per-position kernel serves it", key, type(exc).__name__, str(exc)[:200])
    fallback()
