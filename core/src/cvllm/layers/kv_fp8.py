"""FP8 KV cache (``kv_cache_dtype="fp8"``, ``--kv-cache-dtype fp8``): keys and values stored as e4m3, one float32
scale per KV head of each layer for K and one for V, the stored value being ``x / scale`` (saturated to e4m3's ±448)
and the value read back ``stored * scale``. Twice the tokens of a 16-bit cache in the same memory.

The scales: a checkpoint's own where it has them (llm-compressor's ``kv_cache_scheme`` writes ``self_attn.k_scale``
and ``v_scale``, older FP8 checkpoints ``k_proj.output_scale``: one per tensor, used for every head; weight_loading.py
keeps them on the attention layer). Otherwise each layer's come from the first prefill it sees (eager, never a
captured decode graph: a decode always follows a prefill), by this rule: per KV head, ``scale = KV_SCALE_HEADROOM *
max|x| / 448`` over that prefill's keys (values) of the head, before rotary (rotating a pair of dimensions can grow
one of them by up to sqrt(2)). The headroom of 2 covers the rotation and later tokens up to ~1.4x the first
prompt's largest; larger ones saturate at ±448 * scale. A head whose first prefill has only zeros gets scale 1.
Per head, the scales do not depend on how tensor parallelism splits the heads.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
KV_SCALE_HEADROOM = 2.0
FP8_DTYPE = torch.float8_e4m3fn


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's dtype for EngineConfig.kv_cache_dtype."""
    return model_dtype if name == "auto" else FP8_DTYPE


def is_fp8(cache: torch.Tensor | None) -> bool:
    return cache is not None and cache.dtype == FP8_DTYPE


def init_scales(layer, device: torch.device) -> None:
    """Give an attention layer its (not yet set) K and V scales, float32 [kv heads] each."""
    heads = layer.kv_cache_shape()[0]
    k, v = getattr(layer, "checkpoint_k_scale", None), getattr(layer, "checkpoint_v_scale", None)
    layer.k_scale = torch.full((heads,), k or 1.0, dtype=torch.float32, device=device)
    layer.v_scale = torch.full((heads,), v or 1.0, dtype=torch.float32, device=device)
    layer.kv_scales_pending = not (k and v)   # the checkpoint's, or the first prefill's


def calibrate(layer, k: torch.Tensor, v: torch.Tensor) -> None:
    """Set the layer's scales from the first prefill's keys and values ([T, heads * D] or [T, heads, D]), on the
    device (no host sync)."""
    for scale, x in ((layer.k_scale, k), (layer.v_scale, v)):
        x = x.detach().reshape(x.shape[0], scale.shape[0], -1)
        amax = x.abs().amax(dim=(0, 2)).float() if x.numel() else torch.zeros_like(scale)
        scale.copy_(torch.where(amax > 0, amax * (KV_SCALE_HEADROOM / E4M3_MAX), 1.0))
    layer.kv_scales_pending = False


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., heads, D] / its head's scale ([heads]), saturated to e4m3's range, as e4m3 (torch's conversion makes
    out-of-range values NaN)."""
    return (x.float() / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
