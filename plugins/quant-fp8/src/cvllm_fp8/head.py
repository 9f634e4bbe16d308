"""``--isq fp8`` with ``CVLLM_ISQ_LM_HEAD=fp8``: an untied LM head in e4m3 with one scale per vocabulary row.

The head is the largest matrix a batch-1 step reads: Llama-3-8B's 128256 x 4096 is 1,051 MB in bf16, 525 MB in e4m3,
about a ninth of a step's bytes with the layers in FP8. It is quantized as the linear layers are (``quantize_rows``:
``max |w| / 448`` a row) as it loads and computed as they are (FP8LinearMethod: on a GPU with FP8 tensor cores the
row-scaled GEMV for one row, W8A8 ``torch._scaled_mm`` for more; elsewhere dequantized once). Off by default, as
vLLM's and TensorRT-LLM's FP8 keep the head in 16 bits: the next token is chosen from its logits, and e4m3 keeps 3
mantissa bits where llama.cpp's Q8_0 head keeps 8.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from cvllm.checkpoint.lazy import LazyTensor
from cvllm_fp8.linear_method import FP8LinearMethod, quantize_rows

LM_HEAD_ENV = "CVLLM_ISQ_LM_HEAD"   # the GGUF plugin's variable too: under --isq fp8 it takes "float" or "fp8"
HEAD_CHOICES = ("float", "fp8")


def head_choice(value: str | None) -> str:
    """The LM head's form under ``--isq fp8`` from CVLLM_ISQ_LM_HEAD: "float" (unset too) or "fp8"."""
    choice = (value or "").strip().lower() or "float"
    if choice not in HEAD_CHOICES:
        raise ValueError(f"{LM_HEAD_ENV}={value!r}: with --isq fp8 the LM head is 'float' (the default) or 'fp8'")
    return choice


class FP8HeadMethod(FP8LinearMethod):
    """A table method (core's ``VocabParallelEmbedding.set_table_method``) for an untied LM head: its float rows
    quantized per row as they load, its logits FP8LinearMethod's product."""

    def __init__(self, layer_name: str):
        super().__init__(None, layer_name)

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        super().create_weights(layer, input_size, output_size, dtype)
        layer.weight.weight_loader = partial(self._head_loader, layer)

    def _head_loader(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor | LazyTensor) -> None:
        values = self.float_weights(loaded)
        if tuple(values.shape) != tuple(param.shape):
            raise ValueError(f"{self.layer_name}: checkpoint shape {tuple(values.shape)} != model shape "
                             f"{tuple(param.shape)}")
        scales = getattr(layer, layer.fp8_scale_name)
        # 16k rows at a time: quantize_rows' float32 copy of a whole 128k x 4k head would be 2.1 GB on the device
        for start in range(0, values.shape[0], 16384):
            weight, scale = quantize_rows(values[start:start + 16384].to(param.device))
            param.data[start:start + weight.shape[0]].copy_(weight)
            scales[start:start + weight.shape[0]].copy_(scale)

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        raise TypeError(f"{self.layer_name}: an FP8 LM head computes logits only (a table that is looked up, or a "
                        f"head tied to one, stays float)")
