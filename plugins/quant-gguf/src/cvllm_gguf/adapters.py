"""GGUF metadata and tensor names to Hugging Face terms, driven by a model plugin's ``GGUFArchitecture``.

- ``hf_config``: ``<arch>.*`` metadata -> a config.json-like dict (rope scaling, vocabulary size,
  tied embeddings, bias flags, eos/bos ids).
- ``tensor_names``: GGUF tensor names -> HF names, by looking the family's HF module names up in
  gguf's ``TensorNameMap`` (which maps HF -> GGUF) and inverting the result.
- ``unpermute_rows``: undoes the q/k row order llama.cpp's converter writes for ``llama``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from cvllm.checkpoint.base import CheckpointError
from cvllm.gguf_adapter import GGUFArchitecture

# general.file_type (llama_ftype) of the files that are all float: the dtype "auto" runs them in
_FLOAT_FILE_TYPES = {0: "float32", 1: "float16", 32: "bfloat16"}
_REQUIRED = ("hidden_size", "num_attention_heads", "num_hidden_layers")


def expand_blocks(names: Iterable[str], n_blocks: int) -> list[str]:
    """Names with "{bid}" once per block index, others as they are."""
    out: list[str] = []
    for name in names:
        if "{bid}" in name:
            out.extend(name.format(bid=b) for b in range(n_blocks))
        else:
            out.append(name)
    return out


def tensor_names(arch_name: str, adapter: GGUFArchitecture, n_blocks: int) -> dict[str, str]:
    """GGUF base name (``blk.0.attn_q``) -> HF module name (``model.layers.0.self_attn.q_proj``)."""
    import gguf

    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}.get(arch_name)
    if arch is None:
        raise CheckpointError(f"the gguf package does not know the GGUF architecture '{arch_name}'")
    name_map = gguf.get_tensor_name_map(arch, n_blocks)
    out: dict[str, str] = {}
    for hf_name in expand_blocks(adapter.hf_modules, n_blocks):
        gguf_name = name_map.get_name(hf_name)
        if gguf_name is None:  # the declaration is wrong, not the file
            raise ValueError(f"GGUF architecture '{arch_name}' declares the module '{hf_name}', which gguf's "
                             f"TensorNameMap does not map for that architecture")
        out[gguf_name] = hf_name
    return out


def unpermute_rows(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's ``LlamaModel.permute``, which writes each head's rows as
    ``w.reshape(n_head, 2, r // 2, ...).swapaxes(1, 2)``: the inverse reads them as
    ``(n_head, r // 2, 2, ...)`` and swaps back. Rows move whole, so raw quantized rows (bytes)
    are un-permuted exactly like float rows."""
    total = rows.shape[0]
    if total % (2 * n_head):
        raise ValueError(f"{total} rows do not split into {n_head} heads of rotary pairs")
    per_head = total // n_head
    return rows.reshape(n_head, per_head // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape).contiguous()


def llama3_rope_factors(theta: float, head_dim: int, factor: float, low: float, high: float,
                        original_context: int) -> torch.Tensor:
    """The ``rope_freqs`` tensor convert_hf_to_gguf writes for a llama3 rope config (same float32 steps)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    low_wavelen, high_wavelen = original_context / low, original_context / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (original_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def llama3_rope_from_freqs(freqs: torch.Tensor, theta: float, head_dim: int,
                           contexts: Iterable[int]) -> dict[str, Any] | None:
    """Recover HF's llama3 rope_scaling from llama.cpp's per-dimension factors. GGUF keeps only the
    factors, so accept the parameters only when they reproduce the tensor (Llama 3.1-3.3 use
    low 1, high 4 and an 8192 original context)."""
    freqs = freqs.float().flatten()
    factor = float(freqs.max())
    if torch.all(freqs == 1):
        return None
    for context in contexts:
        expected = llama3_rope_factors(theta, head_dim, factor, 1.0, 4.0, context)
        if expected.shape == freqs.shape and torch.allclose(expected, freqs, rtol=1e-6, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": context}
    raise ValueError("its rope_freqs tensor is not a llama3 rope scaling cvllm can recover "
                     "(factor, low 1, high 4, original context 8192)")


def _rope_scaling(value: Callable[[str], Any]) -> dict[str, Any] | None:
    """``<arch>.rope.scaling.*`` (and the older ``rope.scale_linear``) -> HF rope_scaling."""
    kind = value("rope.scaling.type")
    factor = value("rope.scaling.factor")
    if kind is None and value("rope.scale_linear") is not None:
        kind, factor = "linear", value("rope.scale_linear")
    if kind in (None, "none") or (kind in ("linear", "yarn") and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor),
                   "original_max_position_embeddings": value("rope.scaling.original_context_length")}
        for gguf_key, hf_key in (("rope.scaling.attn_factor", "attention_factor"),
                                 ("rope.scaling.yarn_beta_fast", "beta_fast"),
                                 ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if value(gguf_key) is not None:
                scaling[hf_key] = float(value(gguf_key))
        return scaling
    raise ValueError(f"rope scaling type '{kind}' is not supported for GGUF files")


def hf_config(arch_name: str, adapter: GGUFArchitecture, metadata: Callable[[str], Any],
              tensors: Mapping[str, tuple[int, ...]], vocab_size: int | None,
              read_tensor: Callable[[str], torch.Tensor]) -> dict[str, Any]:
    """A config.json-style dict; ``metadata(key)`` reads full GGUF keys, None when absent; ``tensors``
    maps each GGUF tensor name to its shape in Hugging Face order."""
    def value(key: str) -> Any:
        return metadata(f"{arch_name}.{key}")

    raw: dict[str, Any] = {"architectures": [adapter.hf_architecture], "model_type": arch_name}
    for gguf_key, hf_key in adapter.config_keys.items():
        if value(gguf_key) is not None:
            raw[hf_key] = value(gguf_key)
    missing = [f"{arch_name}.{k}" for k, hf in adapter.config_keys.items() if hf in _REQUIRED and hf not in raw]
    if missing:
        raise ValueError(f"metadata lacks {', '.join(missing)}")
    for key, (tensor, dim) in adapter.config_from_tensor_shapes.items():
        if key not in raw and tensor in tensors:
            raw[key] = tensors[tensor][dim]
    for key, default in adapter.defaults.items():
        raw.setdefault(key, default)
    for key, tensor in adapter.flags_from_tensors.items():
        raw[key] = tensor in tensors
    if adapter.tied_embeddings_when_no_output:
        raw["tie_word_embeddings"] = "output.weight" not in tensors
    raw["vocab_size"] = vocab_size if vocab_size is not None else value("vocab_size")
    if raw["vocab_size"] is None:
        raise ValueError("no vocabulary size: neither tokenizer.ggml.tokens nor "
                         f"{arch_name}.vocab_size is present")

    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    rotary = value("rope.dimension_count")
    if rotary is not None and rotary != head_dim:
        raw["partial_rotary_factor"] = rotary / head_dim
    scaling = _rope_scaling(value)
    if adapter.llama3_rope_freqs and "rope_freqs.weight" in tensors:
        contexts = [value("rope.scaling.original_context_length") or 8192]
        scaling = llama3_rope_from_freqs(read_tensor("rope_freqs.weight"), float(raw.get("rope_theta", 10000.0)),
                                         head_dim, contexts) or scaling
    if scaling is not None:
        raw["rope_scaling"] = scaling
    for gguf_key, hf_key in (("tokenizer.ggml.bos_token_id", "bos_token_id"),
                             ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        if metadata(gguf_key) is not None:
            raw[hf_key] = int(metadata(gguf_key))
    raw["dtype"] = _FLOAT_FILE_TYPES.get(metadata("general.file_type"), "bfloat16")
    if adapter.config_hook:
        import inspect

        from cvllm.registry import load_target

        hook = load_target(adapter.config_hook)
        wants_values = "read_tensor" in inspect.signature(hook).parameters
        raw = hook(raw, value, tensors, read_tensor=read_tensor) if wants_values else hook(raw, value, tensors)
    return raw
