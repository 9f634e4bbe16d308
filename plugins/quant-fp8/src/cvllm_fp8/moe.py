"""FP8 MoE experts (Qwen3-MoE's and DeepSeek-V3/R1's FP8 releases: each expert's e4m3 weight with its
``weight_scale_inv`` per 128 x 128 block, or compressed-tensors' ``weight_scale`` per channel / tensor / block).

``FP8ExpertsMethod`` takes each expert's e4m3 weight and scale as stored (moved to the layer's device, nothing
converted) and after loading gives the layer its compute form:

- on CUDA with the low-bit kernels (one rank, or whole experts per rank with expert parallelism), each expert an
  FP8 low-bit plane (a byte a weight, its scales per row and column block: linear_method._planes, as the dense FP8
  layers take) stacked over the experts, computed by core's PlanesMoEMethod: the experts stay at about their
  checkpoint size on the GPU (DeepSeek-V3's 671B fit in FP8, not in bf16);
- elsewhere (CPU; experts split over tensor-parallel ranks; blocks the plane cannot hold) each expert dequantized
  (core's fp8_experts.dequantize_fp8) into the float experts of the engine's dtype, each rank its part.

Core skips its own FP8 dequantize-at-load pass (layers/fp8_experts.py) for layers with this method
(``keeps_fp8_experts``); core's HeldExpertsMethod holds the tensors and builds either form.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from cvllm.layers.fp8_experts import FP8_DTYPES, dequantize_fp8
from cvllm.layers.held_experts import SHARDS, HeldExpertsMethod
from cvllm_fp8.config import FP8Config

SCALE_PARTS = ("weight_scale_inv", "weight_scale")


class FP8ExpertsMethod(HeldExpertsMethod):
    needed = ("weight", "scale")
    format_name = "FP8"

    def __init__(self, config: FP8Config, where: str, in_situ: bool = False):
        super().__init__(where, in_situ)
        self.config = config

    def load_weight(self, layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor, shard_id: str,
                    expert_id: int | None) -> bool:
        if self.in_situ:   # --isq: the float experts load as usual, quantized after loading
            return False
        if loaded.dtype not in FP8_DTYPES:
            raise ValueError(f"a {loaded.dtype} expert weight in a layer whose experts this checkpoint stores in FP8")
        self.hold(layer, "weight", loaded, shard_id, expert_id)
        return True

    def load_expert_part(self, layer: nn.Module, part: str, loaded: torch.Tensor, shard_id: str,
                         expert_id: int | None) -> None:
        if part in SCALE_PARTS:
            self.hold(layer, "scale", loaded, shard_id, expert_id)
        elif part != "input_scale":   # a static activation scale: read, not used (dynamic per-token scales here)
            super().load_expert_part(layer, part, loaded, shard_id, expert_id)

    def dense_expert(self, shard: str, local: int) -> torch.Tensor:
        p = self.parts[(shard, local)]
        return dequantize_fp8(p["weight"], p["scale"])

    def quantize_expert(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """``--isq fp8``: one scale per output row, as the dense layers get it."""
        from cvllm_fp8.linear_method import quantize_rows

        q, scale = quantize_rows(weight)
        return {"weight": q, "scale": scale}

    def _row_scales(self, shard: str, local: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(e4m3 weight [N, K], float32 scales [N, ceil(K / columns)], columns): a block scale's rows repeated
        per output row; a tensor's or a channel's one scale per row over all K."""
        p = self.parts[(shard, local)]
        weight, scale = p["weight"], p["scale"].to(torch.float32)
        n, k = weight.shape
        if scale.numel() == 1:
            return weight, scale.reshape(1, 1).expand(n, 1).contiguous(), k
        if scale.numel() == n and (scale.dim() == 1 or scale.shape[-1] == 1):
            return weight, scale.reshape(n, 1), k
        rows, columns = math.ceil(n / scale.shape[0]), math.ceil(k / scale.shape[1])
        return weight, scale.repeat_interleave(rows, dim=0)[:n].contiguous(), columns

    def expert_planes(self, layer: nn.Module):
        from cvllm_cuda.kernels.fused_moe_planes import stack_experts
        from cvllm_fp8.linear_method import _planes

        stacked = []
        for shard in SHARDS:
            experts = [_planes(*self._row_scales(shard, local), self.where) for local in range(layer.num_local_experts)]
            if any(planes is None for planes in experts):
                return None
            stacked.append(stack_experts(experts))
        return tuple(stacked)
