"""FP8 expert weights of MoE checkpoints (transformers' "fp8": ``weight_scale_inv`` per 128 x 128 block, as
Qwen3-MoE and DeepSeek-V3 FP8 releases ship; compressed-tensors: ``weight_scale`` per tensor, channel or block),
dequantized as they load, so the experts run as float weights like every other MoE checkpoint's.

Each per-expert e4m3 weight is held until its scale tensor has come, or the scale until its weight (a checkpoint
may store them in either order, in different files), then ``q * scale`` in float32 goes to the layer's loader.
One expert's tensors at a time are held, so the cost is the experts' float size on the device. This is the path of a
layer whose quantizer leaves its experts to core; the FP8 quantizers keep them FP8 (cvllm_fp8/moe.py, marked
``keeps_fp8_experts``: this pass skips those). A weight whose scale never comes is an error.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator

import torch

from cvllm.checkpoint.base import CheckpointError
from cvllm.checkpoint.lazy import materialize

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# "<module>.experts.<e>.<proj>.weight_scale_inv" (transformers' fp8) or ".weight_scale" (compressed-tensors)
_SCALE = re.compile(r"^(?P<weight>.+\.experts\.\d+\.(?:gate_proj|up_proj|down_proj))"
                    r"\.(?:weight_scale_inv|weight_scale)$")


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [out, in]: ``weight * scale`` with one scale for the tensor, one per row ([out] or [out, 1]), or
    one per block ([ceil(out / R), ceil(in / C)])."""
    w, s = weight.to(torch.float32), scale.to(torch.float32)
    out, inp = w.shape
    if s.numel() == 1:
        return w * s.reshape(())
    if s.numel() == out and (s.dim() == 1 or s.shape[-1] == 1):
        return w * s.reshape(out, 1)
    if s.dim() != 2:
        raise ValueError(f"scale of shape {tuple(s.shape)} for a weight of shape {(out, inp)}")
    rows, cols = math.ceil(out / s.shape[0]), math.ceil(inp / s.shape[1])
    return w * s.repeat_interleave(rows, dim=0)[:out].repeat_interleave(cols, dim=1)[:, :inp]


def with_fp8_experts_dequantized(weights: Iterable[tuple[str, torch.Tensor]],
                                 expert_here: Callable[[str], bool | None]) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with each FP8 expert weight replaced by its float32 value once its scale has come, and the
    scales consumed; everything else passes through unchanged. ``expert_here(name)``: None for a tensor that is
    no expert weight, False for another rank's expert (expert parallelism: its weight and scale are dropped
    unread), True for one of this rank's."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        scale = _SCALE.match(name)
        key = f"{scale['weight']}.weight" if scale else name
        here = expert_here(key)   # by name only: another rank's tensor is not touched, not even its dtype
        if scale and here is False:
            continue
        if here is None or (not scale and (not here or tensor.dtype not in FP8_DTYPES)):
            yield name, tensor    # the layer's loader skips another rank's expert itself
            continue
        part = "scale" if scale else "weight"
        pair = held.setdefault(key, {})
        pair[part] = tensor
        if len(pair) == 2:
            del held[key]
            try:
                yield key, dequantize_fp8(materialize(pair["weight"]), materialize(pair["scale"]))
            except ValueError as e:
                raise CheckpointError(f"cannot dequantize '{key}': {e}") from None
    missing = [f"{key} (no {'scale' if 'weight' in pair else 'weight'})" for key, pair in held.items()]
    if missing:
        raise CheckpointError(f"FP8 expert tensors without their pair: {', '.join(missing[:4])}"
                              f"{' ...' if len(missing) > 4 else ''}")
