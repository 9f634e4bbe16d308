"""A GGUF file (or split set) as a cvllm ``Checkpoint``, and the "gguf" quantizer that runs it.

Opening reads only the header and metadata: the HF config comes from the model plugin's
``GGUFArchitecture``, tensor names from gguf's ``TensorNameMap``. Loading then goes:

1. ``build_model`` asks the "gguf" quantizer (``gguf_linear_methods``) for each linear layer's
   method: a ``GGUFLinearMethod`` of the layer's GGML type, or None for float weights. The
   quantizer notes which checkpoint modules became quantized.
2. The weight iterator yields those modules' weights as raw blocks, ``<module>.qweight`` (uint8
   rows, q/k rows un-permuted as bytes), and every other tensor (embeddings, norms, an untied LM
   head, float linears) dequantized to float32 under its HF name.
3. Stacked expert tensors (3-D ``ffn_*_exps``, [experts, out, in]) go to ``FusedMoE`` under the module
   name without ``.weight`` (``model.layers.0.mlp.experts.gate_proj``), the stacked form its loader takes.
   The quantizer's ``moe_method`` keeps a layer's quantized experts in their blocks (raw uint8
   [experts, rows, row bytes], moe.GGUFExpertsMethod: low-bit planes on CUDA, dequantized once elsewhere)
   where gate and up share a type and the experts are not split on the intermediate dimension (tensor
   parallelism without expert parallelism); other experts are dequantized at load, to float32 on the
   exact path (a float32 engine) and to the engine's dtype otherwise.

Each tensor is yielded lazy (``lazy_weights.py``): a tensor-parallel rank's loaders narrow it to the rank's
shard, and only that part of the file is copied, un-permuted and dequantized; world size 1 reads each whole.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cvllm import plugins
from cvllm.checkpoint.base import Checkpoint, CheckpointError
from cvllm.checkpoint.lazy import LazyTensor
from cvllm.config import ConfigError, model_config_from_dict
from cvllm.layers.fused_moe_methods import FusedMoEMethod
from cvllm.layers.quantization import LinearMethod, LinearMethodFactory
from cvllm.sampling_params import SamplingParams
from cvllm_gguf.adapters import expand_blocks, hf_config, tensor_names
from cvllm_gguf.dequant import dequantize
from cvllm_gguf.int4planes import planes_usable
from cvllm_gguf.lazy_weights import blocks, dequantized, stacked_blocks
from cvllm_gguf.linear_method import GGUFLinearMethod
from cvllm_gguf.mixed import MixedGGUFLinearMethod
from cvllm_gguf.moe import GGUFExpertsMethod
from cvllm_gguf.quant_types import FLOAT_DTYPES, GGMLType
from cvllm_gguf.reader import GGUFFile, TensorInfo, open_gguf_files
from cvllm_gguf.table_method import GGUFTableMethod, gpu_planes_possible

logger = logging.getLogger(__name__)
QUANTIZED_TABLES_ENV = "CVLLM_GGUF_QUANTIZED_TABLES"   # embedding / LM head from the GGUF blocks (table_method.py)

# A GGUF has no generation_config.json. llama.cpp's server samples with these when neither the request nor
# the file says otherwise (common_params_sampling in its common/common.h), so cvllm does too: plain
# SamplingParams (temperature 1, no truncation) make small quantized models ramble.
LLAMA_CPP_SAMPLING: dict[str, float | int] = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
# The sampling metadata newer llama.cpp converters copy from generation_config.json (gguf-py's
# Keys.General.SAMPLING_*), by the SamplingParams field each one sets; llama.cpp lets them override its defaults.
GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                      "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
                      "general.sampling.penalty_repeat": "repetition_penalty"}


@dataclass(slots=True)
class GGUFWeight:
    file: GGUFFile
    info: TensorInfo
    hf_name: str  # "model.layers.0.self_attn.q_proj.weight"
    permute_heads: int | None  # llama.cpp permuted these rows in this many heads
    shape: tuple[int, ...]  # the Hugging Face shape it loads as (a 1-D single row becomes [1, n])

    @property
    def stacked(self) -> bool:
        """A 3-D tensor of stacked experts, [experts, out, in]."""
        return len(self.shape) == 3


@dataclass(slots=True)
class GGUFQuantConfig:
    path: Path
    weight_types: dict[str, GGMLType]  # HF module name -> GGML type of its ".weight"
    quantized_modules: set[str] = field(default_factory=set)  # filled by the linear-method factory
    expert_types: dict[str, GGMLType] = field(default_factory=dict)  # stacked experts' module name -> GGML type
    quantized_experts: set[str] = field(default_factory=set)  # those loading as blocks (the factory's moe_method)
    dtype: torch.dtype | None = None  # the engine's, set by the linear-method factory; None: float32


def open_gguf_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    files = open_gguf_files(path)
    meta = files[0]
    arch_name = meta.value("general.architecture")
    if not isinstance(arch_name, str):
        raise CheckpointError(f"{path}: no general.architecture in the GGUF metadata")
    registry = plugins.gguf_architectures()
    if arch_name not in registry:
        declared = ", ".join(registry.names()) or "none"
        raise CheckpointError(f"{path}: GGUF architecture '{arch_name}' is not declared by any installed model "
                              f"plugin (declared: {declared})")
    adapter = registry.get(arch_name)
    located = {t.name: (file, t) for file in files for t in file.tensors}

    def read_float(name: str) -> torch.Tensor:
        file, info = located[name]
        return dequantize(file.raw(info), info.qtype, info.shape, name)

    try:
        shapes = {name: info.shape for name, (_, info) in located.items()}
        raw_config = hf_config(arch_name, adapter, meta.value, shapes, meta.array_length("tokenizer.ggml.tokens"),
                               read_float)
        config = model_config_from_dict(raw_config, source=str(path))
    except (ValueError, ConfigError) as e:
        raise CheckpointError(f"{path}: {e}") from None
    _check_embedding_rows(path, located, config.vocab_size)
    weights = _plan_weights(path, arch_name, adapter, located, config)
    quant = GGUFQuantConfig(path, {w.hf_name.removesuffix(".weight"): w.info.qtype
                                   for w in weights if w.hf_name.endswith(".weight")},
                            expert_types={w.hf_name: w.info.qtype for w in weights if w.stacked})
    tokenizer, stop_ids = _tokenizer(meta)
    return Checkpoint(
        path=path,
        config=config,
        weight_iterator=partial(iterate_weights, weights, quant),
        tokenizer=tokenizer,
        generation_config={**sampling_defaults(meta), **({"eos_token_id": sorted(stop_ids)} if stop_ids else {})},
        quant_method="gguf",
        format="gguf",
        quant_config=quant,
    )


def sampling_defaults(meta: GGUFFile) -> dict[str, float | int]:
    """The file's general.sampling.* values over llama.cpp's defaults, as generation_config.json keys. A value
    SamplingParams would refuse (top_p 0 ...) is left out with a warning rather than failing every request."""
    defaults = dict(LLAMA_CPP_SAMPLING)
    for key, name in GGUF_SAMPLING_KEYS.items():
        value = meta.value(key)
        if value is None:
            continue
        value = int(value) if name == "top_k" else float(value)
        try:
            SamplingParams(**{name: value})
        except ValueError as e:
            logger.warning("%s: ignoring %s = %r: %s", meta.path.name, key, value, e)
            continue
        defaults[name] = value
    return defaults


def _check_embedding_rows(path: Path, located: dict[str, tuple[GGUFFile, TensorInfo]], vocab_size: int) -> None:
    embedding = located.get("token_embd.weight")
    if embedding is not None and embedding[1].shape[0] != vocab_size:
        raise CheckpointError(f"{path}: token_embd.weight has {embedding[1].shape[0]} rows but the vocabulary "
                              f"has {vocab_size} tokens")


def _plan_weights(path: Path, arch_name: str, adapter: Any, located: dict[str, tuple[GGUFFile, TensorInfo]],
                  config: Any) -> list[GGUFWeight]:
    """Each GGUF tensor's HF name and whether its rows need un-permuting; unknown tensors are skipped."""
    names = tensor_names(arch_name, adapter, config.num_hidden_layers)
    ignored = set(expand_blocks(adapter.ignored_tensors, config.num_hidden_layers))
    single_rows = set(expand_blocks(adapter.single_row_weights, config.num_hidden_layers))
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    weights, skipped = [], []
    for name, (file, info) in located.items():
        base, _, suffix = name.rpartition(".")
        if base in ignored:
            continue
        if base not in names:
            skipped.append(name)
            continue
        permute = heads.get(base.rpartition(".")[2]) if adapter.permute_qk else None
        hf_name = f"{names[base]}.{suffix}"
        shape = (1, *info.shape) if hf_name in single_rows and len(info.shape) == 1 else info.shape
        if len(shape) == 3:
            hf_name = names[base]  # stacked experts: FusedMoE's loader takes the module name
        weights.append(GGUFWeight(file, info, hf_name, permute, shape))
    if skipped:
        logger.warning("%s: %d GGUF tensors have no %s name and are not loaded: %s", path, len(skipped),
                       adapter.hf_architecture, ", ".join(skipped[:8]) + (" ..." if len(skipped) > 8 else ""))
    return weights


def iterate_weights(weights: list[GGUFWeight],
                    quant: GGUFQuantConfig) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    expert_dtype = quant.dtype or torch.float32
    for kept, what in ((True, "stay in their blocks"), (False, f"are dequantized to {expert_dtype} at load")):
        stacked = [w for w in weights if w.stacked and (w.hf_name in quant.quantized_experts) == kept]
        if stacked:
            types = ", ".join(sorted({w.info.qtype.name for w in stacked}))
            logger.info("%s: %d stacked expert tensors (%s) %s", quant.path.name, len(stacked), types,
                        what.replace("torch.", ""))
    for weight in weights:
        if weight.stacked:
            kept = weight.hf_name in quant.quantized_experts
            yield weight.hf_name, stacked_blocks(weight) if kept else dequantized(weight, expert_dtype)
            continue
        module, _, suffix = weight.hf_name.rpartition(".")
        if suffix == "weight" and module in quant.quantized_modules:
            yield f"{module}.qweight", blocks(weight)   # uint8 [rows, bytes_per_row]
        else:
            yield weight.hf_name, dequantized(weight)


def gguf_linear_methods(checkpoint: Checkpoint, dtype: torch.dtype) -> LinearMethodFactory:
    """The "gguf" quantizer: each linear layer gets a ``GGUFLinearMethod`` of its weights' GGML type
    ("exact" float32 compute when the engine runs in float32, else "fast"); float weights stay unquantized."""
    quant: GGUFQuantConfig = checkpoint.quant_config
    mode = "exact" if dtype == torch.float32 else "fast"
    # the weight iterator dequantizes stacked experts for this dtype: float32 (exact) or the engine's
    quant.dtype = dtype

    def method_for(layer: str, sources: Sequence[str]) -> LinearMethod | None:
        types = {source: quant.weight_types[source] for source in sources if source in quant.weight_types}
        if not types or all(t in FLOAT_DTYPES for t in types.values()):
            return None
        if len(set(types.values())) > 1:
            # llama.cpp's *_M mixes (e.g. Q6_K attn_v beside Q4_K q/k) fuse into one layer here: each part keeps
            # its own blocks (mixed.py)
            if len(types) != len(sources):
                listed = ", ".join(f"{source.rpartition('.')[2]} {t.name}" for source, t in types.items())
                logger.warning("%s: layer '%s' fuses weights of different GGML types (%s) and float ones: loading "
                               "it dequantized", quant.path.name, layer, listed)
                return None
            quant.quantized_modules.update(types)
            return MixedGGUFLinearMethod([types[source] for source in sources], mode)
        quant.quantized_modules.update(types)
        return GGUFLinearMethod(next(iter(types.values())), mode)

    warned: set[str] = set()   # one warning per reason, not one per MoE layer

    def moe_method(name: str, module: nn.Module) -> FusedMoEMethod | None:
        """A FusedMoE layer's quantized experts stay in their blocks (moe.py), or None: dequantized at load."""
        stems = [f"{name}.{proj}" for proj in ("gate_proj", "up_proj", "down_proj")]
        gate, up, down = (quant.expert_types.get(stem) for stem in stems)
        if None in (gate, up, down) or {gate, up, down} & set(FLOAT_DTYPES):
            return None
        if gate != up or module.shard_size > 1:
            why = (f"gate {gate.name} and up {up.name} differ" if gate != up
                   else "tensor parallelism splits each expert (--enable-expert-parallel keeps them whole)")
            if why not in warned:
                warned.add(why)
                logger.warning("%s: experts (from '%s' on) are dequantized at load: %s", quant.path.name, name, why)
            return None
        quant.quantized_experts.update(stems)
        return GGUFExpertsMethod(gate, down)

    def embedding_method(name: str, table: nn.Module) -> GGUFTableMethod | None:
        """The token embedding or an untied LM head kept in its blocks (table_method.py): on the CPU's fast path
        as int4 planes, where CUDA is present as the GPU's low-bit planes (table_method.gpu_planes_possible); None:
        loaded dequantized."""
        qtype = quant.weight_types.get(name)
        # CVLLM_GGUF_QUANTIZED_TABLES=0: a dequantized copy (an A/B). The planes' logits come from core's C kernel
        # with float32 scales and sums (int4planes.py): nearer the exact ones than a bf16 copy's
        if os.environ.get(QUANTIZED_TABLES_ENV, "1") == "0" or qtype is None or qtype in FLOAT_DTYPES:
            return None
        cpu_planes = mode == "fast" and not torch.cuda.is_available() \
            and planes_usable(qtype, table.num_embeddings, table.embedding_dim)
        if not (cpu_planes or gpu_planes_possible(table, qtype)):
            return None
        quant.quantized_modules.add(name)
        return GGUFTableMethod(qtype, mode)

    method_for.moe_method = moe_method
    method_for.embedding_method = embedding_method
    return method_for


def _tokenizer(meta: GGUFFile) -> tuple[Any, set[int]]:
    """The tokenizer rebuilt from metadata and llama.cpp's end-of-generation ids; none for a weights-only file."""
    if meta.value("tokenizer.ggml.model") is None:
        return None, set()
    from cvllm_gguf import tokenizer as gguf_tokenizer

    fields = gguf_tokenizer.read_gguf_fields(meta.metadata, "tokenizer.")
    try:
        return gguf_tokenizer.tokenizer_from_gguf(fields), set(gguf_tokenizer.stop_token_ids(fields))
    except CheckpointError as e:
        raise CheckpointError(f"{meta.path}: {e}") from None
