"""Triton kernels of the CUDA backend: paged attention (paged_attention.py), the KV-cache write (kv_cache.py),
RMSNorm with its residual add (rms_norm.py, also Gemma's 1 + weight norm), LayerNorm with its residual add
(layer_norm.py, also per head), rotary (rotary.py) and SiLU·up and GELU·up (activation.py).

Importing this package imports triton and decorates the kernels; set TRITON_INTERPRET=1 before the
first import to run them on the CPU (how the tests run without a GPU).
"""

from cvllm_cuda.kernels.activation import gelu_and_mul, silu_and_mul
from cvllm_cuda.kernels.kv_cache import write_kv
from cvllm_cuda.kernels.layer_norm import fused_add_layer_norm
from cvllm_cuda.kernels.paged_attention import (
    TUNED_CONFIGS,
    AttentionConfig,
    attention_config,
    default_num_splits,
    paged_attention,
)
from cvllm_cuda.kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_plus_one
from cvllm_cuda.kernels.rotary import rotary

__all__ = ["TUNED_CONFIGS", "AttentionConfig", "attention_config", "default_num_splits", "fused_add_layer_norm",
           "fused_add_rms_norm", "fused_add_rms_norm_plus_one", "gelu_and_mul", "paged_attention", "rotary",
           "silu_and_mul", "write_kv"]
