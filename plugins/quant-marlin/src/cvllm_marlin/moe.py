"""GPTQ and AWQ checkpoints' MoE experts (Qwen3-30B-A3B-GPTQ-Int4, Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4 ...).

The checkpoint holds each expert's projections as ``experts.<e>.{gate,up,down}_proj.{qweight,qzeros,scales,g_idx}``.
``PackedExpertsMethod`` takes them as they are (``load_expert_part``: moved to the layer's device, nothing
unpacked), and after loading gives the layer its compute form:

- on CUDA with the low-bit kernels, each expert's gate, up and down groups repacked losslessly into low-bit planes
  (planes.py: GPTQ's qweight already is one) and stacked over the experts: core's PlanesMoEMethod computes from
  them with the fused-MoE planes kernel, so the experts stay at about the checkpoint's size on the GPU;
- elsewhere (CPU; experts split over tensor-parallel ranks; act-order whose groups need a permutation; shapes the
  planes cannot hold) each expert dequantized (packing.py, bit for bit the dense layers' numbers) into the float
  ``w13_weight`` / ``w2_weight`` of the engine's dtype, each rank its part, computed by core's float code.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from cvllm.checkpoint.lazy import materialize
from cvllm.layers.fused_moe_methods import PlanesMoEMethod
from cvllm.layers.quantization import plane_kernels_usable
from cvllm_marlin.packing import dequantize_awq, dequantize_gptq

logger = logging.getLogger(__name__)

_logged: list[str] = []
SHARDS = ("w1", "w3", "w2")   # gate, up, down: GPTQ and AWQ checkpoints store them separately
PARTS = {"gptq": ("qweight", "qzeros", "scales"), "awq": ("qweight", "qzeros", "scales")}


class PackedExpertsMethod(PlanesMoEMethod):
    def __init__(self, name: str, config, where: str):
        """``name``: "gptq" or "awq"; ``config``: its parsed quantization_config; ``where``: the layer's name."""
        self.name, self.config, self.where = name, config, where
        self.parts: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_local: int,
                       dtype: torch.dtype) -> None:
        # stand-ins the loader counts as loaded: the experts' compute form is made after loading
        self.dtype = dtype
        for name in ("w13_weight", "w2_weight"):
            layer.register_parameter(name, nn.Parameter(torch.empty(num_experts, 0, dtype=dtype), requires_grad=False))

    def load_weight(self, layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor, shard_id: str,
                    expert_id: int | None) -> bool:
        raise ValueError(f"a float expert weight in a layer whose experts this {self.name.upper()} checkpoint "
                         f"quantizes")

    def load_expert_part(self, layer: nn.Module, part: str, loaded: torch.Tensor, shard_id: str,
                         expert_id: int | None) -> None:
        if expert_id is None:
            raise ValueError(f"{self.name.upper()} experts stacked in one tensor are not supported (one per expert)")
        if not 0 <= expert_id < layer.num_experts:
            raise ValueError(f"expert {expert_id} out of range (the model has {layer.num_experts})")
        if shard_id not in SHARDS:
            raise ValueError(f"{self.name.upper()} experts: a fused gate_up projection is not supported")
        local = layer.placement.local_id(expert_id)
        if local is None:   # another rank's expert (expert parallelism)
            return
        self.parts.setdefault((shard_id, local), {})[part] = materialize(loaded).to(layer.w13_weight.device)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        needed = PARTS[self.name]
        for local in range(layer.num_local_experts):
            for shard in SHARDS:
                have = self.parts.get((shard, local), {})
                if any(part not in have for part in needed):
                    expert = local + layer.placement.start
                    proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}[shard]
                    raise ValueError(f"{self.where}.{expert}.{proj}: the checkpoint lacks "
                                     f"{', '.join(p for p in needed if p not in have)}")
        device = layer.w13_weight.device
        if layer.shard_size == 1 and plane_kernels_usable(device):
            planes = self._planes(layer)
            if planes is not None:
                self.install_planes(layer, planes[:2], planes[2])
                self.parts.clear()
                return
        self._dequantize(layer)
        self.parts.clear()

    def _expert(self, shard: str, local: int) -> tuple[torch.Tensor, ...]:
        p = self.parts[(shard, local)]
        if self.name == "awq":
            return p["qweight"], p["qzeros"], p["scales"]
        k = p["qweight"].shape[0] * (32 // self.config.bits)
        g_idx = p.get("g_idx")
        if g_idx is None:   # checkpoints without act-order may leave it out: groups in order
            group = k if self.config.group_size == -1 else self.config.group_size
            g_idx = torch.arange(k, device=p["qweight"].device) // group
        return p["qweight"], p["qzeros"], p["scales"], g_idx

    def _dense(self, shard: str, local: int) -> torch.Tensor:
        """float32 [out, in] of one expert's projection."""
        if self.name == "awq":
            return dequantize_awq(*self._expert(shard, local), self.config.group_size)
        return dequantize_gptq(*self._expert(shard, local), self.config.bits, self.config.zero_offset)

    def _dequantize(self, layer: nn.Module) -> None:
        """The float experts of the engine's dtype, this rank's rows of gate and up and columns of down."""
        size, offset = layer.intermediate_local, layer.shard_rank * layer.intermediate_local
        num, device = layer.num_local_experts, layer.w13_weight.device
        w13 = torch.empty(num, 2 * size, layer.hidden_size, dtype=self.dtype, device=device)
        w2 = torch.empty(num, layer.hidden_size, size, dtype=self.dtype, device=device)
        for e in range(num):
            w13[e, :size] = self._dense("w1", e).narrow(0, offset, size).to(self.dtype)
            w13[e, size:] = self._dense("w3", e).narrow(0, offset, size).to(self.dtype)
            w2[e] = self._dense("w2", e).narrow(1, offset, size).to(self.dtype)
        for name, tensor in (("w13_weight", w13), ("w2_weight", w2)):
            del layer._parameters[name]
            layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))

    def _planes(self, layer: nn.Module):
        """(gate, up, down) QuantWeights stacked over the experts, or None (logged) where the planes cannot hold
        them as they are: the experts then load dequantized."""
        from cvllm_cuda.kernels.fused_moe_planes import stack_experts
        from cvllm_marlin.planes import awq_planes, gptq_planes

        stacked = []
        for shard in SHARDS:
            experts = []
            for local in range(layer.num_local_experts):
                where = f"{self.where} ({shard}, expert {local})"
                if self.name == "awq":
                    planes = awq_planes(*self._expert(shard, local), self.config.group_size, where)
                else:
                    planes = gptq_planes(*self._expert(shard, local), self.config.bits, self.config.group_size,
                                         self.config.zero_offset, where=where)
                if planes is None:
                    return None
                if planes.perm is not None:   # act-order: the fused-MoE kernel reads x in the checkpoint's order
                    if not _logged:
                        _logged.append(self.where)
                        logger.info("%s (and later layers alike): act-order experts load dequantized (the MoE "
                                    "planes kernel takes the inputs in order)", self.where)
                    return None
                experts.append(planes.weight)
            stacked.append(stack_experts(experts))
        return tuple(stacked)
