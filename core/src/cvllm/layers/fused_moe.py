"""Mixture-of-experts layer: route each token to its top-k experts, run them, sum the weighted outputs.

Three pieces, so that faster kernels and other parallel layouts plug in without model changes:

- the routing (``moe_routing.TopkRouting``): softmax over the router logits in fp32, top-k, optional
  renormalisation of the k weights (Hugging Face's Qwen2/3-MoE, Mixtral); DeepSeek's rules call
  ``forward_routed`` with their own.
- a ``FusedMoEMethod`` (``fused_moe_methods.py``, like the linear methods of ``quantization.py``) that creates
  the expert weights and applies them: ``apply(layer, hidden, topk_weights, topk_ids)``. The reference method
  groups the (token, expert) pairs by expert and runs one matmul pair per expert that has tokens; a backend or
  a quantizer supplies a fused kernel (one grouped GEMM, quantized experts) as another method.
- ``FusedMoE``, the layer: weights ``w13_weight [E_local, 2 * I_local, H]`` (gate rows, then up rows) and
  ``w2_weight [E_local, H, I_local]``.

Two layouts over N tensor-parallel ranks, each ending in one all-reduce of the layer's output (so a MoE block
costs the one all-reduce a dense MLP's row-parallel layer does):

- tensor parallel (the default): every rank holds all E experts, each sharded on the intermediate dimension
  as MergedColumnParallelLinear / RowParallelLinear do (``I_local = I / N``); the partial sums are all-reduced.
- expert parallel (``enable_expert_parallel``; ``expert_parallel.py``): rank r holds experts
  [r * E / N, (r + 1) * E / N) whole (``E_local = E / N``, ``I_local = I``; E must divide by N). The loader
  skips the other experts' tensors; routing stays global (the router is replicated); every rank has every token
  (activations are replicated here), runs its experts on the pairs routed to them and adds nothing for the rest,
  and the all-reduce sums the ranks' parts. No all-to-all dispatch: it would pay off only once activations are
  split over ranks (data parallel attention), which this engine does not do.

Attention, dense MLPs and shared experts (Qwen2-MoE's ``shared_expert``, an ordinary MLP) stay tensor-parallel
either way. Models keep calling ``FusedMoE(hidden, router_logits)``.

Checkpoint forms ``load_weights_with_experts`` accepts (``<prefix>`` is the layer's module name, e.g.
``model.layers.3.mlp.experts``): per-expert 2-D tensors ``<prefix>.{e}.gate_proj/up_proj/down_proj.weight``
(what transformers' ``save_pretrained`` writes), stacked 3-D tensors ``<prefix>.gate_proj/up_proj/down_proj``
``[E, out, in]`` (GGUF files), and transformers' in-memory fused form ``<prefix>.gate_up_proj [E, 2I, H]`` /
``<prefix>.down_proj [E, H, I]`` (``save_pretrained(save_original_format=False)``), with or without ``.weight``.
With expert parallelism a stacked or fused tensor is sliced to this rank's experts and another rank's per-expert
tensor is skipped unread; GGUF's quantized experts, dequantized at load into the stacked form, take the same path,
and so do FP8 checkpoints' per-expert e4m3 weights, each dequantized with its scale tensor (``fp8_experts.py``).
A GPTQ or AWQ checkpoint's per-expert ``qweight`` / ``qzeros`` / ``scales`` / ``g_idx``, and an FP8 checkpoint's
e4m3 weights and scales where its quantizer keeps experts FP8, go to the layer's method (``load_weight``,
``load_expert_part``; held_experts.py, cvllm_marlin/moe.py, cvllm_fp8/moe.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from cvllm.checkpoint.base import CheckpointError
from cvllm.checkpoint.lazy import materialize
from cvllm.distributed import all_reduce, divide, expert_parallel, tp_rank, tp_size
from cvllm.layers.activation import SiluAndMul
from cvllm.layers.expert_parallel import ExpertPlacement
from cvllm.layers.fp8_experts import FP8_DTYPES, with_fp8_experts_dequantized
from cvllm.layers.fused_moe_methods import FusedMoEMethod, UnquantizedFusedMoEMethod
from cvllm.layers.moe_routing import TopkRouting, route_topk
from cvllm.weight_loading import load_weights_by_name


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, E]`` logits -> (``[T, k]`` fp32 weights, ``[T, k]`` int64 expert ids), best expert first: softmax,
    top-k (the torch reference of layers/moe_routing.py)."""
    return route_topk(router_logits, None, TopkRouting(top_k, renormalize=renormalize))


_ACTIVATIONS = {"silu": SiluAndMul}

# checkpoint shard names -> which weight and which part of it; "w13" is transformers' fused gate_up
_PROJ_SHARDS = {"gate_proj": "w1", "up_proj": "w3", "gate_up_proj": "w13", "down_proj": "w2"}


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool = False, reduce_results: bool = True, activation: str = "silu",
                 method: FusedMoEMethod | None = None):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"unsupported MoE activation '{activation}' (supported: {', '.join(_ACTIVATIONS)})")
        self.num_experts, self.top_k = num_experts, top_k
        self.routing = TopkRouting(top_k, renormalize=renormalize)
        self.hidden_size, self.reduce_results = hidden_size, reduce_results
        rank, self.tp_size = tp_rank(), tp_size()   # tp_size: both layouts end in an all-reduce over the ranks
        if expert_parallel() and self.tp_size > 1:
            # whole experts, a 1 / N share of them: the intermediate dimension is not split
            self.placement = ExpertPlacement(num_experts, rank, self.tp_size)
            self.shard_rank, self.shard_size = 0, 1
        else:
            # every expert, each split on the intermediate dimension
            self.placement = ExpertPlacement(num_experts)
            self.shard_rank, self.shard_size = rank, self.tp_size
        self.num_local_experts = self.placement.num_local
        self.intermediate_size = intermediate_size
        self.intermediate_local = divide(intermediate_size, self.shard_size)
        self.act_fn = _ACTIVATIONS[activation]()
        self.params_dtype = torch.get_default_dtype()
        # Debugging and tests: ``enable_expert_counts()`` makes every forward add the bincount of the chosen
        # expert ids here (on the device: no host sync, nothing counted per token in Python).
        self.expert_counts: torch.Tensor | None = None
        self.set_moe_method(method or UnquantizedFusedMoEMethod())

    def set_moe_method(self, method: FusedMoEMethod) -> None:
        """Store and apply the expert weights another way (before the model is materialised)."""
        for name in list(self._parameters):
            delattr(self, name)
        self.quant_method = method  # the linear layers' name, so build_model runs process_weights_after_loading
        method.create_weights(self, self.num_local_experts, self.hidden_size, self.intermediate_local,
                              self.params_dtype)

    def enable_expert_counts(self) -> None:
        self.expert_counts = torch.zeros(self.num_experts, dtype=torch.int64, device=self.w13_weight.device)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return self.forward_routed(hidden, *self.routing(router_logits))

    def forward_routed(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts' weighted sum for a routing the model chose itself (``[T, k]`` fp32 weights and int64 ids:
        DeepSeek's grouped routing)."""
        if self.expert_counts is not None:
            # scatter_add, not bincount: bincount sizes its output from the largest id, a host sync on CUDA
            flat_ids = topk_ids.reshape(-1)
            self.expert_counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
        out = self.quant_method.apply(self, hidden, topk_weights, topk_ids)
        return all_reduce(out) if self.reduce_results and self.tp_size > 1 else out

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str,
                      expert_id: int | None = None) -> None:
        """Copy one checkpoint tensor into ``param``. ``shard_id``: "w1" (gate), "w3" (up), "w13" (gate rows
        then up rows), "w2" (down). ``expert_id`` (global) None: ``loaded`` holds all experts stacked on dim 0.
        Experts another rank holds (expert parallelism) are skipped, stacked ones sliced to this rank's."""
        if self.quant_method.load_weight(self, param, loaded, shard_id, expert_id):
            return
        want_dims = 3 if expert_id is None else 2
        if loaded.dim() != want_dims:
            raise ValueError(f"expected a {want_dims}-D tensor, got shape {tuple(loaded.shape)}")
        if expert_id is None and loaded.shape[0] != self.num_experts:
            raise ValueError(f"{loaded.shape[0]} experts stacked, the model has {self.num_experts}")
        if expert_id is not None and not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert {expert_id} out of range (the model has {self.num_experts})")
        experts = slice(None) if expert_id is None else self.placement.local_id(expert_id)
        if experts is None:   # another rank's expert: nothing of it is read here
            return
        if loaded.dtype in FP8_DTYPES and param.dtype != loaded.dtype:
            # cast to the engine's dtype without its scales the values would be wrong: per-expert weights come
            # dequantized (fp8_experts.py); a stacked FP8 tensor has no scale format to go by
            raise ValueError("stacked FP8 expert weights are not supported (their scales would be dropped)")
        if shard_id == "w13":
            gate, up = loaded.chunk(2, dim=-2)
            self.weight_loader(param, gate, "w1", expert_id)
            self.weight_loader(param, up, "w3", expert_id)
            return
        full = (self.hidden_size, self.intermediate_size) if shard_id == "w2" else (self.intermediate_size,
                                                                                    self.hidden_size)
        if tuple(loaded.shape[-2:]) != full:  # checked before narrowing: a slice of a wrong shape could fit
            raise ValueError(f"{shard_id}: checkpoint shape {tuple(loaded.shape)}, expected {full} per expert")
        if expert_id is None:   # stacked: this rank's experts (all of them unless expert-parallel)
            loaded = loaded.narrow(0, self.placement.start, self.num_local_experts)
        size, offset = self.intermediate_local, self.shard_rank * self.intermediate_local
        if shard_id == "w2":  # row-parallel: this rank's columns of the intermediate dimension
            part, target = loaded.narrow(-1, offset, size), param.data[experts]
        elif shard_id in ("w1", "w3"):  # column-parallel: this rank's rows, into the gate or the up half
            part = loaded.narrow(-2, offset, size)
            target = param.data[experts].narrow(-2, 0 if shard_id == "w1" else size, size)
        else:
            raise ValueError(f"unknown expert shard '{shard_id}'")
        target.copy_(materialize(part))   # a lazy checkpoint tensor (checkpoint/lazy.py): only this rank's part read


# "<module>.experts[.<e>].<proj>[.weight]", or a quantized checkpoint's other parts of an expert's projection
_EXPERT_TENSOR = re.compile(r"^(?P<module>.+\.experts)\.(?:(?P<expert>\d+)\.)?"
                            r"(?P<proj>gate_up_proj|gate_proj|up_proj|down_proj)"
                            r"(?:\.(?P<part>weight|qweight|qzeros|scales|g_idx|weight_scale_inv|weight_scale|"
                            r"input_scale))?$")


def load_weights_with_experts(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                              packed_modules_mapping: dict[str, tuple[str, object]] | None = None) -> set[str]:
    """``load_weights_by_name`` for a model with ``FusedMoE`` layers: expert tensors (any form in the module
    docstring) go to their layer, everything else loads by name. Returns the fully loaded parameter names;
    an expert weight counts once every part of every expert this rank holds has arrived (with expert parallelism
    the other ranks' experts are not needed here, so a reader may leave them out)."""
    layers = {name: module for name, module in model.named_modules() if isinstance(module, FusedMoE)}
    # parameter name -> [E_local, parts] coverage; w13 has two parts (gate, up), w2 one
    coverage: dict[str, torch.Tensor] = {}

    def non_expert_tensors(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in items:
            match = _EXPERT_TENSOR.match(name)
            layer = layers.get(match["module"]) if match else None
            if layer is None:
                yield name, tensor
                continue
            shard = _PROJ_SHARDS[match["proj"]]
            attr = "w2_weight" if shard == "w2" else "w13_weight"
            param_name = f"{match['module']}.{attr}"
            expert = None if match["expert"] is None else int(match["expert"])
            try:
                if match["part"] in (None, "weight"):
                    layer.weight_loader(getattr(layer, attr), tensor, shard, expert)
                else:   # GPTQ / AWQ experts: the layer's method keeps them in their own form
                    layer.quant_method.load_expert_part(layer, match["part"], tensor, shard, expert)
            except (ValueError, RuntimeError) as e:
                raise CheckpointError(f"cannot load '{name}' into '{param_name}': {e}", tensor=name) from None
            local = slice(None) if expert is None else layer.placement.local_id(expert)
            if local is None:   # another rank's expert: the loader skipped it
                continue
            seen = coverage.setdefault(param_name, torch.zeros(layer.num_local_experts, 1 if shard == "w2" else 2,
                                                               dtype=torch.bool))
            parts = {"w1": [0], "w3": [1], "w13": [0, 1], "w2": [0]}[shard]
            seen[local, parts] = True

    def expert_here(name: str) -> bool | None:
        """None: not a per-expert weight of a layer whose FP8 experts core dequantizes at load (a layer whose
        method keeps them FP8 takes them itself); else whether this rank holds that expert."""
        match = _EXPERT_TENSOR.match(name)
        if match is None or match["module"] not in layers or match["expert"] is None:
            return None
        if getattr(layers[match["module"]].quant_method, "keeps_fp8_experts", False):
            return None
        return layers[match["module"]].placement.local_id(int(match["expert"])) is not None

    # FP8 MoE checkpoints: each e4m3 expert weight dequantized with its scale tensor (layers/fp8_experts.py)
    weights = with_fp8_experts_dequantized(weights, expert_here) if layers else weights
    loaded = load_weights_by_name(model, non_expert_tensors(weights), packed_modules_mapping)
    return loaded | {name for name, seen in coverage.items() if bool(seen.all())}
