"""One layout for every low-bit weight the CUDA matmul reads (kernels/quant_matmul.py): GGUF blocks and GPTQ/AWQ
groups are repacked into it once at load, losslessly (the same integers, the same f16 scales), in about the bytes
of the original.

Element k of row n has an unsigned integer q (``low_bits`` from the low plane, ``high_bits`` more above them from
the high plane) and its value is

    q * scale + offset,   scale = D * A,   offset = M * B

with D (and M) f16 per ``super_group`` elements and A, B per ``scale_group`` elements (see ``QuantLayout``). Every
format's own formula fits: Q4_0 is ``d * (q - 8)`` (A = 1, M = D, B = -8), Q4_K ``d*sc * q - dmin*mn`` (A = sc,
M = dmin, B = -mn), GPTQ ``s * (q - z)`` (M = D = s, B = -z). Those products are exact in float32 for every
supported format, so the kernels' weights equal dequant-then-matmul's bit for bit; only the sums' order differs.

Why repack rather than read the file's blocks in place: the blocks interleave f16 scales with the quants at 18-,
34- or 210-byte strides, so a warp cannot load them with wide aligned loads, and the K-quants' packed 6-bit scales
cost more to unpack than the weights. Here every plane is an int32 array [K * bits / 32, N], input features packed
into words in order (element k at bits ``(k % per_word) * bits`` of word ``k // per_word``) and output features
contiguous, the layout GPTQ checkpoints already have: a warp loads the words of consecutive output features with
wide loads, and each thread keeps several output features, so every activation it loads serves all of them. The
factors are plain arrays [K / group, N].
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields

import torch

GROUP = 32  # elements per storage group (one word of 1-bit planes)


@dataclass(frozen=True, slots=True)
class QuantLayout:
    low_bits: int        # 2, 4 or 8
    high_bits: int       # 0, 1 or 2
    scale_group: int     # elements per A and B (a multiple of 16, dividing super_group)
    super_group: int     # elements per D and M (a multiple of 32)
    a_mode: int = 0      # A: 0 = 1, 1 = int8 per scale group, 2 = uint8 per scale group
    b_mode: int = 0      # B: 0 = b_const, 1 = A * b_const, 2 = uint8 per scale group * b_const
    b_const: int = 1
    has_m: bool = False  # M from its own f16 per super group; else M = D
    float8: bool = False  # the low plane's bytes are FP8 e4m3 values, not integers (q * D, offset 0)
    # the batch-1 GEMV may round the activations to int8 per 32 inputs and sum with integer dot products
    # (kernels/quant_gemv_int8.py): llama.cpp's numerics for its formats (GGUF sets it), not GPTQ's W4A16
    int8_activations: bool = False

    def __post_init__(self):
        if self.low_bits not in (2, 4, 8) or self.high_bits not in (0, 1, 2):
            raise ValueError(f"unsupported plane widths {self.low_bits}+{self.high_bits}")
        if self.float8 and (self.low_bits != 8 or self.high_bits or self.a_mode or self.b_mode or self.b_const):
            raise ValueError("an FP8 plane is 8 bits with a scale D only (no A, B or offset)")
        if self.scale_group % 16 or self.super_group % GROUP or self.super_group % self.scale_group:
            raise ValueError(f"scale group {self.scale_group} / super group {self.super_group} do not nest")
        if self.scale_group < GROUP // self.low_bits:
            raise ValueError("a scale group must cover whole words of the low plane")

    def bits(self) -> int:
        return self.low_bits + self.high_bits

    def kernel_args(self) -> dict:
        """The layout as the kernels' constexpr keyword arguments (the same dict every call: do not modify)."""
        return _kernel_args(self)


@functools.cache
def _kernel_args(layout: QuantLayout) -> dict:
    return {f.name.upper(): getattr(layout, f.name) for f in fields(layout) if f.name != "int8_activations"}


@dataclass(slots=True)
class QuantWeight:
    """A [out_features N, in_features K] weight in ``layout``: the planes and factors, each [..., N] (K-major, as
    GPTQ stores them: the output features of one word or group are contiguous)."""
    layout: QuantLayout
    out_features: int
    in_features: int
    low: torch.Tensor                  # int32 [K * low_bits / 32, N]
    high: torch.Tensor | None          # int32 [K * high_bits / 32, N]
    d: torch.Tensor                    # float16 or float32 [K / super_group, N]
    m: torch.Tensor | None             # like d
    a: torch.Tensor | None             # int8 / uint8 [K / scale_group, N]
    b: torch.Tensor | None             # uint8 [K / scale_group, N]
    # the int8 form of this weight's next input, left by the kernel that made that input (quant_gemv_int8.hand_over)
    handed: tuple | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        # the kernels index the planes and factors with int32
        if max(t.numel() for t in self.tensors().values()) >= 1 << 31:
            raise ValueError(f"a {self.out_features} x {self.in_features} weight is too large for the plane kernels "
                             f"(2**31 elements in one plane)")

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: t for name in ("low", "high", "d", "m", "a", "b") if (t := getattr(self, name)) is not None}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, device: torch.device | str) -> QuantWeight:
        moved = {name: t.to(device) for name, t in self.tensors().items()}
        return QuantWeight(self.layout, self.out_features, self.in_features, **{
            name: moved.get(name) for name in ("low", "high", "d", "m", "a", "b")})


def attach(layer: torch.nn.Module, weight: QuantWeight, prefix: str = "quant") -> None:
    """Make ``weight`` a layer's compute form: its tensors become non-persistent buffers ``<prefix>_<name>`` (counted,
    moved and listed like the weights), ``layer.<prefix>_weight`` the QuantWeight, ``layer.weight`` an empty buffer
    (no float copy). The caller frees what the layer loaded and records its compute form."""
    device = weight.low.device
    for name, tensor in weight.tensors().items():
        layer.register_buffer(f"{prefix}_{name}", tensor, persistent=False)
    setattr(layer, f"{prefix}_weight", weight)
    if "weight" in layer._parameters:
        del layer._parameters["weight"]
    layer.register_buffer("weight", torch.empty(0, device=device), persistent=False)


def pack_plane(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8/int [N, K] values below 2**bits to the plane layout: int32 [K * bits / 32, N], element k of output
    feature n at bits ``(k % per_word) * bits`` of word [k // per_word, n] (GPTQ's qweight layout). Done a slice
    of rows at a time: the values are int64 for a moment, and an LM head's would be gigabytes."""
    n, k = q.shape
    per_word = 32 // bits
    out = torch.empty((k // per_word, n), dtype=torch.int32, device=q.device)
    shifts = torch.arange(per_word, device=q.device, dtype=torch.int64) * bits
    rows = max(1, _PACK_ELEMENTS // max(k, 1))
    for r0 in range(0, n, rows):
        part = q[r0:r0 + rows].to(torch.int64).view(-1, k // per_word, per_word)
        words = (part << shifts).sum(-1)                                             # disjoint bits: sum = or
        out[:, r0:r0 + rows] = torch.where(words >= 1 << 31, words - (1 << 32), words).t()   # two's complement
    return out


_PACK_ELEMENTS = 1 << 24


def unpack_plane(words: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """The inverse of ``pack_plane``: int64 [N, K]."""
    n = words.shape[1]
    per_word = 32 // bits
    shifts = torch.arange(per_word, device=words.device, dtype=torch.int64) * bits
    return ((words.t().to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(n, in_features)


def dequantize_planes(weight: QuantWeight) -> torch.Tensor:
    """float32 [N, K]: the values the kernels compute with (the reference their tests compare against)."""
    lay, k = weight.layout, weight.in_features
    q = unpack_plane(weight.low, lay.low_bits, k)
    if lay.float8:
        q = q.to(torch.uint8).view(torch.float8_e4m3fn)
    if lay.high_bits:
        q |= unpack_plane(weight.high, lay.high_bits, k) << lay.low_bits
    d = weight.d.float().t().repeat_interleave(lay.super_group, dim=1)
    m = d if not lay.has_m else weight.m.float().t().repeat_interleave(lay.super_group, dim=1)
    per_scale = lay.scale_group

    def expand(t: torch.Tensor) -> torch.Tensor:
        return t.float().t().repeat_interleave(per_scale, dim=1)

    a = expand(weight.a) if lay.a_mode else torch.ones_like(d)
    if lay.b_mode == 0:
        b = torch.full_like(d, float(lay.b_const))
    elif lay.b_mode == 1:
        b = a * lay.b_const
    else:
        b = expand(weight.b) * lay.b_const
    return q.float() * (d * a) + m * b
