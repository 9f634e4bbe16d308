"""``--isq gptq`` (alias ``marlin``): an unquantized checkpoint's linear weights quantized while they load, by
round-to-nearest with fp16 group scales (rtn.py: 4 bits, symmetric, groups of 128 inputs; 64 or 32 where the
inputs, or a tensor-parallel rank's part of them, are not whole groups of 128; unquantized where not even 32).
Lower quality than a calibrated GPTQ or AWQ checkpoint of the same size: a quick way to fit a model, not a
substitute for one.

Each float shard is quantized as it arrives, so no layer ever holds its float weight whole, into rows of
"blocks" like GGUF's: per group of G inputs, G code bytes, the fp16 scale and the zero byte (G + 3 bytes). The
layer's own loader narrows those rows as it narrows float rows (a tensor-parallel rank keeps its output rows, or
whole groups of its input columns), and a lazy checkpoint tensor is quantized only as far as that narrowing keeps.
After loading, the blocks become the CUDA backend's low-bit planes (a Triton kernel computes with them, weight
memory ~4.1 bits a weight) or, on CPU, one dequantized weight in the engine's dtype.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from cvllm.checkpoint.base import Checkpoint
from cvllm.checkpoint.lazy import Box, LazyTensor, lazy_aware, materialize
from cvllm.layers.fused_moe_methods import FusedMoEMethod
from cvllm.layers.quantization import LinearMethod, LinearMethodFactory, is_moe_router, plane_kernels_usable
from cvllm_marlin.rtn import quantize_rtn

logger = logging.getLogger(__name__)

ISQ_NAMES = ("gptq", "marlin")
BITS, GROUP_SIZES = 4, (128, 64, 32)


def encode_blocks(weight: torch.Tensor, group: int) -> torch.Tensor:
    """float [rows, K] -> uint8 [rows, K / group * (group + 3)]: per group its codes, fp16 scale, zero."""
    rows, k = weight.shape
    rtn = quantize_rtn(weight, BITS, group, sym=True)
    codes = rtn.q.view(rows, k // group, group)
    scales = rtn.scales.t().contiguous().view(torch.uint8).view(rows, k // group, 2)
    zeros = rtn.zeros.t().reshape(rows, k // group, 1)
    return torch.cat([codes, scales, zeros], dim=2).view(rows, -1)


def decode_blocks(blocks: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of ``encode_blocks``: (codes uint8 [rows, K], scales fp16 [groups, rows], zeros uint8 [groups,
    rows])."""
    rows = blocks.shape[0]
    b = blocks.view(rows, -1, group + 3)
    codes = b[:, :, :group].reshape(rows, -1)
    scales = b[:, :, group:group + 2].contiguous().view(torch.float16).view(rows, -1).t().contiguous()
    zeros = b[:, :, group + 2].t().contiguous()
    return codes, scales, zeros


def _encoded_lazily(floats: LazyTensor, group: int, device: torch.device) -> LazyTensor:
    """``encode_blocks`` of a 2-D float LazyTensor, computed only for the rows and whole groups it is narrowed to."""
    rows, k = floats.shape
    width = group + 3

    def read(box: Box) -> torch.Tensor:
        (row, count), (byte, nbytes) = box
        if byte % width or nbytes % width:
            raise ValueError(f"bytes {byte}..{byte + nbytes} of the quantized rows split a group of {group}")
        part = floats.narrow(0, row, count).narrow(1, byte // width * group, nbytes // width * group)
        return encode_blocks(part.materialize().to(device), group)

    return LazyTensor((rows, k // group * width), torch.uint8, read)


class RTNLinearMethod(LinearMethod):
    def __init__(self, name: str):
        self.name = name
        self.group: int | None = None

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        self.dtype = dtype
        # the group of the whole layer's inputs, so that every tensor-parallel rank quantizes as one rank does
        split = getattr(layer, "tp_size", 1) if getattr(layer, "tp_dim", None) == 1 else 1
        self.group = next((g for g in GROUP_SIZES if input_size % g == 0 and input_size * split % g == 0), None)
        if self.group is None:
            logger.info("isq gptq: layer '%s' has %d inputs, not whole groups of 32: left unquantized", self.name,
                        input_size)
            layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
            return
        blocks = nn.Parameter(torch.empty(output_size, input_size // self.group * (self.group + 3),
                                          dtype=torch.uint8), requires_grad=False)
        blocks.weight_loader = lazy_aware(partial(self.weight_loader, layer))
        layer.weight = blocks   # the name the checkpoint's float tensors load into
        layer.rtn_shape = (output_size, input_size)
        layer.rtn_compute = None

    def weight_loader(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor | LazyTensor,
                      shard_id: object = None) -> None:
        if not loaded.is_floating_point():
            raise ValueError(f"isq gptq: '{self.name}' expects float weights, the checkpoint has {loaded.dtype}")
        if isinstance(loaded, LazyTensor) and loaded.dim() == 2:
            loaded = _encoded_lazily(loaded, self.group, param.device)
        else:
            loaded = encode_blocks(materialize(loaded).to(param.device), self.group)
        layer_loader = getattr(layer, "weight_loader", None)
        if layer_loader is None:
            param.data.copy_(materialize(loaded))
        elif shard_id is None:
            layer_loader(param, loaded)
        else:
            layer_loader(param, loaded, shard_id)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.group is None or layer.rtn_compute is not None:
            return
        blocks = layer._parameters.pop("weight")
        codes, scales, zeros = decode_blocks(blocks.data, self.group)
        out_features, in_features = layer.rtn_shape
        if plane_kernels_usable(blocks.device):
            from cvllm_cuda.quant_planes import attach

            attach(layer, _planes(codes, scales, zeros, self.group))
            layer.rtn_compute = "planes"
            return
        groups = torch.arange(in_features, device=codes.device) // self.group
        weight = (codes.float() - zeros.t().float()[:, groups]) * scales.t().float()[:, groups]
        dtype = self.dtype if self.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.bfloat16
        layer.register_buffer("weight", weight.to(dtype), persistent=False)
        layer.rtn_compute = "dense"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.group is not None and layer.rtn_compute is None:
            self.process_weights_after_loading(layer)
        if self.group is not None and layer.rtn_compute == "planes":
            from cvllm_cuda.kernels.quant_matmul import quant_linear

            return quant_linear(x, layer.quant_weight, bias)
        weight = layer.weight
        out = F.linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype))
        return out.to(x.dtype)


def _planes(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int):
    """The CUDA backend's plane form of the blocks."""
    from cvllm_cuda.quant_planes import QuantWeight, pack_plane
    from cvllm_marlin.planes import layout as planes_layout

    layout = planes_layout(BITS, group)
    n, k = codes.shape
    return QuantWeight(layout, n, k, low=pack_plane(codes, BITS), high=None, d=scales, m=None, a=None, b=zeros)


def isq_gptq_linear_methods(checkpoint: Checkpoint, dtype: torch.dtype) -> LinearMethodFactory:
    """The "isq-gptq" (and "isq-marlin") quantizer."""
    name = str(checkpoint.quant_config).lower()
    if name not in ISQ_NAMES:
        raise ValueError(f"isq {name!r}: this quantizer makes {' / '.join(ISQ_NAMES)} (4-bit, groups of 128)")
    def method_for(layer: str, sources: Sequence[str]) -> LinearMethod | None:
        return None if is_moe_router(layer) else RTNLinearMethod(layer)

    def moe_method(name: str, module) -> FusedMoEMethod:
        """MoE experts too: each loaded expert rounded to nearest after loading (moe.py)."""
        from cvllm_marlin.config import GPTQConfig
        from cvllm_marlin.moe import PackedExpertsMethod

        config = GPTQConfig(bits=BITS, group_size=GROUP_SIZES[0], sym=True, desc_act=False, zero_offset=1)
        return PackedExpertsMethod("gptq", config, name, in_situ=True)

    method_for.moe_method = moe_method
    return method_for
