"""What a quantizer's MoE method shares when a checkpoint stores each expert's projections quantized (GPTQ / AWQ
groups, FP8 with scales): hold the tensors as they load, then give the layer its compute form.

``HeldExpertsMethod`` keeps each (projection, local expert)'s tensors as stored, on the layer's device; the layer's
``w13_weight`` / ``w2_weight`` are empty stand-ins until then. After loading: stacked low-bit planes
(``expert_planes``, core's PlanesMoEMethod computes from them) where the CUDA kernels run and the experts are whole
on this rank; otherwise each expert's float weight (``dense_expert``) in the engine's dtype, a tensor-parallel
rank's rows of gate and up and columns of down, for core's float experts.

``in_situ`` (``--isq``): the checkpoint's float experts load as usual (a rank's part of each), and
``quantize_expert`` turns each loaded projection into the held form after loading; the parts are then a rank's
already, so the planes may serve split experts too and the float form is not narrowed again.
"""

from __future__ import annotations

import torch
from torch import nn

from cvllm.checkpoint.lazy import materialize
from cvllm.layers.fused_moe_methods import PlanesMoEMethod
from cvllm.layers.quantization import plane_kernels_usable

SHARDS = ("w1", "w3", "w2")   # gate, up, down, each stored per expert
PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class HeldExpertsMethod(PlanesMoEMethod):
    needed: tuple[str, ...] = ()   # the parts every projection of every expert must have
    format_name = "quantized"

    def __init__(self, where: str, in_situ: bool = False):
        self.where = where            # the layer's module name, for messages
        self.in_situ = in_situ
        self.parts: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

    @property
    def keeps_fp8_experts(self) -> bool:
        """Whether the checkpoint's expert tensors come to this method as stored (core's FP8 dequantize-at-load pass,
        layers/fp8_experts.py, then leaves them alone): all but in situ, which takes float experts."""
        return not self.in_situ

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_local: int,
                       dtype: torch.dtype) -> None:
        self.dtype = dtype
        if self.in_situ:   # the float experts load as they would unquantized
            super().create_weights(layer, num_experts, hidden_size, intermediate_local, dtype)
            return
        # stand-ins the loader counts as loaded: the experts' compute form is made after loading
        for name in ("w13_weight", "w2_weight"):
            layer.register_parameter(name, nn.Parameter(torch.empty(num_experts, 0, dtype=dtype), requires_grad=False))

    def hold(self, layer: nn.Module, key: str, loaded: torch.Tensor, shard_id: str, expert_id: int | None) -> None:
        """Keep one stored tensor of an expert's projection (another rank's expert: dropped unread)."""
        if expert_id is None:
            raise ValueError(f"{self.format_name} experts stacked in one tensor are not supported (one per expert)")
        if not 0 <= expert_id < layer.num_experts:
            raise ValueError(f"expert {expert_id} out of range (the model has {layer.num_experts})")
        if shard_id not in SHARDS:
            raise ValueError(f"{self.format_name} experts: a fused gate_up projection is not supported")
        local = layer.placement.local_id(expert_id)
        if local is not None:
            self.parts.setdefault((shard_id, local), {})[key] = materialize(loaded).to(layer.w13_weight.device)

    def expert_planes(self, layer: nn.Module):
        """(gate, up, down) QuantWeights stacked over the local experts, optionally with a 4th item: the input
        orders of (gate, up, down), each None or int32 [E, K]; or None: the float experts instead."""
        return None

    def dense_expert(self, shard: str, local: int) -> torch.Tensor:
        """float32 [out, in]: one local expert's projection, whole (in situ: this rank's part)."""
        raise NotImplementedError

    def quantize_expert(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """In situ: one loaded float projection [out, in] as the parts ``needed`` names."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.in_situ:
            size = layer.intermediate_local
            for local in range(layer.num_local_experts):
                w13, w2 = layer.w13_weight.data[local], layer.w2_weight.data[local]
                for shard, weight in (("w1", w13[:size]), ("w3", w13[size:]), ("w2", w2)):
                    self.parts[(shard, local)] = self.quantize_expert(weight.float())
        for local in range(layer.num_local_experts):
            for shard in SHARDS:
                have = self.parts.get((shard, local), {})
                lacking = [part for part in self.needed if part not in have]
                if lacking:
                    raise ValueError(f"{self.where}.{local + layer.placement.start}.{PROJECTIONS[shard]}: the "
                                     f"checkpoint lacks {' and '.join(lacking)}")
        planes = None
        if (layer.shard_size == 1 or self.in_situ) and plane_kernels_usable(layer.w13_weight.device):
            planes = self.expert_planes(layer)
        if planes is not None:
            self.install_planes(layer, list(planes[:2]), planes[2], planes[3] if len(planes) > 3 else None)
        else:
            self._install_float(layer)
        self.parts.clear()

    def _install_float(self, layer: nn.Module) -> None:
        size = layer.intermediate_local
        offset = 0 if self.in_situ else layer.shard_rank * size   # in situ, the parts are this rank's already
        num, device = layer.num_local_experts, layer.w13_weight.device
        w13 = torch.empty(num, 2 * size, layer.hidden_size, dtype=self.dtype, device=device)
        w2 = torch.empty(num, layer.hidden_size, size, dtype=self.dtype, device=device)
        for e in range(num):
            w13[e, :size] = self.dense_expert("w1", e).narrow(0, offset, size).to(self.dtype)
            w13[e, size:] = self.dense_expert("w3", e).narrow(0, offset, size).to(self.dtype)
            w2[e] = self.dense_expert("w2", e).narrow(1, offset, size).to(self.dtype)
        for name, tensor in (("w13_weight", w13), ("w2_weight", w2)):
            del layer._parameters[name]
            layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
