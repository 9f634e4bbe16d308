"""GPTQ and AWQ checkpoints' MoE experts (Qwen3-30B-A3B-GPTQ-Int4, Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4 ...).

The checkpoint holds each expert's projections as ``experts.<e>.{gate,up,down}_proj.{qweight,qzeros,scales,g_idx}``.
``PackedExpertsMethod`` (core's HeldExpertsMethod) takes them as stored, and after loading:

- on CUDA with the low-bit kernels (one rank, or whole experts per rank), each expert's gate, up and down groups
  repacked losslessly into low-bit planes (planes.py: GPTQ's qweight already is one) and stacked over the experts,
  computed by the fused-MoE planes kernel: the experts stay at about the checkpoint's size on the GPU (act-order
  experts too: each expert's inputs sorted by group, the kernel gathering x in that order);
- elsewhere (CPU; experts split over tensor-parallel ranks; shapes the planes cannot hold) each expert dequantized
  (packing.py: the dense layers' numbers, bit for bit) into float experts of the engine's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from cvllm.layers.held_experts import SHARDS, HeldExpertsMethod
from cvllm_marlin.packing import dequantize_awq, dequantize_gptq


class PackedExpertsMethod(HeldExpertsMethod):
    needed = ("qweight", "qzeros", "scales")

    def __init__(self, name: str, config, where: str, in_situ: bool = False):
        """``name``: "gptq" or "awq"; ``config``: its parsed quantization_config; ``where``: the layer's name."""
        super().__init__(where, in_situ)
        self.name, self.config, self.format_name = name, config, name.upper()

    def load_weight(self, layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor, shard_id: str,
                    expert_id: int | None) -> bool:
        if self.in_situ:   # --isq: the float experts load as usual, quantized after loading
            return False
        raise ValueError(f"a float expert weight in a layer whose experts this {self.format_name} checkpoint "
                         f"quantizes")

    def load_expert_part(self, layer: nn.Module, part: str, loaded: torch.Tensor, shard_id: str,
                         expert_id: int | None) -> None:
        self.hold(layer, part, loaded, shard_id, expert_id)

    def _expert(self, shard: str, local: int) -> tuple[torch.Tensor, ...]:
        p = self.parts[(shard, local)]
        if self.name == "awq":
            return p["qweight"], p["qzeros"], p["scales"]
        k = p["qweight"].shape[0] * (32 // self.config.bits)
        g_idx = p.get("g_idx")
        if g_idx is None:   # checkpoints without act-order may leave it out: groups in order
            g_idx = torch.arange(k, device=p["qweight"].device) // self._group(shard, local)
        return p["qweight"], p["qzeros"], p["scales"], g_idx

    def _group(self, shard: str, local: int) -> int:
        """Inputs per group of one projection (its scales' rows split its inputs evenly; --isq picks per tensor)."""
        p = self.parts[(shard, local)]
        k = p["qweight"].shape[0] if self.name == "awq" else p["qweight"].shape[0] * (32 // self.config.bits)
        return k // p["scales"].shape[0]

    def dense_expert(self, shard: str, local: int) -> torch.Tensor:
        if self.name == "awq":
            return dequantize_awq(*self._expert(shard, local), self._group(shard, local))
        return dequantize_gptq(*self._expert(shard, local), self.config.bits, self.config.zero_offset)

    def quantize_expert(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """``--isq gptq``: round-to-nearest as the dense layers get it (4 bits, groups of 128, 64 or 32)."""
        from cvllm_marlin.convert import gptq_tensors
        from cvllm_marlin.isq import BITS, GROUP_SIZES

        group = next((g for g in GROUP_SIZES if weight.shape[1] % g == 0), None)
        if group is None:
            raise ValueError(f"{self.where}: --isq gptq needs each expert projection's inputs (a tensor-parallel "
                             f"rank's part) in whole groups of 32; these have {weight.shape[1]}")
        return {key.removeprefix("e."): value for key, value in gptq_tensors("e", weight, BITS, group, True).items()}

    def expert_planes(self, layer: nn.Module):
        from cvllm_cuda.kernels.fused_moe_planes import stack_experts
        from cvllm_marlin.planes import awq_planes, gptq_planes

        stacked, perms = [], []
        for shard in SHARDS:
            experts, orders = [], []
            for local in range(layer.num_local_experts):
                where = f"{self.where} ({shard}, expert {local})"
                group = self._group(shard, local)
                if self.name == "awq":
                    planes = awq_planes(*self._expert(shard, local), group, where)
                else:
                    planes = gptq_planes(*self._expert(shard, local), self.config.bits, group,
                                         self.config.zero_offset, where=where)
                if planes is None:
                    return None
                experts.append(planes.weight)
                orders.append(planes.perm)
            stacked.append(stack_experts(experts))
            # act-order: each expert's planes hold its inputs sorted by group; the kernel gathers x in that order
            if all(order is None for order in orders):
                perms.append(None)
            else:
                k, device = experts[0].in_features, experts[0].low.device
                perms.append(torch.stack([torch.arange(k, device=device) if order is None else order
                                          for order in orders]).to(torch.int32))
        return (*stacked, perms)
