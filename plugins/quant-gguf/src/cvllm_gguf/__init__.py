"""GGUF support for cvllm: GGML block formats in torch and a LinearMethod over raw GGUF blocks."""

from cvllm_gguf.dequant import dequantize
from cvllm_gguf.linear_method import GGUFLinearMethod
from cvllm_gguf.quant_types import GGMLType, UnsupportedQuantType, resolve_qtype
from cvllm_gguf.quantize import quantize

__all__ = ["GGMLType", "GGUFLinearMethod", "UnsupportedQuantType", "dequantize", "quantize", "resolve_qtype"]
