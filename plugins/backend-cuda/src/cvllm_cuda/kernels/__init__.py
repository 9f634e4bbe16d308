"""Triton kernels of the CUDA backend: paged attention (paged_attention.py) and the KV-cache write (kv_cache.py).

Importing this package imports triton and decorates the kernels; set TRITON_INTERPRET=1 before the
first import to run them on the CPU (how the tests run without a GPU).
"""

from cvllm_cuda.kernels.kv_cache import write_kv
from cvllm_cuda.kernels.paged_attention import (
    TUNED_CONFIGS,
    AttentionConfig,
    attention_config,
    default_num_splits,
    paged_attention,
)

__all__ = ["TUNED_CONFIGS", "AttentionConfig", "attention_config", "default_num_splits", "paged_attention",
           "write_kv"]
