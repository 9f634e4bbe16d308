"""LinearMethods for GPTQ and AWQ checkpoints: the checkpoint's packed tensors, sharded for tensor parallelism.

Each layer holds the checkpoint's own tensors under their own names (``qweight``, ``qzeros``, ``scales``, and GPTQ's
``g_idx``), narrowed to this rank's part while they load:

- column-parallel layers (and the q/k/v and gate/up shards of fused ones) keep their output columns: a slice of
  every tensor's output dim (whole packed words of ``qzeros``, and of AWQ's ``qweight``; a shard whose width is
  not a multiple of the pack is refused);
- row-parallel layers keep their input rows: GPTQ ``qweight`` rows by whole packed words, and the ``qzeros`` and
  ``scales`` of whole groups, so the split must fall on a group boundary (refused with an error otherwise). Under
  desc_act (act-order) a rank's inputs belong to any group, so each rank keeps all groups' zeros and scales, as
  vLLM does; ``group_size`` -1 (one group) is replicated likewise;
- a fused layer keeps one ``g_idx`` row per shard ([shards, in]): q/k/v (or gate/up) were quantized as separate
  layers and their act-order maps need not agree.

Lazy checkpoint tensors (cvllm/checkpoint/lazy.py) are narrowed before they are read, so a rank reads its part only.

The compute form, made once by ``process_weights_after_loading`` (``layer.marlin_compute``):

- "planes", on a CUDA device: the weights stay 4/8-bit, repacked losslessly into the CUDA backend's low-bit plane
  layout (planes.py: GPTQ's ``qweight`` as stored, AWQ's repacked along the input dim, act-order layers with their
  inputs reordered by group), and ``apply`` runs its Triton kernel (``cvllm_cuda.kernels.quant_matmul``: float32
  sums; its weights equal the dequantized ones bit for bit). GPU weight memory is about the checkpoint's.
  ``CVLLM_QUANT_KERNELS=0`` turns it off; it also needs cvllm-cuda and triton.
- "dense", everywhere else (CPU; CUDA without the kernels; layers the planes cannot hold: fused shards with
  different act-order maps, a row-parallel rank's part under act-order, input features or groups not multiples of
  32): dequantized once to the engine's dtype, and ``apply`` is a plain matmul (``F.linear``, or the backend's own).
  Weight memory is then that of the unquantized model in the engine's dtype.

Either way the packed checkpoint tensors are released afterwards.
"""

from __future__ import annotations

import logging
from functools import partial

import torch
from torch import nn

from cvllm.checkpoint.lazy import LazyTensor, lazy_aware, materialize
from cvllm.layers.linear import output_shard, output_shards
from cvllm.layers.quantization import LinearMethod, dense, plane_kernels_usable
from cvllm_marlin.config import AWQConfig, GPTQConfig
from cvllm_marlin.packing import dequantize_awq, dequantize_gptq

PACKED = ("qweight", "qzeros", "scales", "g_idx")
# "0" keeps every layer dequantized on CUDA too (the plane kernels off)

logger = logging.getLogger(__name__)


class ShardError(ValueError):
    """A tensor-parallel split this checkpoint's layout cannot be cut at."""


def shard_index(layer: nn.Module, shard_id: object) -> int:
    return [shard.shard_id for shard in output_shards(layer)].index(shard_id)


class PackedLinearMethod(LinearMethod):
    """What GPTQ and AWQ share: the input/group split, the loader, the dequantized compute form."""

    name = "packed"
    # tensor -> (input dim or None, input unit: "rows" / "words" / "groups", output dim or None, output unit)
    layout: dict[str, tuple[int | None, str | None, int | None, int]] = {}

    def __init__(self, config: GPTQConfig | AWQConfig, dtype: torch.dtype | None = None, layer_name: str = ""):
        self.config, self.dtype, self.layer_name = config, dtype, layer_name

    # --- shapes -------------------------------------------------------------------------------------------
    def keeps_all_groups(self) -> bool:
        return self.config.group_size == -1

    def _plan(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        cfg, where = self.config, self.layer_name or type(layer).__name__
        split = getattr(layer, "tp_dim", None) == 1 and getattr(layer, "tp_size", 1) > 1
        size = layer.tp_size if split else 1
        full_in = input_size * size
        in_start = layer.tp_rank * input_size if split else 0
        group = cfg.group_size
        if group != -1 and full_in % group:
            raise ShardError(f"{where}: {full_in} input features are not a whole number of groups of {group}")
        total_groups = 1 if group == -1 else full_in // group
        if self.keeps_all_groups():
            groups, group_start = total_groups, 0
        else:
            if input_size % group:
                raise ShardError(f"{where}: a row-parallel split over {size} tensor-parallel ranks gives each rank "
                                 f"{input_size} of the {full_in} input features, which does not fall on the "
                                 f"boundaries of the {group}-feature quantization groups (group_size {group}); use a "
                                 f"tensor_parallel_size that divides {total_groups} groups evenly")
            groups, group_start = input_size // group, in_start // group
        if input_size % cfg.pack:
            raise ShardError(f"{where}: {input_size} input features per rank are not whole {cfg.pack}-row words")
        for shard in output_shards(layer):
            if shard.rows % cfg.pack and any(unit == cfg.pack for *_, unit in self.layout.values()):
                what = "" if shard.shard_id is None else f" shard {shard.shard_id!r}"
                raise ShardError(f"{where}{what}: {shard.rows} output features per rank are not whole "
                                 f"{cfg.pack}-column words of the packed tensors")
        layer.marlin_plan = {"split": split, "in_start": in_start, "input_size": input_size, "full_in": full_in,
                             "groups": groups, "group_start": group_start, "total_groups": total_groups,
                             "output_size": output_size, "shards": len(output_shards(layer))}

    def _units(self, layer: nn.Module, unit: str) -> tuple[int, int, int]:
        """(start, length, full length) of this rank's part of an input dim counted in ``unit``."""
        plan, pack = layer.marlin_plan, self.config.pack
        if unit == "rows":
            return plan["in_start"], plan["input_size"], plan["full_in"]
        if unit == "words":
            return plan["in_start"] // pack, plan["input_size"] // pack, plan["full_in"] // pack
        return plan["group_start"], plan["groups"], plan["total_groups"]

    def _param(self, layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        param.weight_loader = lazy_aware(partial(self.weight_loader, layer, name))
        setattr(layer, name, param)

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        self._plan(layer, input_size, output_size)
        self.dtype = self.dtype or dtype
        self._create_packed(layer, input_size, output_size)
        layer.marlin_ready = False
        layer.marlin_compute = None   # "planes" or "dense" once prepared
        # the compute form lives here after loading; empty until then
        layer.register_buffer("weight", torch.empty(0, dtype=dtype), persistent=False)

    def _create_packed(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        raise NotImplementedError

    # --- loading ------------------------------------------------------------------------------------------
    def weight_loader(self, layer: nn.Module, name: str, param: nn.Parameter, loaded: torch.Tensor | LazyTensor,
                      shard_id: object = None) -> None:
        if layer.marlin_ready:
            raise RuntimeError(f"{self.layer_name}: {name} loaded after the layer was prepared")
        in_dim, in_unit, out_dim, out_unit = self.layout[name]
        target = param.data
        if name == "g_idx":
            target = target[shard_index(layer, shard_id)]
        if in_dim is not None:
            start, length, full = self._units(layer, in_unit)
            _check_dim(loaded, in_dim, full, name, "input")
            if length != full:
                loaded = loaded.narrow(in_dim, start, length)
        if out_dim is not None:
            shard = output_shard(layer, shard_id)
            _check_dim(loaded, out_dim, shard.total // out_unit, name, "output")
            loaded = loaded.narrow(out_dim, shard.start // out_unit, shard.rows // out_unit)
            target = target.narrow(out_dim, shard.offset // out_unit, shard.rows // out_unit)
        if tuple(loaded.shape) != tuple(target.shape):
            raise ValueError(f"{name}: checkpoint part of shape {tuple(loaded.shape)} != model shape "
                             f"{tuple(target.shape)}")
        values = materialize(loaded)
        if name != "scales" and values.dtype.is_floating_point:
            raise ValueError(f"{name}: expected int32, the checkpoint has {values.dtype}")
        target.copy_(values)

    # --- compute ------------------------------------------------------------------------------------------
    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.marlin_ready:
            return
        planes = None
        if plane_kernels_usable(layer.qweight.device):
            from cvllm_marlin.planes import layer_planes

            planes = layer_planes(self, layer)
        if planes is not None:
            self.use_planes(layer, planes)
        else:
            layer.weight = self.dequantize(layer).to(self.dtype or torch.float32)
            layer.marlin_compute = "dense"
        for name in PACKED:   # the compute form holds everything needed: the packed form is not read again
            param = getattr(layer, name, None)
            if isinstance(param, nn.Parameter):
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        layer.marlin_ready = True

    def use_planes(self, layer: nn.Module, planes) -> None:
        """Make ``planes`` (planes.Planes) the layer's compute form."""
        from cvllm_cuda.quant_planes import attach

        attach(layer, planes.weight)
        layer.register_buffer("quant_perm", planes.perm, persistent=False)
        layer.marlin_compute = "planes"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not layer.marlin_ready:
            self.process_weights_after_loading(layer)
        if layer.marlin_compute == "planes":
            from cvllm_cuda.kernels.quant_matmul import quant_linear

            if layer.quant_perm is not None:   # act-order: the planes hold the inputs in group order
                x = x.index_select(-1, layer.quant_perm)
            return quant_linear(x, layer.quant_weight, bias)
        weight = layer.weight
        if x.dtype == weight.dtype and (bias is None or bias.dtype == weight.dtype):
            return dense(x, weight, bias)
        out = dense(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype))
        return out.to(x.dtype)


def _check_dim(loaded: torch.Tensor | LazyTensor, dim: int, expected: int, name: str, what: str) -> None:
    if loaded.dim() <= dim or loaded.shape[dim] != expected:
        raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)}, expected {expected} along dim {dim} "
                         f"(the {what} dim)")


class GPTQLinearMethod(PackedLinearMethod):
    """GPTQ: qweight int32 [in/pack, out], qzeros int32 [groups, out/pack], scales [groups, out], g_idx [in]
    (held per output shard: [shards, in]). Planes or dequantized after loading, see the module docstring."""

    name = "gptq"

    def __init__(self, config: GPTQConfig, dtype: torch.dtype | None = None, layer_name: str = ""):
        super().__init__(config, dtype, layer_name)
        self.layout = {"qweight": (0, "words", 1, 1), "qzeros": (0, "groups", 1, config.pack),
                       "scales": (0, "groups", 1, 1), "g_idx": (0, "rows", None, 1)}

    def keeps_all_groups(self) -> bool:
        return self.config.group_size == -1 or self.config.desc_act

    def _create_packed(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        plan, pack = layer.marlin_plan, self.config.pack
        self._param(layer, "qweight", (input_size // pack, output_size), torch.int32)
        self._param(layer, "qzeros", (plan["groups"], output_size // pack), torch.int32)
        self._param(layer, "scales", (plan["groups"], output_size), torch.float32)   # exact for fp16 and bf16
        self._param(layer, "g_idx", (plan["shards"], input_size), torch.int32)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        cfg, plan = self.config, layer.marlin_plan
        parts = []
        for index, shard in enumerate(output_shards(layer)):
            offset, width = shard.offset, shard.rows
            words = slice(offset // cfg.pack, (offset + width) // cfg.pack)
            try:
                parts.append(dequantize_gptq(layer.qweight[:, offset:offset + width], layer.qzeros[:, words],
                                             layer.scales[:, offset:offset + width], layer.g_idx[index], cfg.bits,
                                             cfg.zero_offset, plan["group_start"]))
            except ValueError as e:
                hint = "" if cfg.desc_act else " (desc_act is false, so g_idx should be i // group_size)"
                raise ValueError(f"{self.layer_name}: {e}{hint}") from None
        return torch.cat(parts, 0)


class AWQLinearMethod(PackedLinearMethod):
    """AWQ (GEMM): qweight int32 [in, out/8] and qzeros int32 [groups, out/8] in AWQ's interleaved order, scales
    [groups, out]. Planes or dequantized after loading, see the module docstring."""

    name = "awq"

    def __init__(self, config: AWQConfig, dtype: torch.dtype | None = None, layer_name: str = ""):
        super().__init__(config, dtype, layer_name)
        self.layout = {"qweight": (0, "rows", 1, config.pack), "qzeros": (0, "groups", 1, config.pack),
                       "scales": (0, "groups", 1, 1)}

    def _create_packed(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        plan, pack = layer.marlin_plan, self.config.pack
        self._param(layer, "qweight", (input_size, output_size // pack), torch.int32)
        self._param(layer, "qzeros", (plan["groups"], output_size // pack), torch.int32)
        self._param(layer, "scales", (plan["groups"], output_size), torch.float32)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return dequantize_awq(layer.qweight, layer.qzeros, layer.scales, self.config.group_size)
