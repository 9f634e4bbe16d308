"""A fused layer whose parts have different GGML types: llama.cpp's *_M mixes put a Q6_K ``attn_v`` beside Q4_K
``attn_q``/``attn_k`` (and so on), and cvllm fuses q/k/v (gate/up) into one layer.

The layer's one ``qweight`` parameter is a flat byte buffer holding each part's blocks back to back (part i:
[rows_i, row_bytes(type_i, in)]); the loader puts a part's rows at its place, narrowed to this tensor-parallel
rank's rows as the fused layer itself narrows float rows. After loading, each part becomes its own plane weight on
CUDA (one matmul per part into its columns of the output: the blocks stay low-bit) or is dequantized and the parts
stacked into one float weight elsewhere.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from cvllm.checkpoint.lazy import LazyTensor, lazy_aware, materialize
from cvllm.layers.linear import output_shards
from cvllm.layers.quantization import LinearMethod, plane_kernels_usable
from cvllm_gguf.dequant import dequantize
from cvllm_gguf.linear_method import Mode, has_planes
from cvllm_gguf.quant_types import FORMATS, GGMLType, row_bytes


class MixedGGUFLinearMethod(LinearMethod):
    def __init__(self, qtypes: list[GGMLType], mode: Mode = "fast"):
        self.qtypes, self.mode = qtypes, mode

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        parts = output_shards(layer)
        if len(parts) != len(self.qtypes):
            raise ValueError(f"a {type(layer).__name__} of {len(parts)} parts given {len(self.qtypes)} GGML types")
        layer.gguf_parts = []   # (shard id, qtype, rows, first checkpoint row, byte offset, row bytes)
        offset = 0
        for part, qtype in zip(parts, self.qtypes):
            if input_size % FORMATS[qtype].block_size:
                raise ValueError(f"{input_size} inputs are not whole {qtype.name} blocks")
            width = row_bytes(qtype, input_size)
            layer.gguf_parts.append((part.shard_id, qtype, part.rows, part.start, offset, width))
            offset += part.rows * width
        qweight = nn.Parameter(torch.empty(offset, dtype=torch.uint8), requires_grad=False)
        qweight.weight_loader = lazy_aware(partial(self.weight_loader, layer))
        layer.qweight = qweight
        layer.gguf_shape = (output_size, input_size)
        layer.gguf_compute = None
        layer.register_buffer("weight", torch.empty(0, dtype=dtype), persistent=False)

    def weight_loader(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor | LazyTensor,
                      shard_id: object = None) -> None:
        part = next((p for p in layer.gguf_parts if p[0] == shard_id), None)
        if part is None:
            raise ValueError(f"unknown shard {shard_id!r}")
        _, qtype, rows, start, offset, width = part
        if loaded.dim() != 2 or loaded.shape[1] != width or loaded.dtype != torch.uint8:
            raise ValueError(f"shard {shard_id!r}: expected {qtype.name} rows of {width} bytes, got "
                             f"{loaded.dtype} {tuple(loaded.shape)}")
        if loaded.shape[0] != rows:
            loaded = loaded.narrow(0, start, rows)
        param.data[offset:offset + rows * width].view(rows, width).copy_(materialize(loaded))
        layer.gguf_compute = None

    def _part_bytes(self, layer: nn.Module):
        data = layer.qweight.data
        for _, qtype, rows, _, offset, width in layer.gguf_parts:
            yield qtype, rows, data[offset:offset + rows * width].view(rows, width)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        _, in_features = layer.gguf_shape
        device = layer.qweight.device
        if plane_kernels_usable(device) and all(has_planes(t) for t in self.qtypes):
            from cvllm_cuda.quant_planes import attach
            from cvllm_gguf.planes import to_planes

            layer.quant_parts, start = [], 0
            for i, (qtype, rows, blocks) in enumerate(self._part_bytes(layer)):
                planes = to_planes(blocks, qtype, in_features)
                attach(layer, planes, prefix=f"quant_{i}")
                layer.quant_parts.append((start, planes))
                start += rows
            layer.qweight.data = torch.empty(0, dtype=torch.uint8, device=device)
            layer.gguf_compute = "planes"
            return
        dtype = torch.float32 if self.mode == "exact" else torch.bfloat16
        layer.weight = torch.cat([dequantize(blocks, qtype, (rows, in_features))
                                  for qtype, rows, blocks in self._part_bytes(layer)]).to(dtype)
        layer.gguf_compute = "fp32" if dtype == torch.float32 else "bf16"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.gguf_compute is None:
            self.process_weights_after_loading(layer)
        if layer.gguf_compute == "planes":
            from cvllm_cuda.kernels.quant_matmul import GEMM_MAX_ROWS, quant_matmul

            out_features, in_features = layer.gguf_shape
            x2 = x.reshape(-1, in_features)
            out = torch.empty((x2.shape[0], out_features), dtype=x.dtype, device=x.device)
            for start, planes in layer.quant_parts:   # each part into its columns
                columns = out[:, start:start + planes.out_features]
                if x2.shape[0] > GEMM_MAX_ROWS:
                    columns.copy_(quant_matmul(x2, planes))
                else:
                    quant_matmul(x2, planes, out=columns)
            if bias is not None:
                out += bias.to(out.dtype)
            return out.view(*x.shape[:-1], out_features)
        weight = layer.weight
        out = F.linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype))
        return out.to(x.dtype)
