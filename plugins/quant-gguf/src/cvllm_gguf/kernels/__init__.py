"""Matmuls that read GGUF blocks in place on CUDA: ``gguf_matmul(x, qweight, qtype, out_features, in_features)``.

Importing this package needs triton (the linear method imports it only for a layer on a CUDA device). Each GGML
type with a kernel registers two launchers (``register``): a GEMV-style one for a few rows of x (a decode step:
the weight stream is the cost, so each program reads its output rows' blocks once and multiplies them with
every row of x) and a GEMM that dequantizes a weight tile in registers and feeds ``tl.dot`` (prefill).
``simple_blocks.py`` registers Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1; ``k_blocks.py``, where present, the K-quants.

Launches allocate nothing but the output and never read a value back to the host, so a decode step that calls
them can be captured in a CUDA graph.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from cvllm_gguf.quant_types import GGMLType, resolve_qtype

# launcher(x, qweight, out_features, in_features, out) -> None
Launcher = Callable[[torch.Tensor, torch.Tensor, int, int, torch.Tensor], None]

# x rows up to this many take the GEMV launcher, more the GEMM
GEMV_MAX_ROWS = 8

_KERNELS: dict[GGMLType, tuple[Launcher, Launcher]] = {}


def register(qtype: int | str, gemv: Launcher, gemm: Launcher) -> None:
    """Makes ``gguf_matmul`` compute with ``qtype``'s blocks in place (a later call replaces an earlier one).

    Both launchers have the signature ``launcher(x, qweight, out_features, in_features, out) -> None``:

    - ``x``: [T, in_features], bfloat16, float16 or float32, its last dimension contiguous (row stride any);
    - ``qweight``: uint8 [out_features, row_bytes(qtype, in_features)], contiguous, the blocks exactly as the
      GGUF file stores them;
    - ``out``: [T, out_features] of x's dtype, contiguous, written entirely by the launcher (no bias), the
      products accumulated in float32.

    ``gemv`` is called for T <= GEMV_MAX_ROWS, ``gemm`` for more rows. A launcher must not allocate, synchronise
    with the host or read tensor values on the host (the decode step is captured in CUDA graphs), and must
    launch on x's device and current stream.
    """
    _KERNELS[resolve_qtype(qtype)] = (gemv, gemm)


def has_kernel(qtype: int | str) -> bool:
    """True when ``gguf_matmul`` can compute with ``qtype``'s blocks."""
    return resolve_qtype(qtype) in _KERNELS


def kernel_types() -> tuple[GGMLType, ...]:
    return tuple(sorted(_KERNELS))


def gguf_matmul(x: torch.Tensor, qweight: torch.Tensor, qtype: int | str, out_features: int, in_features: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` for x [T, in_features] (bf16/fp16/fp32) and W the [out_features, in_features] weight whose
    GGML blocks ``qweight`` holds (uint8 [out_features, row_bytes]); returns ``out`` [T, out_features] in x's
    dtype (allocated when not given), accumulated in float32."""
    qtype = resolve_qtype(qtype)
    try:
        gemv, gemm = _KERNELS[qtype]
    except KeyError:
        raise NotImplementedError(f"no GGUF matmul kernel for {qtype.name}; kernels exist for "
                                  f"{', '.join(t.name for t in kernel_types())}") from None
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be [T, {in_features}], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[0] != out_features:
        raise ValueError(f"qweight must be uint8 [{out_features}, row_bytes], got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if not qweight.is_contiguous():
        qweight = qweight.contiguous()
    if out is None:
        out = torch.empty((x.shape[0], out_features), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0 or out_features == 0:
        return out
    launcher = gemv if x.shape[0] <= GEMV_MAX_ROWS else gemm
    launcher(x, qweight, out_features, in_features, out)
    return out


def _load_kernel_modules() -> None:
    from cvllm_gguf.kernels import simple_blocks  # noqa: F401  (registers its types)

    try:  # the K-quants, where that module exists
        importlib.import_module("cvllm_gguf.kernels.k_blocks")
    except ModuleNotFoundError as exc:
        if exc.name != "cvllm_gguf.kernels.k_blocks":
            raise


_load_kernel_modules()
