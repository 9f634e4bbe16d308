"""Mixture-of-experts layer: route each token to its top-k experts, run them, sum the weighted outputs.

Three pieces, so that faster kernels and other parallel layouts plug in without model changes:

- ``select_experts(router_logits, top_k, renormalize)``: softmax over the router logits in fp32, top-k,
  optional renormalisation of the k weights (Hugging Face's Qwen2/3-MoE, Mixtral routing).
- a ``FusedMoEMethod`` (like the linear methods of ``quantization.py``) that creates the expert weights
  and applies them: ``apply(layer, hidden, topk_weights, topk_ids)``. The reference method groups the
  (token, expert) pairs by expert and runs one matmul pair per expert that has tokens; a backend or a
  quantizer supplies a fused kernel (one grouped GEMM, quantized experts) as another method.
- ``FusedMoE``, the layer: weights ``w13_weight [E, 2 * I_local, H]`` (gate rows, then up rows) and
  ``w2_weight [E, H, I_local]``. Tensor parallelism splits the intermediate dimension as
  MergedColumnParallelLinear / RowParallelLinear do; the partial sums are all-reduced.

Expert parallelism (not built yet) would change only this module: each rank would own ``E / ep`` whole
experts (an ``expert_map`` from global to local ids, -1 for experts held elsewhere), the weight loader would
skip experts it does not own, and ``apply`` would dispatch each token's hidden state to the ranks owning its
experts (all-to-all, or all-gather and mask), run the local experts and combine the results back
(all-to-all or reduce). Routing still sees global expert ids, so models keep calling ``FusedMoE(hidden,
router_logits)``.

Checkpoint forms ``load_weights_with_experts`` accepts (``<prefix>`` is the layer's module name, e.g.
``model.layers.3.mlp.experts``): per-expert 2-D tensors ``<prefix>.{e}.gate_proj/up_proj/down_proj.weight``
(what transformers' ``save_pretrained`` writes), stacked 3-D tensors ``<prefix>.gate_proj/up_proj/down_proj``
``[E, out, in]`` (GGUF files), and transformers' in-memory fused form ``<prefix>.gate_up_proj [E, 2I, H]`` /
``<prefix>.down_proj [E, H, I]`` (``save_pretrained(save_original_format=False)``), with or without ``.weight``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from cvllm.checkpoint.base import CheckpointError
from cvllm.distributed import all_reduce, divide, tp_rank, tp_size
from cvllm.forward_context import current_forward_context
from cvllm.layers.activation import SiluAndMul
from cvllm.weight_loading import load_weights_by_name


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, E]`` logits -> (``[T, k]`` fp32 weights, ``[T, k]`` int64 expert ids), best expert first."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


class FusedMoEMethod:
    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int, intermediate_local: int,
                       dtype: torch.dtype) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        pass

    def apply(self, layer: FusedMoE, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedFusedMoEMethod(FusedMoEMethod):
    """The torch reference. Two forms, the same numbers up to matmul rounding:

    - grouped: the (token, expert) pairs sorted by expert, one gate_up and one down matmul per busy expert.
      Least arithmetic, but it reads the per-expert counts back to the host to slice the groups.
    - padded: every expert gets a slot for each of the T tokens (a token picks an expert at most once, so T
      slots always suffice), the pairs are scattered into ``[E, T, H]`` and two batched matmuls run over all
      of it. No value is read back to the host, so a CUDA graph can capture it, at the price of E / k times
      the arithmetic of the grouped form: cheap for decode batches, where reading the weights is the cost.

    A decode-only forward on a backend with ``sync_free_decode`` (CUDA: graphs, async scheduling) takes the
    padded form; everything else the grouped one. A fused grouped-GEMM kernel replaces both (issue 19)."""

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int, intermediate_local: int,
                       dtype: torch.dtype) -> None:
        layer.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_local, hidden_size, dtype=dtype),
                                        requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_local, dtype=dtype),
                                       requires_grad=False)

    def apply(self, layer: FusedMoE, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        ctx = current_forward_context()
        if ctx is not None and ctx.is_decode_only and ctx.backend.sync_free_decode:
            return experts_padded(layer, hidden, topk_weights, topk_ids)
        return experts_grouped(layer, hidden, topk_weights, topk_ids)


def _pairs_by_expert(topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, expert id, source token) of the T * k (token, expert) pairs sorted by expert, stably."""
    flat_ids = topk_ids.reshape(-1)                           # [T * k], token-major
    order = torch.argsort(flat_ids, stable=True)
    return order, flat_ids[order], order // topk_ids.shape[1]


def _combine(hidden: torch.Tensor, out: torch.Tensor, topk_weights: torch.Tensor, order: torch.Tensor,
             token_of_pair: torch.Tensor) -> torch.Tensor:
    """Each sorted pair's expert output times its routing weight, summed into its token's row."""
    # the routing weights are cast to the activations' dtype before the product, as transformers does
    out = out * topk_weights.reshape(-1)[order].to(hidden.dtype).unsqueeze(-1)
    return torch.zeros_like(hidden).index_add_(0, token_of_pair, out)


def experts_grouped(layer: FusedMoE, hidden: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
    order, _, token_of_pair = _pairs_by_expert(topk_ids)
    # one host sync per layer, to size the per-expert slices
    counts = torch.bincount(topk_ids.reshape(-1), minlength=layer.num_experts).tolist()
    grouped = hidden[token_of_pair]                           # [T * k, H]
    out = torch.empty_like(grouped)
    start = 0
    for expert, count in enumerate(counts):                   # experts, never tokens
        if count:
            rows = slice(start, start + count)
            gate_up = F.linear(grouped[rows], layer.w13_weight[expert])   # [n, 2 * I_local]
            out[rows] = F.linear(layer.act_fn(gate_up), layer.w2_weight[expert])
            start += count
    return _combine(hidden, out, topk_weights, order, token_of_pair)


def experts_padded(layer: FusedMoE, hidden: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> torch.Tensor:
    tokens, num_experts = hidden.shape[0], layer.num_experts
    order, expert_of_pair, token_of_pair = _pairs_by_expert(topk_ids)
    # each pair's rank inside its expert's group: its sorted position minus where the group starts
    counts = torch.zeros(num_experts, dtype=torch.long, device=hidden.device)
    counts.scatter_add_(0, expert_of_pair, torch.ones_like(expert_of_pair))
    group_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(expert_of_pair.shape[0], device=hidden.device) - group_start[expert_of_pair]
    slot = expert_of_pair * tokens + rank                     # row of [E * T, H]; rank < T always
    grouped = hidden.new_zeros(num_experts * tokens, hidden.shape[1]).index_copy_(0, slot, hidden[token_of_pair])
    gate_up = torch.bmm(grouped.view(num_experts, tokens, -1), layer.w13_weight.transpose(1, 2))
    down = torch.bmm(layer.act_fn(gate_up), layer.w2_weight.transpose(1, 2))    # [E, T, H]
    return _combine(hidden, down.reshape(num_experts * tokens, -1)[slot], topk_weights, order, token_of_pair)


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
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.reduce_results = hidden_size, reduce_results
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.intermediate_size = intermediate_size
        self.intermediate_local = divide(intermediate_size, self.tp_size)
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
        method.create_weights(self, self.num_experts, self.hidden_size, self.intermediate_local, self.params_dtype)

    def enable_expert_counts(self) -> None:
        self.expert_counts = torch.zeros(self.num_experts, dtype=torch.int64, device=self.w13_weight.device)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        if self.expert_counts is not None:
            # scatter_add, not bincount: bincount sizes its output from the largest id, a host sync on CUDA
            flat_ids = topk_ids.reshape(-1)
            self.expert_counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
        out = self.quant_method.apply(self, hidden, topk_weights, topk_ids)
        return all_reduce(out) if self.reduce_results and self.tp_size > 1 else out

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str,
                      expert_id: int | None = None) -> None:
        """Copy one checkpoint tensor into ``param``. ``shard_id``: "w1" (gate), "w3" (up), "w13" (gate rows
        then up rows), "w2" (down). ``expert_id`` None: ``loaded`` holds all experts stacked on dim 0."""
        experts = slice(None) if expert_id is None else expert_id
        want_dims = 3 if expert_id is None else 2
        if loaded.dim() != want_dims:
            raise ValueError(f"expected a {want_dims}-D tensor, got shape {tuple(loaded.shape)}")
        if expert_id is None and loaded.shape[0] != self.num_experts:
            raise ValueError(f"{loaded.shape[0]} experts stacked, the model has {self.num_experts}")
        if expert_id is not None and not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert {expert_id} out of range (the model has {self.num_experts})")
        if shard_id == "w13":
            gate, up = loaded.chunk(2, dim=-2)
            self.weight_loader(param, gate, "w1", expert_id)
            self.weight_loader(param, up, "w3", expert_id)
            return
        full = (self.hidden_size, self.intermediate_size) if shard_id == "w2" else (self.intermediate_size,
                                                                                    self.hidden_size)
        if tuple(loaded.shape[-2:]) != full:  # checked before narrowing: a slice of a wrong shape could fit
            raise ValueError(f"{shard_id}: checkpoint shape {tuple(loaded.shape)}, expected {full} per expert")
        size = self.intermediate_local
        if shard_id == "w2":  # row-parallel: this rank's columns of the intermediate dimension
            part, target = loaded.narrow(-1, self.tp_rank * size, size), param.data[experts]
        elif shard_id in ("w1", "w3"):  # column-parallel: this rank's rows, into the gate or the up half
            part = loaded.narrow(-2, self.tp_rank * size, size)
            target = param.data[experts].narrow(-2, 0 if shard_id == "w1" else size, size)
        else:
            raise ValueError(f"unknown expert shard '{shard_id}'")
        target.copy_(part)


# "<module>.experts[.<e>].<proj>[.weight]"
_EXPERT_TENSOR = re.compile(r"^(?P<module>.+\.experts)\.(?:(?P<expert>\d+)\.)?"
                            r"(?P<proj>gate_up_proj|gate_proj|up_proj|down_proj)(?:\.weight)?$")


def load_weights_with_experts(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                              packed_modules_mapping: dict[str, tuple[str, object]] | None = None) -> set[str]:
    """``load_weights_by_name`` for a model with ``FusedMoE`` layers: expert tensors (any form in the module
    docstring) go to their layer, everything else loads by name. Returns the fully loaded parameter names;
    an expert weight counts once every expert's every part has arrived."""
    layers = {name: module for name, module in model.named_modules() if isinstance(module, FusedMoE)}
    # parameter name -> [E, parts] coverage; w13 has two parts (gate, up), w2 one
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
                layer.weight_loader(getattr(layer, attr), tensor, shard, expert)
            except (ValueError, RuntimeError) as e:
                raise CheckpointError(f"cannot load '{name}' into '{param_name}': {e}") from None
            seen = coverage.setdefault(param_name, torch.zeros(layer.num_experts, 1 if shard == "w2" else 2,
                                                               dtype=torch.bool))
            parts = {"w1": [0], "w3": [1], "w13": [0, 1], "w2": [0]}[shard]
            seen[slice(None) if expert is None else expert, parts] = True

    loaded = load_weights_by_name(model, non_expert_tensors(weights), packed_modules_mapping)
    return loaded | {name for name, seen in coverage.items() if bool(seen.all())}
