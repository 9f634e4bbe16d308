"""How a ``FusedMoE`` layer stores and runs its experts: the method contract and the torch reference.

A method sees only this rank's experts: ``layer.num_local_experts`` of them (all ``E`` unless expert parallelism
splits them), with local ids; ``layer.placement.localize`` maps the router's global ids to those, and the pairs
routed to experts other ranks hold contribute nothing here (their rank adds them in the all-reduce).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from cvllm.forward_context import current_forward_context

if TYPE_CHECKING:
    from cvllm.layers.fused_moe import FusedMoE


class FusedMoEMethod:
    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int, intermediate_local: int,
                       dtype: torch.dtype) -> None:
        """``num_experts``: the experts this rank holds (``layer.num_local_experts``)."""
        raise NotImplementedError

    def load_weight(self, layer: FusedMoE, param: torch.Tensor, loaded: torch.Tensor, shard_id: str,
                    expert_id: int | None) -> bool:
        """Load a checkpoint tensor this method stores in its own form (GGUF blocks): True when done, False (the
        default) for the layer's float loader (FusedMoE.weight_loader's arguments)."""
        return False

    def load_expert_part(self, layer: FusedMoE, part: str, loaded: torch.Tensor, shard_id: str,
                         expert_id: int | None) -> None:
        """A quantized checkpoint's expert tensor other than a ``weight`` (``qweight``, ``scales``, ``qzeros``,
        ``g_idx``: GPTQ / AWQ), for the method that stores experts in that form."""
        raise ValueError(f"a quantized expert tensor ('{part}') that this layer's experts cannot load (the "
                         f"checkpoint's quantization has no MoE support, or its quantizer left this layer float)")

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        pass

    def apply(self, layer: FusedMoE, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """``topk_ids``: global expert ids. Returns this rank's partial sum (the layer all-reduces it)."""
        raise NotImplementedError


class UnquantizedFusedMoEMethod(FusedMoEMethod):
    """The torch reference. Two forms, the same numbers up to matmul rounding:

    - grouped: the (token, expert) pairs sorted by expert, one gate_up and one down matmul per busy expert.
      Least arithmetic, but it reads the per-expert counts back to the host to slice the groups.
    - padded: every local expert runs all T tokens (two batched matmuls over ``[E_local, T, H]``), and each
      (token, expert) pair picks its row out: a token picks an expert at most once, so the row of (t, e) is
      unique. No value is read back to the host, so a CUDA graph can capture it, at the price of E / k times
      the arithmetic of the grouped form: cheap for decode batches, where reading the weights is the cost.

    A decode-only forward on a backend with ``sync_free_decode`` (CUDA: graphs, async scheduling) takes the
    padded form; everything else the grouped one. A backend with ``fused_moe`` (CUDA's grouped GEMM over the pairs
    sorted by expert, cvllm_cuda/kernels/fused_moe.py) replaces both."""

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int, intermediate_local: int,
                       dtype: torch.dtype) -> None:
        layer.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_local, hidden_size, dtype=dtype),
                                        requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_local, dtype=dtype),
                                       requires_grad=False)

    def apply(self, layer: FusedMoE, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        ctx = current_forward_context()
        if ctx is not None and ctx.backend.fused_moe is not None:   # the backend's grouped GEMM (CUDA)
            return ctx.backend.fused_moe(hidden, layer.w13_weight, layer.w2_weight, topk_weights,
                                         layer.placement.localize(topk_ids))
        if ctx is not None and ctx.is_decode_only and ctx.backend.sync_free_decode:
            return experts_padded(layer, hidden, topk_weights, topk_ids)
        return experts_grouped(layer, hidden, topk_weights, topk_ids)


class PlanesMoEMethod(UnquantizedFusedMoEMethod):
    """Experts kept low-bit on CUDA: computes from stacked low-bit planes (cvllm_cuda/quant_planes.py, one
    QuantWeight per expert stacked: ``cvllm_cuda.kernels.fused_moe_planes.stack_experts``) once
    ``install_planes`` ran, with the float reference until then. The quantizers' expert methods (GGUF blocks, GPTQ
    and AWQ groups) end here after loading."""

    planes = None   # ([gate_up parts], down) stacked QuantWeights, on CUDA

    perms = None    # per part (gate_up's, then down): None, or int32 [E, K] input orders (GPTQ act-order)

    def install_planes(self, layer: FusedMoE, gate_up, down, perms=None) -> None:
        """Make the stacked planes the layer's compute form; the loaded forms (w13_weight, w2_weight) go.
        ``gate_up``: the [2I, H] rows in one stacked QuantWeight, or a list of parts in row order (gate, up);
        ``perms``: for each part and then down, None or the input order its planes hold ([E, K] int32)."""
        parts = list(gate_up) if isinstance(gate_up, (list, tuple)) else [gate_up]
        self.planes, self.perms = (parts, down), perms
        for i, perm in enumerate(perms or []):
            if perm is not None:
                layer.register_buffer(f"planes_perm_{i}", perm, persistent=False)
        named = [(f"w13_{i}" if len(parts) > 1 else "w13", part) for i, part in enumerate(parts)] + [("w2", down)]
        for prefix, planes in named:   # buffers: counted and listed like weights
            for name, tensor in planes.tensors().items():
                layer.register_buffer(f"{prefix}_planes_{name}", tensor, persistent=False)
        device = down.low.device
        for name in ("w13_weight", "w2_weight"):
            del layer._parameters[name]
            layer.register_buffer(name, torch.empty(0, device=device), persistent=False)

    def apply(self, layer: FusedMoE, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        if self.planes is None:
            return super().apply(layer, hidden, topk_weights, topk_ids)
        from cvllm_cuda.kernels.fused_moe_planes import fused_moe_planes

        gate_up_parts, down = self.planes
        return fused_moe_planes(hidden, gate_up_parts, down, topk_weights, layer.placement.localize(topk_ids),
                                layer.act_fn, self.perms)


def _combine(hidden: torch.Tensor, out: torch.Tensor, weights: torch.Tensor,
             token_of_pair: torch.Tensor) -> torch.Tensor:
    """Each pair's expert output times its routing weight, summed into its token's row."""
    # the routing weights are cast to the activations' dtype before the product, as transformers does
    out = out * weights.to(hidden.dtype).unsqueeze(-1)
    return torch.zeros_like(hidden).index_add_(0, token_of_pair, out)


def experts_grouped(layer: FusedMoE, hidden: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
    return grouped_experts(hidden, layer.w13_weight, layer.w2_weight, layer.act_fn, topk_weights,
                           layer.placement.localize(topk_ids))


def grouped_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act_fn: nn.Module,
                    topk_weights: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
    """The grouped form over experts ``w13 [E, 2I, H]`` / ``w2 [E, H, I]``; ``local_ids [T, k]`` index them (E: an
    expert held elsewhere, adding nothing)."""
    num_local = w13.shape[0]
    flat_ids = local_ids.reshape(-1)                                 # [T * k], token-major
    order = torch.argsort(flat_ids, stable=True)                     # by expert; others' pairs sort last
    # one host sync per layer, to size the per-expert slices; the last count is the pairs run elsewhere
    counts = torch.bincount(flat_ids, minlength=num_local + 1).tolist()[:num_local]
    order = order[:sum(counts)]                                      # only the pairs these experts run
    token_of_pair = order // local_ids.shape[1]
    grouped = hidden[token_of_pair]                                  # [pairs here, H]
    out = torch.empty_like(grouped)
    start = 0
    for expert, count in enumerate(counts):                          # experts, never tokens
        if count:
            rows = slice(start, start + count)
            gate_up = F.linear(grouped[rows], w13[expert])           # [n, 2 * I_local]
            out[rows] = F.linear(act_fn(gate_up), w2[expert])
            start += count
    return _combine(hidden, out, topk_weights.reshape(-1)[order], token_of_pair)


def run_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act_fn: nn.Module,
                topk_weights: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
    """``grouped_experts``, or the backend's fused kernel where it has one."""
    ctx = current_forward_context()
    if ctx is not None and ctx.backend.fused_moe is not None:
        return ctx.backend.fused_moe(hidden, w13, w2, topk_weights, local_ids)
    return grouped_experts(hidden, w13, w2, act_fn, topk_weights, local_ids)


def experts_padded(layer: FusedMoE, hidden: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> torch.Tensor:
    tokens, num_local = hidden.shape[0], layer.num_local_experts
    local_ids = layer.placement.localize(topk_ids).reshape(-1)       # [T * k]; num_local: another rank's expert
    here = local_ids < num_local
    token_of_pair = torch.arange(local_ids.shape[0], device=hidden.device) // topk_ids.shape[1]
    # [T, H] @ [E_local, H, 2I] broadcasts: every local expert on every token
    gate_up = torch.matmul(hidden, layer.w13_weight.transpose(1, 2))
    down = torch.matmul(layer.act_fn(gate_up), layer.w2_weight.transpose(1, 2))    # [E_local, T, H]
    # pair (t, e) reads row e * T + t; a pair run elsewhere reads a stand-in row that its zero weight drops, and
    # that row is zeroed too: an expert's output for a token not routed to it could be anything (inf in fp16)
    rows = down.reshape(num_local * tokens, -1)[local_ids.clamp(max=num_local - 1) * tokens + token_of_pair]
    rows = rows.masked_fill(~here.unsqueeze(-1), 0)
    weights = topk_weights.reshape(-1).masked_fill(~here, 0)
    return _combine(hidden, rows, weights, token_of_pair)
