"""Expert offload (``--num-experts-offload-per-rank K``, candle-vllm's flag): K experts of every MoE layer live in
host memory (pinned where there is a GPU) and are copied to the device when a step routes tokens to them.

For a model whose experts do not all fit the device: the device holds the other experts of each layer plus one
layer's staging area of K expert slots, shared by every layer (layers run one after another), so it saves
``(layers - 1) x K`` experts' bytes.

Per MoE layer and step: the resident experts run as usual (their pairs; the others' marked "elsewhere"); the
routed host experts are read back to the host as a list (one host sync), copied into the staging slots, and run
the same way; the two partial sums add up. Cost: the copies (an expert's bytes over PCIe each time it is routed,
e.g. ~9 MB for a Qwen3-30B-A3B expert in bf16, ~0.4 ms at 25 GB/s) and the sync, which CUDA graphs cannot
capture: with offload the engine runs eagerly. The copies are not overlapped with compute yet. Tokens are those of
the model without offload (the same products, the two parts added in another order).

Unquantized experts (``UnquantizedFusedMoEMethod``) only.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from cvllm.layers.fused_moe import FusedMoE
from cvllm.layers.fused_moe_methods import FusedMoEMethod, UnquantizedFusedMoEMethod, run_experts

logger = logging.getLogger(__name__)


class _Staging:
    """The device slots host experts are copied into, shared by every offloaded layer of a model."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None

    def slots(self, like13: torch.Tensor, like2: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape13, shape2 = (count, *like13.shape[1:]), (count, *like2.shape[1:])
        if self.w13 is None or self.w13.shape[0] < count or self.w13.shape[1:] != shape13[1:]:
            self.w13 = torch.empty(shape13, dtype=like13.dtype, device=self.device)
            self.w2 = torch.empty(shape2, dtype=like2.dtype, device=self.device)
        return self.w13[:count], self.w2[:count]


class OffloadedFusedMoEMethod(FusedMoEMethod):
    """The layer's first ``resident`` local experts on the device (``w13_weight`` / ``w2_weight``), the rest in
    ``host13`` / ``host2``."""

    def __init__(self, resident: int, host13: torch.Tensor, host2: torch.Tensor, staging: _Staging):
        self.resident, self.host13, self.host2, self.staging = resident, host13, host2, staging

    def apply(self, layer: FusedMoE, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        local = layer.placement.localize(topk_ids)
        resident, num_local = self.resident, layer.num_local_experts
        out = run_experts(hidden, layer.w13_weight, layer.w2_weight, layer.act_fn, topk_weights,
                          torch.where(local < resident, local, resident))
        on_host = (local >= resident) & (local < num_local)
        needed = torch.unique(local[on_host]).tolist()   # the host sync: which host experts this step needs
        if not needed:
            return out
        w13, w2 = self.staging.slots(self.host13, self.host2, len(needed))
        for slot, expert in enumerate(needed):
            w13[slot].copy_(self.host13[expert - resident], non_blocking=True)
            w2[slot].copy_(self.host2[expert - resident], non_blocking=True)
        slot_of = torch.full((num_local + 1,), len(needed), dtype=local.dtype, device=local.device)
        slot_of[torch.tensor(needed, device=local.device)] = torch.arange(len(needed), device=local.device)
        slots = torch.where(on_host, slot_of[local.clamp(max=num_local)], len(needed))
        return out + run_experts(hidden, w13, w2, layer.act_fn, topk_weights, slots)


def offload_experts(model: nn.Module, per_layer: int, device: torch.device) -> int:
    """Move the last ``per_layer`` local experts of every MoE layer of ``model`` to host memory; returns the
    device bytes freed (less the staging area)."""
    if per_layer <= 0:
        return 0
    staging = _Staging(device)
    freed, layers = 0, 0
    pin = device.type == "cuda"
    for name, layer in model.named_modules():
        if not isinstance(layer, FusedMoE):
            continue
        if type(layer.quant_method) is not UnquantizedFusedMoEMethod:
            raise NotImplementedError(f"{name}: expert offload takes unquantized experts only, not "
                                      f"{type(layer.quant_method).__name__}")
        count = min(per_layer, layer.num_local_experts)
        resident = layer.num_local_experts - count
        host13, host2 = (w.data[resident:].to("cpu", copy=True) for w in (layer.w13_weight, layer.w2_weight))
        if pin:
            host13, host2 = host13.pin_memory(), host2.pin_memory()
        freed += host13.nbytes + host2.nbytes
        # new tensors of the resident experts only: the old ones (and their device memory) go
        layer.w13_weight = nn.Parameter(layer.w13_weight.data[:resident].clone(), requires_grad=False)
        layer.w2_weight = nn.Parameter(layer.w2_weight.data[:resident].clone(), requires_grad=False)
        layer.quant_method = OffloadedFusedMoEMethod(resident, host13, host2, staging)   # weights already in place
        layers += 1
        staging_bytes = host13[0].nbytes * count + host2[0].nbytes * count
    if layers:
        freed -= staging_bytes
        logger.info("expert offload: %d experts of each of %d MoE layers in host memory (%.2f GB off the device, "
                    "net of one layer's staging slots); decode steps run without CUDA graphs", per_layer, layers,
                    freed / 1e9)
    return freed
