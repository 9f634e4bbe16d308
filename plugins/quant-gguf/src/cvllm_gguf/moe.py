"""Quantized MoE experts: GGUF files' experts kept in their blocks, and ``--isq`` for experts.

On CUDA (the low-bit kernels usable) a layer's experts end as stacked low-bit planes (cvllm_gguf/planes.py, one
per expert, stacked) and cvllm_cuda.kernels.fused_moe_planes computes from them: a Q4_K expert at ~0.56 bytes a
weight, so a Qwen3-30B-A3B Q4_K_M file takes about its own size on the GPU instead of its bf16 57 GB. Elsewhere
the experts are float tensors computed by core's torch code.

- ``GGUFExpertsMethod``: the file's stacked ``ffn_*_exps`` blocks load as they are (uint8 ``w13_weight``
  [E, 2I, row bytes] and ``w2_weight``), then become planes, or (CPU, no kernels) are dequantized to the engine's
  dtype expert by expert, the numbers of the file either way.
- ``ISQFusedMoEMethod``: each expert quantized to the requested type after the checkpoint's float experts have
  loaded (the peak is the float model's: the linear layers quantize shard by shard as they arrive, experts do not).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from cvllm.checkpoint.lazy import materialize
from cvllm.layers.fused_moe_methods import PlanesMoEMethod
from cvllm.layers.quantization import plane_kernels_usable
from cvllm_gguf.dequant import dequantize
from cvllm_gguf.planes import has_layout
from cvllm_gguf.quant_types import GGMLType, row_bytes
from cvllm_gguf.quantize import quantize

logger = logging.getLogger(__name__)


class BlockPlanesMoEMethod(PlanesMoEMethod):
    """Core's planes method, fed from GGML blocks."""

    def install_block_planes(self, layer: nn.Module, blocks: tuple, types: tuple, in_features: tuple) -> None:
        """``blocks``: per weight (w13, w2), a list of each expert's uint8 [rows, row bytes] blocks."""
        from cvllm_cuda.kernels.fused_moe_planes import stack_experts
        from cvllm_gguf.planes import to_planes

        gate_up, down = (stack_experts([to_planes(b, qtype, width) for b in expert_blocks])
                         for expert_blocks, qtype, width in zip(blocks, types, in_features))
        self.install_planes(layer, gate_up, down)


class GGUFExpertsMethod(BlockPlanesMoEMethod):
    def __init__(self, gate_up_type: GGMLType, down_type: GGMLType):
        self.types = (gate_up_type, down_type)

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_local: int,
                       dtype: torch.dtype) -> None:
        # whole rows of blocks: the experts are not split on the intermediate dimension (world size 1, or expert
        # parallelism; gguf_linear_methods checks)
        self.dtype, self.in_features = dtype, (hidden_size, intermediate_local)
        shapes = ((2 * intermediate_local, hidden_size), (hidden_size, intermediate_local))
        for name, qtype, (rows, width) in zip(("w13_weight", "w2_weight"), self.types, shapes):
            blocks = torch.empty(num_experts, rows, row_bytes(qtype, width), dtype=torch.uint8)
            layer.register_parameter(name, nn.Parameter(blocks, requires_grad=False))

    def load_weight(self, layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor, shard_id: str,
                    expert_id: int | None) -> bool:
        if expert_id is None:   # stacked: this rank's experts
            loaded, target = loaded.narrow(0, layer.placement.start, layer.num_local_experts), param.data
        else:
            local = layer.placement.local_id(expert_id)
            if local is None:
                return True
            target = param.data[local]
        if shard_id in ("w1", "w3"):
            rows = target.shape[-2] // 2
            target = target.narrow(-2, 0 if shard_id == "w1" else rows, rows)
        elif shard_id != "w2":
            raise ValueError(f"GGUF experts: unexpected expert shard '{shard_id}'")
        if tuple(loaded.shape) != tuple(target.shape) or loaded.dtype != torch.uint8:
            raise ValueError(f"{shard_id}: GGUF expert blocks {tuple(loaded.shape)} {loaded.dtype}, expected uint8 "
                             f"{tuple(target.shape)}")
        target.copy_(materialize(loaded))
        return True

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        if plane_kernels_usable(w13.device) and all(has_layout(t) for t in self.types):
            self.install_block_planes(layer, (list(w13), list(w2)), self.types, self.in_features)
            return
        # no low-bit kernels here: each expert dequantized (float32 one expert at a time), then the blocks go
        for name, blocks, qtype, width in zip(("w13_weight", "w2_weight"), (w13, w2), self.types, self.in_features):
            values = torch.empty(*blocks.shape[:2], width, dtype=self.dtype, device=blocks.device)
            for e in range(blocks.shape[0]):
                values[e] = dequantize(blocks[e].cpu(), qtype, values[e].shape).to(values.dtype)
            layer.register_parameter(name, nn.Parameter(values, requires_grad=False))


class ISQFusedMoEMethod(BlockPlanesMoEMethod):
    def __init__(self, requested: GGMLType, layer_type):
        """``layer_type(requested, in_features)``: the type a weight of that many inputs gets (isq.py)."""
        self.requested, self.layer_type = requested, layer_type

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        types = self.layer_type(self.requested, w13.shape[2]), self.layer_type(self.requested, w2.shape[2])
        if None in types:
            logger.info("isq: MoE experts of %d / %d inputs fit no block: left unquantized", w13.shape[2],
                        w2.shape[2])
            return
        blocks = [[quantize(w[e].float(), qtype) for e in range(w.shape[0])] for w, qtype in zip((w13, w2), types)]
        if plane_kernels_usable(w13.device):
            self.install_block_planes(layer, blocks, types, (w13.shape[2], w2.shape[2]))
            return
        for w, expert_blocks, qtype in zip((w13, w2), blocks, types):
            for e, raw in enumerate(expert_blocks):
                w[e].copy_(dequantize(raw.cpu(), qtype, w[e].shape).to(w.dtype))
