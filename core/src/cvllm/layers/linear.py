"""Linear layers split for tensor parallelism (nano-vllm / vLLM shapes).

Column-parallel layers split the output features across ranks, row-parallel ones the input
features (followed by an all-reduce). Fused layers (QKV, gate+up) load their Hugging Face
sub-weights through ``weight_loader(param, tensor, shard_id)``. The loaders narrow before they copy, so a
lazy checkpoint tensor (``checkpoint/lazy.py``) is read only as far as this rank's shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cvllm.checkpoint.lazy import LazyTensor, lazy_aware, materialize
from cvllm.distributed import all_reduce, divide, tp_rank, tp_size
from cvllm.layers.quantization import LinearMethod, UnquantizedLinearMethod


@dataclass(frozen=True, slots=True)
class OutputShard:
    """One checkpoint tensor's part of a linear layer's output rows on this tensor-parallel rank."""
    shard_id: object   # the loader's shard id ("q", "k", "v"; 0, 1 ...); None for a layer of one tensor
    offset: int        # first row of the part in this rank's weight
    rows: int          # rows the part has on this rank
    start: int         # first of those rows in the checkpoint tensor
    total: int         # rows of the checkpoint tensor


def output_shards(layer: nn.Module) -> list[OutputShard]:
    """Where each checkpoint tensor's rows land in ``layer`` on this rank: the one description the layers' loaders
    use, and quantization methods that keep per-shard data (scales, packed words, blocks of mixed types)."""
    tp_size, tp_rank = getattr(layer, "tp_size", 1), getattr(layer, "tp_rank", 0)
    if isinstance(layer, QKVParallelLinear):
        q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        kv_rank, kv_ranks = tp_rank // layer.kv_replicas, max(1, tp_size // layer.kv_replicas)
        return [OutputShard("q", 0, q, tp_rank * q, q * tp_size), OutputShard("k", q, kv, kv_rank * kv, kv * kv_ranks),
                OutputShard("v", q + kv, kv, kv_rank * kv, kv * kv_ranks)]
    if isinstance(layer, MergedColumnParallelLinear):
        shards, offset = [], 0
        for i, size in enumerate(layer.output_sizes):
            rows = size // tp_size
            shards.append(OutputShard(i, offset, rows, tp_rank * rows, size))
            offset += rows
        return shards
    rows = layer.output_size
    column = getattr(layer, "tp_dim", None) == 0 and tp_size > 1
    return [OutputShard(None, 0, rows, tp_rank * rows if column else 0, rows * tp_size if column else rows)]


def output_shard(layer: nn.Module, shard_id: object) -> OutputShard:
    for shard in output_shards(layer):
        if shard.shard_id == shard_id:
            return shard
    raise ValueError(f"unknown shard {shard_id!r} for {type(layer).__name__}")


def _check_shape(param: nn.Parameter, loaded: torch.Tensor | LazyTensor, what: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(loaded.shape)} != model shape {tuple(param.shape)}")


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None,
                 quant_method: LinearMethod | None = None):
        super().__init__()
        self.input_size, self.output_size, self.tp_dim = input_size, output_size, tp_dim
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.params_dtype = torch.get_default_dtype()
        self._create_weights(quant_method or UnquantizedLinearMethod())
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _create_weights(self, method: LinearMethod) -> None:
        self.quant_method = method
        method.create_weights(self, self.input_size, self.output_size, self.params_dtype)
        for param in self.parameters(recurse=False):  # a quantization method may bring its own loaders
            if not hasattr(param, "weight_loader"):
                param.weight_loader = self.weight_loader

    def set_quant_method(self, method: LinearMethod) -> None:
        """Store and apply the weight another way. Meant for a model built on the meta device, before
        it is materialised (see ``attach_linear_methods``): the old weight is dropped, the bias kept."""
        for name in [n for n in self._parameters if n != "bias"]:
            delattr(self, name)
        for name in list(self._buffers):
            delattr(self, name)
        self._create_weights(method)

    @lazy_aware
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | LazyTensor) -> None:
        if self.tp_dim is not None and param.dim() > self.tp_dim and self.tp_size > 1:
            size = param.size(self.tp_dim)
            loaded = loaded.narrow(self.tp_dim, self.tp_rank * size, size)
        _check_shape(param, loaded, "linear")
        param.data.copy_(materialize(loaded))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, quant_method: LinearMethod | None = None):
        super().__init__(input_size, output_size, bias, None, quant_method)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, quant_method: LinearMethod | None = None):
        super().__init__(input_size, divide(output_size, tp_size()), bias, 0, quant_method)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_proj + up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quant_method: LinearMethod | None = None):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, quant_method)

    @lazy_aware
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | LazyTensor, shard_id: int) -> None:
        shard = output_shard(self, shard_id)
        loaded = loaded.narrow(0, shard.start, shard.rows) if self.tp_size > 1 else loaded
        target = param.data.narrow(0, shard.offset, shard.rows)
        _check_shape(target, loaded, f"shard {shard_id}")
        target.copy_(materialize(loaded))


class QKVParallelLinear(ColumnParallelLinear):
    """q_proj, k_proj and v_proj in one matmul; KV heads are replicated when fewer than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, quant_method: LinearMethod | None = None):
        size = tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, size)
        self.num_kv_heads = max(1, total_num_kv_heads // size)
        self.kv_replicas = max(1, size // total_num_kv_heads)
        output = (total_num_heads + 2 * self.num_kv_heads * size) * head_dim
        super().__init__(hidden_size, output, bias, quant_method)

    @lazy_aware
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | LazyTensor, shard_id: str) -> None:
        shard = output_shard(self, shard_id)
        if self.tp_size > 1:
            loaded = loaded.narrow(0, shard.start, shard.rows)
        target = param.data.narrow(0, shard.offset, shard.rows)
        _check_shape(target, loaded, f"{shard_id}_proj")
        target.copy_(materialize(loaded))


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, quant_method: LinearMethod | None = None):
        super().__init__(divide(input_size, tp_size()), output_size, bias, 1, quant_method)

    @lazy_aware
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | LazyTensor) -> None:
        if param.dim() == 1:  # the bias is not split: rank 0 adds it after the reduction
            _check_shape(param, loaded, "bias")
            param.data.copy_(materialize(loaded))
            return
        super().weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        out = self.quant_method.apply(self, x, bias)
        return all_reduce(out) if self.tp_size > 1 else out
