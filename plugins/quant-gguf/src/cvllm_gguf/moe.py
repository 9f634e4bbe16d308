"""``--isq`` for MoE experts: each expert of a ``FusedMoE`` layer quantized to the requested GGML type after the
checkpoint's float experts have loaded.

On CUDA (the low-bit kernels usable) the experts become stacked low-bit planes (cvllm_gguf/planes.py, one per
expert, stacked) and the float copies are freed: cvllm_cuda.kernels.fused_moe_planes computes from them, a Q4_K
expert at ~0.56 bytes a weight. Elsewhere each expert is replaced by its quantized values dequantized (the numbers
the quantized model computes, float storage). Loading still holds the float experts first: the peak is the float
model's (the linear layers quantize shard by shard as they arrive; experts do not yet).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from cvllm.layers.fused_moe_methods import UnquantizedFusedMoEMethod
from cvllm.layers.quantization import plane_kernels_usable
from cvllm_gguf.dequant import dequantize
from cvllm_gguf.quant_types import GGMLType
from cvllm_gguf.quantize import quantize

logger = logging.getLogger(__name__)


class ISQFusedMoEMethod(UnquantizedFusedMoEMethod):
    def __init__(self, requested: GGMLType, layer_type):
        """``layer_type(requested, in_features)``: the type a weight of that many inputs gets (isq.py)."""
        self.requested, self.layer_type = requested, layer_type
        self.planes = None   # (gate_up, down) QuantWeights stacked over the experts, on CUDA

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        types = self.layer_type(self.requested, w13.shape[2]), self.layer_type(self.requested, w2.shape[2])
        if None in types:
            logger.info("isq: MoE experts of %d / %d inputs fit no block: left unquantized", w13.shape[2],
                        w2.shape[2])
            return
        blocks = [[quantize(w[e].float(), qtype) for e in range(w.shape[0])] for w, qtype in zip((w13, w2), types)]
        if plane_kernels_usable(w13.device):
            from cvllm_cuda.kernels.fused_moe_planes import stack_experts
            from cvllm_gguf.planes import to_planes

            self.planes = tuple(stack_experts([to_planes(b, qtype, w.shape[2]) for b in expert_blocks])
                                for expert_blocks, qtype, w in zip(blocks, types, (w13, w2)))
            for prefix, planes in zip(("w13", "w2"), self.planes):   # buffers: counted and listed like weights
                for name, tensor in planes.tensors().items():
                    layer.register_buffer(f"{prefix}_planes_{name}", tensor, persistent=False)
            for name in ("w13_weight", "w2_weight"):   # the float experts go
                del layer._parameters[name]
                layer.register_buffer(name, torch.empty(0, device=w13.device), persistent=False)
            return
        for w, expert_blocks, qtype in zip((w13, w2), blocks, types):
            for e, raw in enumerate(expert_blocks):
                w[e].copy_(dequantize(raw.cpu(), qtype, w[e].shape).to(w.dtype))

    def apply(self, layer: nn.Module, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        if self.planes is None:
            return super().apply(layer, hidden, topk_weights, topk_ids)
        from cvllm_cuda.kernels.fused_moe_planes import fused_moe_planes

        gate_up, down = self.planes
        return fused_moe_planes(hidden, [gate_up], down, topk_weights, layer.placement.localize(topk_ids),
                                layer.act_fn)
