"""A LinearMethod for FP8 (e4m3) weights with float32 scales: checkpoints (config.py) and ``--isq fp8``.

The layer holds ``weight`` float8_e4m3fn [out, in], loaded (and split for tensor parallelism, fused q/k/v and
gate/up shards included) by the layer's own loader like a float weight, and its scales as ``weight_scale`` (or
``weight_scale_inv``) float32 [out, ceil(in / C)]: one row per output row, whatever the checkpoint's row blocks
(a per-tensor scale fills its shard's rows, a block's is repeated over its R rows), so the same loader splits them
with the weight. C is the checkpoint's column block, or all inputs for per-tensor and per-channel scales.

``--isq fp8`` quantizes each float shard as it arrives: one scale per output row, ``max |w| / 448`` (e4m3's largest
finite value), the row divided by it and rounded to e4m3.

After loading, on CUDA (``CVLLM_QUANT_KERNELS`` not "0", cvllm-cuda importable), 1 byte a weight on the GPU:
- one scale per row (per-tensor, per-channel, ``--isq fp8``) on a GPU with FP8 tensor cores: the e4m3 weight as
  it is, ``cvllm_cuda.kernels.fp8_linear`` (a GEMV for one row of x, W8A16; ``torch._scaled_mm`` W8A8 with
  per-token activation scales for more);
- block scales (DeepSeek's 128 x 128): an FP8 plane of the backend's low-bit layout, the Triton kernels (W8A16).
Elsewhere it is dequantized once to the engine's dtype. W8A16 computes W = float(w) * scale exactly as
``dequantize`` does.
"""

from __future__ import annotations

import logging
import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from cvllm.checkpoint.lazy import LazyTensor, materialize
from cvllm.layers.linear import output_shard, output_shards
from cvllm.layers.quantization import LinearMethod, plane_kernels_usable
from cvllm_fp8.config import FP8Config

logger = logging.getLogger(__name__)

E4M3_MAX = 448.0


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [out, in]: each e4m3 weight times the scale of its column block (``scale`` [out, ceil(in / C)])."""
    columns = math.ceil(weight.shape[1] / scale.shape[1])
    return weight.to(torch.float32) * scale.repeat_interleave(columns, dim=1)[:, :weight.shape[1]]


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [rows, in] -> (e4m3 [rows, in], float32 scales [rows, 1]) with one scale per row, max |w| / 448."""
    w = weight.to(torch.float32)
    scale = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


class FP8LinearMethod(LinearMethod):
    def __init__(self, config: FP8Config | None, layer_name: str = ""):
        """``config`` None: ``--isq fp8`` (float weights arrive and are quantized per row)."""
        self.config, self.layer_name = config, layer_name

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        self.dtype = dtype
        block = self.config.block if self.config else None
        self.columns = block[1] if block else None   # None: one scale spans the row
        if block and getattr(layer, "tp_dim", None) == 1 and getattr(layer, "tp_size", 1) > 1 \
                and input_size % self.columns:
            raise ValueError(f"{self.layer_name}: a tensor-parallel rank's {input_size} input features split the "
                             f"checkpoint's {self.columns}-column scale blocks; use a tensor_parallel_size that "
                             f"keeps whole blocks")
        weight = nn.Parameter(torch.empty(output_size, input_size, dtype=torch.float8_e4m3fn), requires_grad=False)
        if self.config is None:
            weight.weight_loader = partial(self._quantizing_loader, layer)
        layer.weight = weight
        scale_name = self.config.scale_name if self.config else "weight_scale"
        width = math.ceil(input_size / self.columns) if self.columns else 1
        layer.fp8_scale_name = scale_name
        if self.config is None:   # --isq fp8: computed while the weight loads, not a checkpoint tensor
            layer.register_buffer(scale_name, torch.empty(output_size, width, dtype=torch.float32), persistent=False)
        else:
            scale = nn.Parameter(torch.empty(output_size, width, dtype=torch.float32), requires_grad=False)
            scale.weight_loader = partial(self._scale_loader, layer)
            setattr(layer, scale_name, scale)
        if self.config is not None and self.config.static_input:
            # the checkpoint's activation scales, one per shard: read so that they load, not used (W8A16)
            shards = len(output_shards(layer))
            input_scale = nn.Parameter(torch.empty(shards, dtype=torch.float32), requires_grad=False)
            input_scale.weight_loader = partial(self._input_scale_loader, layer)
            layer.input_scale = input_scale
        layer.fp8_compute = None

    # --- loading ------------------------------------------------------------------------------------------
    def _scale_loader(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor | LazyTensor,
                      shard_id: object = None) -> None:
        scale = materialize(loaded).to(torch.float32)
        rows = output_shard(layer, shard_id).total   # the checkpoint tensor's rows
        if scale.numel() == 1 or (self.config is not None and self.config.per_tensor):
            if scale.numel() != 1:
                raise ValueError(f"a per-tensor scale has {scale.numel()} values")
            scale = scale.reshape(1, 1).expand(rows, 1)
        elif self.columns is None:     # per channel
            if scale.numel() != rows:
                raise ValueError(f"per-channel scales of shape {tuple(scale.shape)} for {rows} rows")
            scale = scale.reshape(rows, 1)
        else:                          # blocks: each block's scale repeated over its rows
            block_rows = self.config.block[0]
            if scale.dim() != 2 or scale.shape[0] != math.ceil(rows / block_rows):
                raise ValueError(f"block scales of shape {tuple(scale.shape)} for {rows} rows in blocks of "
                                 f"{block_rows}")
            scale = scale.repeat_interleave(block_rows, dim=0)[:rows]
        if self.columns is None and getattr(layer, "tp_dim", None) == 1:
            target = param.data   # a row-parallel rank keeps every output row, and a row's scale spans its inputs
            if target.shape != scale.shape:
                raise ValueError(f"scale shape {tuple(scale.shape)} != model shape {tuple(target.shape)}")
            target.copy_(scale)
        elif shard_id is None:
            layer.weight_loader(param, scale.contiguous())
        else:
            layer.weight_loader(param, scale.contiguous(), shard_id)
        layer.fp8_compute = None

    def _quantizing_loader(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor | LazyTensor,
                           shard_id: object = None) -> None:
        weight, scale = quantize_rows(self.float_weights(loaded).to(param.device))
        if shard_id is None:
            layer.weight_loader(param, weight)
        else:
            layer.weight_loader(param, weight, shard_id)
        self._scale_loader(layer, getattr(layer, layer.fp8_scale_name), scale, shard_id)

    def float_weights(self, loaded: torch.Tensor | LazyTensor) -> torch.Tensor:
        """An unquantized checkpoint tensor for ``--isq fp8`` to round (an error names the layer otherwise)."""
        values = materialize(loaded)
        if not values.is_floating_point() or values.dtype == torch.float8_e4m3fn:
            raise ValueError(f"isq fp8: '{self.layer_name}' expects float weights, the checkpoint has {values.dtype}")
        return values

    def _input_scale_loader(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor | LazyTensor,
                            shard_id: object = None) -> None:
        index = [shard.shard_id for shard in output_shards(layer)].index(shard_id)
        param.data[index] = materialize(loaded).to(torch.float32).reshape(-1)[0]

    # --- compute ------------------------------------------------------------------------------------------
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.fp8_compute is not None:
            return
        weight = layer._parameters.pop("weight").data
        name = layer.fp8_scale_name
        scale = (layer._parameters.pop(name) if name in layer._parameters else layer._buffers.pop(name)).data
        columns = self.columns or weight.shape[1]
        kernels = plane_kernels_usable(weight.device)
        if kernels and self.columns is None:
            from cvllm_cuda.kernels import fp8_linear

            if fp8_linear.usable(weight):   # one scale per row: the e4m3 weight as it is, FP8 tensor cores
                layer.register_buffer("weight", weight.contiguous(), persistent=False)
                layer.register_buffer("fp8_row_scale", scale.reshape(-1).contiguous(), persistent=False)
                layer.fp8_compute = "rows"
                return
        planes = _planes(weight, scale, columns, self.layer_name) if kernels else None
        if planes is not None:
            from cvllm_cuda.quant_planes import attach

            attach(layer, planes)
            layer.fp8_compute = "planes"
            return
        dtype = self.dtype if self.dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.bfloat16
        layer.register_buffer("weight", dequantize(weight, scale).to(dtype), persistent=False)
        layer.fp8_compute = "dense"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.fp8_compute is None:
            self.process_weights_after_loading(layer)
        if layer.fp8_compute == "rows":
            from cvllm_cuda.kernels.fp8_linear import fp8_linear

            return fp8_linear(x, layer.weight, layer.fp8_row_scale, bias)
        if layer.fp8_compute == "planes":
            from cvllm_cuda.kernels.quant_matmul import quant_linear

            return quant_linear(x, layer.quant_weight, bias)
        weight = layer.weight
        out = F.linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype))
        return out.to(x.dtype)


def _planes(weight: torch.Tensor, scale: torch.Tensor, columns: int, where: str):
    """The FP8 plane of ``weight`` [N, K] with ``scale`` [N, ceil(K / columns)], or None (the dense path) where the
    layout cannot hold the blocks: K must be whole blocks, and a block a multiple of 32 columns."""
    from cvllm_cuda.quant_planes import QuantLayout, QuantWeight, pack_plane

    n, k = weight.shape
    columns = min(columns, k)   # one block wider than the layer: the layer is one block
    if k % 32 or k % columns or columns % 32:
        if "shape" not in _warned:
            _warned.add("shape")
            logger.info("%s: %d inputs in scale blocks of %d columns do not fit the FP8 plane (whole blocks of a "
                        "multiple of 32): dequantized instead (and any later layer alike)", where, k, columns)
        return None
    layout = QuantLayout(8, 0, columns, columns, b_const=0, float8=True)
    return QuantWeight(layout, n, k, low=pack_plane(weight.view(torch.uint8), 8), high=None,
                       d=scale.t().contiguous(), m=None, a=None, b=None)


_warned: set[str] = set()
