"""A GGUF token embedding or LM head kept in its quantized form (core's ``VocabParallelEmbedding.set_table_method``).

On the CPU's fast path (a bf16 engine), a table of a type with an int4 plane form (int4planes.py: Q8_0, Q4_*, Q5_*,
Q4_K, Q5_K) is repacked once into the planes torch's int4-packed matmul reads: the LM head (tied or not) is that
matmul (core's C kernel with float32 scales and sums where it is built: int4planes.py), the lookups read the same
planes back row by row, and no float copy of the table is kept (SmolLM2-135M's 49152 x 576 Q8_0 embedding: 28 MB of
planes and 14 MB of float32 scales instead of a 57 MB bf16 copy).
On CUDA a table is repacked into the GPU backend's low-bit planes as a linear layer's weight is (linear_method.py):
an LM head's logits are that layer's product (a Llama-3-8B head in Q6_K, llama.cpp's type for it in Q4_K_M files,
is 431 MB read a step instead of 1,051 MB of bf16), and lookups read rows of the same planes back
(cvllm_cuda.kernels.quant_matmul.dequantize_rows), so a tied table serves both and no float copy is kept
(CVLLM_GGUF_CUDA_LOOKUP_PLANES=0: the lookup tables a float copy, as before).
Everywhere else (other types, a layout whose rows cannot be read back: the raw blocks stay for the lookups) the
fallbacks are the plain ones: the table dequantized once to the engine's dtype.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from cvllm.layers.embedding import ParallelLMHead
from cvllm.layers.quantization import dense, plane_kernels_usable
from cvllm_gguf.dequant import dequantize
from cvllm_gguf.int4planes import int4_planes, planes_linear, planes_rows, planes_usable, rows_readable
from cvllm_gguf.linear_method import GGUFLinearMethod, has_planes
from cvllm_gguf.quant_types import GGMLType

logger = logging.getLogger(__name__)


class GGUFTableMethod(GGUFLinearMethod):
    """A table of ``out_features`` rows (the vocabulary) of ``in_features`` (the hidden size) in GGUF blocks."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        super().create_weights(layer, input_size, output_size, dtype)
        layer.table_dtype = dtype   # the engine's: lookups return it

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        out_features, in_features = layer.gguf_shape
        qweight = layer.qweight.data
        if plane_kernels_usable(qweight.device) and has_planes(self.qtype):
            super().process_weights_after_loading(layer)   # a linear layer's planes, for the products and lookups
            logger.info("%s %s %d x %d: low-bit planes (a bf16 copy: %.1f MB)", self.qtype.name,
                        "LM head" if isinstance(layer, ParallelLMHead) else "table", out_features, in_features,
                        out_features * in_features * 2 / 1e6)
            return
        if self.mode == "fast" and qweight.device.type == "cpu" and planes_usable(self.qtype, *layer.gguf_shape):
            planes = int4_planes(qweight, self.qtype, in_features)
            layer.int4_planes = planes
            layer.gguf_compute = "int4planes"
            readable = rows_readable(planes)
            if readable:
                layer.qweight.data = torch.empty(0, dtype=torch.uint8)
            logger.info("%s table %d x %d: int4 planes, %.1f MB (a bf16 copy: %.1f MB)%s", self.qtype.name,
                        out_features, in_features, planes.nbytes / 1e6, out_features * in_features * 2 / 1e6,
                        "" if readable else f"; its {qweight.nbytes / 1e6:.1f} MB of blocks stay for the lookups")
            return
        dtype = torch.float32 if self.mode == "exact" else layer.table_dtype
        layer.weight = dequantize(qweight, self.qtype, layer.gguf_shape).to(dtype)
        layer.qweight.data = torch.empty(0, dtype=torch.uint8, device=qweight.device)
        layer.gguf_compute = "dense"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.gguf_compute is None:
            self.process_weights_after_loading(layer)
        if layer.gguf_compute == "planes":
            return super().apply(layer, x, bias)
        if layer.gguf_compute == "int4planes":
            # float32 logits where the C kernel computed them (int4planes.py): the runner takes float32 logits
            # anyway, and rounding them to bf16 would add back an error the kernel avoided
            out = planes_linear(x, layer.int4_planes)
            if bias is not None:
                out = out + bias.to(out.dtype)
            return out
        return dense(x, layer.weight, bias)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if layer.gguf_compute is None:
            self.process_weights_after_loading(layer)
        if layer.gguf_compute == "planes":
            from cvllm_cuda.kernels.quant_matmul import dequantize_rows

            return dequantize_rows(layer.quant_weight, ids, layer.table_dtype)
        if layer.gguf_compute != "int4planes":
            return F.embedding(ids, layer.weight)
        flat = ids.reshape(-1)
        if layer.qweight.numel():   # the planes' rows cannot be read back here: the blocks stayed
            rows = dequantize(layer.qweight.data[flat], self.qtype, (flat.numel(), layer.gguf_shape[1]))
            return rows.to(layer.table_dtype).view(*ids.shape, -1)
        return planes_rows(layer.int4_planes, flat, layer.table_dtype).view(*ids.shape, -1)


# lookups from the planes on CUDA (quant_matmul.dequantize_rows), on by default since their GPU tests passed on the
# H200 (session 24); "0": an embedding and a head tied to it are a float copy on CUDA, an untied head planes either way
LOOKUP_PLANES_ENV = "CVLLM_GGUF_CUDA_LOOKUP_PLANES"


def gpu_planes_possible(table: nn.Module, qtype: GGMLType) -> bool:
    """Whether ``table`` may keep its blocks on CUDA: where CUDA is present, a type with a plane layout, an untied
    LM head, or any table unless CVLLM_GGUF_CUDA_LOOKUP_PLANES=0. The planes are made after loading, where
    ``plane_kernels_usable`` has the final word: elsewhere the table is dequantized as before."""
    lookups = not isinstance(table, ParallelLMHead)
    if not torch.cuda.is_available() or (lookups and os.environ.get(LOOKUP_PLANES_ENV, "1") == "0"):
        return False
    try:
        return has_planes(qtype)
    except ImportError:   # no cvllm-cuda: the layers load dequantized (plane_kernels_usable logs it)
        return False
