"""Loading Hugging Face-named tensors into a model, fused layers included.

A model lists how checkpoint names map onto its fused parameters in ``packed_modules_mapping``
(``{"q_proj": ("qkv_proj", "q"), ...}``); everything else loads by its own name. Errors name the
parameter; a fused parameter counts as loaded only when all of its shards arrived.

Tensors may come lazy (``checkpoint/lazy.py``, under tensor parallelism): a loader marked ``lazy_aware`` (the
parallel layers') gets the LazyTensor and reads only its rank's part; any other gets the tensor read whole.

A checkpoint that stores a tensor in another shape than the model's layer (a fused qkv to cut into the q/k/v
shards, per-head norms stacked in one tensor) goes through ``transform_weights`` first: a model names, per name
fragment, a function that turns one checkpoint tensor into the (name, tensor) pairs the loader knows. The
quantizers still look a layer's tensors up under the checkpoint's own names (``packed_modules_mapping``); the
names after the transforms are what ``loading_mapping`` maps (layers/decoder.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from cvllm.checkpoint.base import CheckpointError
from cvllm.checkpoint.lazy import LazyTensor, takes_lazy

logger = logging.getLogger(__name__)


# one checkpoint tensor (name, tensor: a Tensor or a LazyTensor) -> the (name, tensor) pairs that load in its place
WeightTransform = Callable[[str, Any], Iterable[tuple[str, Any]]]


def transform_weights(weights: Iterable[tuple[str, Any]],
                      transforms: Mapping[str, WeightTransform]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with each one whose name contains a key of ``transforms`` replaced by what that
    transform yields (the first key that matches); the rest as they are. A transform that fails (a wrong shape, a
    ValueError) is a CheckpointError naming the checkpoint tensor."""
    for name, tensor in weights:
        key = next((key for key in transforms if key in name), None)
        if key is None:
            yield name, tensor
            continue
        try:
            parts = list(transforms[key](name, tensor))
        except CheckpointError:
            raise
        except (ValueError, RuntimeError, IndexError) as e:
            raise CheckpointError(f"cannot load '{name}': {e}", tensor=name) from None
        yield from parts


def split_rows(fused: str, parts: Sequence[tuple[str, int]],
               suffixes: tuple[str, ...] = (".weight", ".bias")) -> tuple[str, WeightTransform]:
    """A ``transform_weights`` entry that cuts a fused tensor's rows (its output features) into named parts:
    ``split_rows(".qkv_proj.", [(".q_proj.", q_rows), (".k_proj.", kv_rows), (".v_proj.", kv_rows)])``. Only names
    ending in ``suffixes`` are cut (others pass through). ``narrow`` reads nothing, so a lazy tensor is still read
    only as far as a tensor-parallel rank's shard."""
    total = sum(rows for _, rows in parts)

    def split(name: str, tensor: Any) -> Iterator[tuple[str, Any]]:
        if not name.endswith(suffixes):
            yield name, tensor
            return
        if tensor.shape[0] != total:
            raise ValueError(f"{tensor.shape[0]} rows; the config says {total} "
                             f"({' + '.join(f'{part.strip(chr(46))} {rows}' for part, rows in parts)})")
        start = 0
        for part, rows in parts:
            yield name.replace(fused, part), tensor.narrow(0, start, rows)
            start += rows

    return fused, split


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)} != model shape {tuple(param.shape)}")
    param.data.copy_(loaded)


# an FP8 KV cache's scales as checkpoints carry them (llm-compressor's kv_cache_scheme: self_attn.k_scale; older
# FP8 checkpoints: k_proj.output_scale), for the attention layer of the module that holds them (layers/kv_fp8.py)
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".k_proj.output_scale", ".v_proj.output_scale")


def _store_kv_scale(model: nn.Module, name: str, tensor) -> bool:
    """Keep a checkpoint KV scale on the attention layer under its module; False when there is none."""
    from cvllm.layers.attention import Attention

    which = "k" if name.endswith(("k_scale", "k_proj.output_scale")) else "v"
    parent = name.removesuffix(".k_proj.output_scale").removesuffix(".v_proj.output_scale")
    parent = parent.removesuffix(".k_scale").removesuffix(".v_scale")
    try:
        module = model.get_submodule(parent)
    except AttributeError:
        return False
    attention = next((m for m in module.modules() if isinstance(m, Attention)), None)
    if attention is None:
        return False
    value = tensor.materialize() if isinstance(tensor, LazyTensor) else tensor
    setattr(attention, f"checkpoint_{which}_scale", float(value.reshape(-1)[0]))
    return True


def load_weights_by_name(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                         packed_modules_mapping: dict[str, tuple[str, object]] | None = None,
                         skip: tuple[str, ...] = ("rotary_emb.inv_freq",)) -> set[str]:
    """Returns the names of the model parameters that were fully loaded."""
    mapping = packed_modules_mapping or {}
    params = dict(model.named_parameters())
    shards_wanted: dict[str, set] = {}
    for fused, shard in mapping.values():
        shards_wanted.setdefault(fused, set()).add(shard)
    shards_seen: dict[str, set] = {}
    loaded: set[str] = set()
    for name, tensor in weights:
        if any(s in name for s in skip):
            continue
        target, shard = name, None
        for source, (fused, shard_id) in mapping.items():
            if f".{source}." in name:
                target, shard = name.replace(f".{source}.", f".{fused}."), shard_id
                break
        param = params.get(target)
        if param is None and name.endswith(KV_SCALE_SUFFIXES) and _store_kv_scale(model, name, tensor):
            continue
        if param is None:
            logger.warning("ignoring checkpoint tensor '%s': the model has no parameter of that name", name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        if isinstance(tensor, LazyTensor) and not takes_lazy(loader):
            tensor = tensor.materialize()
        try:
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
        except (ValueError, RuntimeError) as e:
            raise CheckpointError(f"cannot load '{name}' into '{target}': {e}", tensor=name) from None
        if shard is None:
            loaded.add(target)
        else:
            seen = shards_seen.setdefault(target, set())
            seen.add(shard)
            if seen == shards_wanted[target.rsplit(".", 2)[-2]]:
                loaded.add(target)
    return loaded
