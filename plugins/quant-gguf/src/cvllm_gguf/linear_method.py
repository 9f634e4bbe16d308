"""A LinearMethod over raw GGUF blocks.

The layer keeps the blocks exactly as the file stores them (``layer.qweight``: uint8
[out_features, bytes_per_row], ``layer.qtype``).

On a CUDA device every quantized type (Q4_0 ... Q8_0, Q2_K ... Q6_K) is repacked once after loading into the CUDA
backend's low-bit planes (``cvllm_gguf.planes``: the same integers and f16 scales, about the file's bytes) and the
blocks are freed; every call computes from the planes with ``cvllm_cuda.kernels.quant_matmul`` (float32 sums;
``gguf_compute == "planes"``), so GPU weight memory is about the file's size. ``CVLLM_QUANT_KERNELS=0`` turns this
off (every layer dequantized to bf16 instead). The dequantized path below remains for F32/F16/BF16 layers, a
row-parallel split off block boundaries (``gguf_columns``), and when cvllm-cuda's kernels cannot be imported.

On CPU, and for those, ``process_weights_after_loading`` prepares a compute form once (measured
on 2 cores with SmolLM2 shapes: dequantizing Q4_1 on every call ~208 ms a token, the int4-packed op ~7 ms):

- mode "fast": Q4_0/Q4_1 repacked into torch's int4-packed CPU layout for
  ``aten._weight_int4pack_mm_for_cpu`` (group 32, bf16 activations); every other type (and a
  Q4 layer whose out_features is not a multiple of 16, which the op cannot pack) dequantized
  once to bf16 for ``F.linear``;
- mode "exact": dequantized once to float32, ``F.linear`` in float32: for equality tests.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from cvllm.checkpoint.lazy import LazyTensor, lazy_aware, materialize
from cvllm.layers.quantization import LinearMethod, plane_kernels_usable
from cvllm_gguf.dequant import dequantize
from cvllm_gguf.int4pack import INT4PACK_TYPES, int4pack_linear, pack_q4_for_int4mm, packable
from cvllm_gguf.quant_types import FLOAT_DTYPES, FORMATS, GGMLType, resolve_qtype, row_bytes

logger = logging.getLogger(__name__)

Mode = Literal["fast", "exact"]


class GGUFLinearMethod(LinearMethod):
    def __init__(self, qtype: int | str, mode: Mode = "fast"):
        if mode not in ("fast", "exact"):
            raise ValueError(f"GGUFLinearMethod mode must be 'fast' or 'exact', not {mode!r}")
        self.qtype = resolve_qtype(qtype)
        self.mode = mode

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        # a row-parallel split (tensor parallelism) whose columns do not fall on block boundaries: this rank keeps
        # the full rows' blocks and dequantizes its columns once (``gguf_columns``), never a split block
        split = getattr(layer, "tp_size", 1) if getattr(layer, "tp_dim", None) == 1 else 1
        layer.gguf_columns = None
        if split > 1 and input_size % FORMATS[self.qtype].block_size:
            full = input_size * split
            _warn_unaligned(self.qtype, full, split)
            layer.gguf_columns = (layer.tp_rank * input_size, input_size)
            input_size = full
        width = row_bytes(self.qtype, input_size)
        qweight = nn.Parameter(torch.empty(output_size, width, dtype=torch.uint8), requires_grad=False)
        qweight.weight_loader = lazy_aware(partial(self.weight_loader, layer))
        layer.qweight = qweight
        layer.qtype = self.qtype
        layer.gguf_shape = (output_size, input_size)  # logical [out, in] of this rank's weight
        layer.gguf_compute = None  # set by process_weights_after_loading
        # core's LinearBase attaches its loader to ``layer.weight``; this buffer gives it one to
        # hold, and later carries the dequantized compute weight (empty on the int4pack path)
        layer.register_buffer("weight", torch.empty(0, dtype=dtype), persistent=False)

    def weight_loader(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor | LazyTensor,
                      shard_id: int | str | None = None) -> None:
        """Loads raw GGUF rows: uint8 [rows, bytes_per_row] (1-D bytes are split into rows; F32/F16/BF16
        also come as plain float tensors). A fused layer's shards (gate/up, q/k/v) are blocks of
        output rows, so the layer's own loader places them: it narrows byte rows exactly as it
        narrows float rows, and a row-parallel split of the input lands on whole blocks. Lazy rows
        (checkpoint/lazy.py) are read only as far as that narrowing keeps."""
        split = getattr(layer, "tp_size", 1) if getattr(layer, "tp_dim", None) == 1 else 1
        width = param.shape[1] * (1 if getattr(layer, "gguf_columns", None) else split)
        loaded = self._as_rows(loaded, width)
        layer_loader = getattr(layer, "weight_loader", None)
        if layer_loader is None or getattr(layer, "gguf_columns", None):   # full rows: no narrowing here
            if loaded.shape != param.shape:
                raise ValueError(f"checkpoint shape {tuple(loaded.shape)} != model shape {tuple(param.shape)}")
            param.data.copy_(materialize(loaded))
        elif shard_id is None:
            layer_loader(param, loaded)
        else:
            layer_loader(param, loaded, shard_id)
        layer.gguf_compute = None  # new bytes: the compute form must be prepared again

    def _as_rows(self, loaded: torch.Tensor | LazyTensor, width: int) -> torch.Tensor | LazyTensor:
        fmt = FORMATS[self.qtype]
        if isinstance(loaded, LazyTensor) and (loaded.dtype != torch.uint8 or loaded.dim() != 2):
            loaded = loaded.materialize()   # to be reinterpreted as rows of bytes below: read whole
        if loaded.dtype != torch.uint8:
            if FLOAT_DTYPES.get(self.qtype) != loaded.dtype:
                raise ValueError(f"expected raw {self.qtype.name} bytes (uint8), got a {loaded.dtype} tensor")
            loaded = loaded.contiguous().view(torch.uint8)
        if loaded.dim() == 1 and loaded.numel() % width == 0:
            loaded = loaded.view(-1, width)
        if loaded.dim() != 2 or loaded.shape[1] != width:
            got = loaded.shape[-1] if loaded.dim() else 0
            elements = width // fmt.type_size * fmt.block_size
            raise ValueError(f"{self.qtype.name} rows of {elements} elements are {width} bytes; the checkpoint "
                             f"tensor has shape {tuple(loaded.shape)} ({got} bytes per row): another GGML type "
                             f"or another row length")
        return loaded

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        out_features, in_features = layer.gguf_shape
        qweight = layer.qweight.data
        if not getattr(layer, "gguf_columns", None) and plane_kernels_usable(qweight.device) \
                and has_planes(self.qtype):
            from cvllm_cuda.quant_planes import attach
            from cvllm_gguf.planes import to_planes

            attach(layer, to_planes(qweight, self.qtype, in_features))
            layer.qweight.data = torch.empty(0, dtype=torch.uint8, device=qweight.device)   # the planes replace it
            layer.gguf_compute = "planes"
            return
        if self.mode == "fast" and qweight.device.type == "cpu" and self.qtype in INT4PACK_TYPES \
                and packable(out_features) and not getattr(layer, "gguf_columns", None):
            layer.int4_weight, layer.int4_scales_zeros = pack_q4_for_int4mm(qweight, self.qtype, in_features)
            layer.weight = torch.empty(0, device=qweight.device)
            layer.gguf_compute = "int4pack"
            return
        dtype = torch.float32 if self.mode == "exact" else torch.bfloat16
        weight = dequantize(qweight, self.qtype, (out_features, in_features))
        if getattr(layer, "gguf_columns", None):
            weight = weight.narrow(1, *layer.gguf_columns).contiguous()
        layer.weight = weight.to(dtype)
        layer.gguf_compute = "fp32" if dtype == torch.float32 else "bf16"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.gguf_compute is None:
            self.process_weights_after_loading(layer)
        if layer.gguf_compute == "planes":
            from cvllm_cuda.kernels.quant_matmul import quant_linear

            return quant_linear(x, layer.quant_weight, bias)
        if layer.gguf_compute == "int4pack":
            out = int4pack_linear(x, layer.int4_weight, layer.int4_scales_zeros)
            if bias is not None:
                out = out + bias.to(out.dtype)
            return out if out.dtype == x.dtype else out.to(x.dtype)
        weight = layer.weight
        out = F.linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype))
        return out.to(x.dtype)


def has_planes(qtype: GGMLType) -> bool:
    """Whether ``qtype`` has a plane layout (imported only where cvllm-cuda is: plane_kernels_usable said so)."""
    from cvllm_gguf.planes import has_layout

    return has_layout(qtype)


_warned: set = set()


def _warn_unaligned(qtype, columns: int, split: int) -> None:
    key = (qtype, columns, split)
    if key not in _warned:
        _warned.add(key)
        logger.warning("%s rows of %d columns split over %d tensor-parallel ranks off its %d-column blocks: each "
                       "rank holds the whole rows' blocks and dequantizes its own columns (more memory, exact "
                       "values)", qtype.name, columns, split, FORMATS[qtype].block_size)
