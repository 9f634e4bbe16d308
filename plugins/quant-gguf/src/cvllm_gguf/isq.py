"""In-situ quantization (``--isq q4k``, ``LLM(..., isq="q8_0")``): an unquantized checkpoint's linear
weights become GGML blocks while they load.

The engine asks the "isq" quantizer for a method per linear layer (the checkpoint it passes carries
the requested type as ``quant_config``). Each ``ISQLinearMethod`` holds a uint8 parameter named
``weight``, so the checkpoint's float tensors find it by their usual names; its loader quantizes
every shard (q/k/v, gate/up) as it arrives, so no layer ever holds its float weight whole. A lazy
checkpoint tensor (a tensor-parallel rank's, cvllm/checkpoint/lazy.py) becomes lazy blocks: the layer
narrows them to its rank's rows or whole blocks of columns, and only that part is read and quantized.
After loading, the blocks move to ``qweight`` and ``GGUFLinearMethod`` prepares its compute form
(on CUDA repacked into low-bit planes that Triton kernels compute with; on CPU int4pack for
Q4_0/Q4_1, bf16 or exact fp32 otherwise), exactly as for a GGUF file.

An untied LM head is quantized too, to the type llama.cpp's quantizer gives a model's output tensor (``head_type``:
Q6_K, or Q8_0 for a Q8_0 model), so that ``--isq q4k`` makes what a Q4_K GGUF file holds; it computes from its
blocks as a GGUF file's head does (table_method.py: on CUDA the low-bit planes; a Llama-3-8B head in Q6_K is 431 MB
read a step instead of 1,051 MB of bf16). ``CVLLM_ISQ_LM_HEAD=float`` keeps it float (candle-vllm's choice),
``CVLLM_ISQ_LM_HEAD=TYPE`` picks another type. Embeddings (a head tied to them too) and norms stay as they are.
K-quants need rows of whole 256-element super-blocks; a layer whose input is not a multiple of 256 falls back to the
type llama.cpp uses, and a layer that fits no block stays unquantized.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from cvllm.checkpoint.base import Checkpoint
from cvllm.checkpoint.lazy import Box, LazyTensor, lazy_aware, materialize
from cvllm.layers.embedding import ParallelLMHead
from cvllm.layers.quantization import LinearMethod, LinearMethodFactory, is_moe_router
from cvllm.progress import Progress
from cvllm_gguf.linear_method import GGUFLinearMethod, Mode
from cvllm_gguf.quant_types import FORMATS, GGMLType, UnsupportedQuantType, resolve_qtype, row_bytes
from cvllm_gguf.quantize import quantize
from cvllm_gguf.table_method import GGUFTableMethod

logger = logging.getLogger(__name__)

ISQ_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0,
             GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)

LM_HEAD_ENV = "CVLLM_ISQ_LM_HEAD"   # an untied LM head's type ("float": left float; unset: head_type's)

# llama.cpp's choice for a tensor whose rows do not split into 256-element super-blocks
FALLBACKS = {GGMLType.Q2_K: GGMLType.Q4_0, GGMLType.Q3_K: GGMLType.Q4_0, GGMLType.Q4_K: GGMLType.Q5_0,
             GGMLType.Q5_K: GGMLType.Q5_1, GGMLType.Q6_K: GGMLType.Q8_0}


def isq_type_names() -> list[str]:
    return [t.name.lower() for t in ISQ_TYPES]


def parse_isq_type(name: str) -> GGMLType:
    """``"q4k"``, ``"q4_k"`` or ``"Q4_K"``; anything else is an error that lists the types."""
    try:
        qtype = resolve_qtype(name)
    except UnsupportedQuantType:
        qtype = None
    if qtype not in ISQ_TYPES:
        raise ValueError(f"unknown in-situ quantization type {name!r}; choose one of {', '.join(isq_type_names())}")
    return qtype


def head_type(requested: GGMLType) -> GGMLType:
    """The type llama.cpp's quantizer gives the output tensor of a model quantized to ``requested``: Q8_0 for Q8_0,
    else Q6_K (its LM head keeps more bits than the layers: next-token choice is sensitive to it, and at 6.6 bits a
    weight it is still 40% of a bf16 head's bytes); layer_type's fallback (Q6_K -> Q8_0) where rows are not whole
    super-blocks, as there."""
    return GGMLType.Q8_0 if requested == GGMLType.Q8_0 else GGMLType.Q6_K


def layer_type(requested: GGMLType, in_features: int) -> GGMLType | None:
    """The type a layer of ``in_features`` inputs gets: the requested one, its fallback, or None
    (unquantized) when even 32-element blocks do not fit."""
    for qtype in (requested, FALLBACKS.get(requested)):
        if qtype is not None and in_features % FORMATS[qtype].block_size == 0:
            return qtype
    return None


@dataclass(slots=True)
class ISQProgress:
    """Counts layers as their last shard is quantized; logs the summary after the last layer."""
    requested: GGMLType
    layers: int = 0
    bytes_before: int = 0  # the quantized layers' weights at the engine dtype
    bytes_after: int = 0
    fallbacks: dict[str, GGMLType] = field(default_factory=dict)
    head: GGMLType | None = None   # the LM head's type, where it is quantized too (counted with the layers)
    phase: Progress | None = None

    def shard_started(self) -> None:
        # the phase starts with the first shard, not when the layers were built: its time is the quantizing
        if self.phase is None:
            self.phase = Progress(logger, f"Quantizing to {self.requested.name}", "quantized", "linear layers",
                                  self.layers)

    def layer_done(self) -> None:
        self.phase.update()
        if self.phase.count == self.layers:
            fell_back = f" ({len(self.fallbacks)} fell back)" if self.fallbacks else ""
            head = f" (the LM head to {self.head.name})" if self.head else ""
            self.phase.finish(f" to {self.requested.name}{head}, {self.bytes_before / 2**20:.1f} MiB -> "
                              f"{self.bytes_after / 2**20:.1f} MiB{fell_back}")


class ISQLinearMethod(GGUFLinearMethod):
    """A ``GGUFLinearMethod`` whose loader takes float weights and quantizes them."""

    def __init__(self, requested: GGMLType, mode: Mode, name: str, shards: int, progress: ISQProgress):
        super().__init__(requested, mode)
        self.requested, self.name, self.shards, self.progress = requested, name, shards, progress
        self.shards_loaded = 0

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        qtype = layer_type(self.requested, input_size)
        if qtype is None:  # llama.cpp keeps such a tensor in F16; here it stays in the engine dtype
            logger.info("isq: layer '%s' has %d inputs, which fit no GGML block: left unquantized",
                        self.name, input_size)
            self.qtype = None
            layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
            return
        if qtype != self.requested:
            logger.info("isq: layer '%s' has %d inputs, not a multiple of %d: %s instead of %s", self.name,
                        input_size, FORMATS[self.requested].block_size, qtype.name, self.requested.name)
            self.progress.fallbacks[self.name] = qtype
        _check_implemented(qtype)
        self.qtype = qtype
        weight = nn.Parameter(torch.empty(output_size, row_bytes(qtype, input_size), dtype=torch.uint8),
                              requires_grad=False)
        weight.weight_loader = lazy_aware(partial(self.weight_loader, layer))
        layer.weight = weight  # the name the checkpoint's float tensors load into
        layer.qtype = qtype
        layer.gguf_shape = (output_size, input_size)
        layer.gguf_compute = None
        self.progress.layers += 1
        self.progress.bytes_before += output_size * input_size * dtype.itemsize
        self.progress.bytes_after += weight.numel()

    def weight_loader(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor | LazyTensor,
                      shard_id: int | str | None = None) -> None:
        if loaded.is_floating_point():
            self.progress.shard_started()
            # quantized where the layer lives (a GPU quantizes much faster), one shard at a time
            if isinstance(loaded, LazyTensor) and loaded.dim() == 2:
                loaded = quantized_lazily(loaded, self.qtype, param.device)
            else:
                loaded = quantize(materialize(loaded).to(param.device), self.qtype)
            self.shards_loaded += 1
            if self.shards_loaded == self.shards:
                self.progress.layer_done()
        super().weight_loader(layer, param, loaded, shard_id)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.qtype is None:
            return
        if "weight" in layer._parameters:  # from here on the layout is GGUFLinearMethod's
            blocks = layer._parameters.pop("weight")
            layer.qweight = nn.Parameter(blocks.data, requires_grad=False)
            layer.register_buffer("weight", torch.empty(0, device=blocks.device), persistent=False)
        super().process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.qtype is None:
            return F.linear(x, layer.weight, bias)
        return super().apply(layer, x, bias)


class ISQTableMethod(ISQLinearMethod, GGUFTableMethod):
    """An untied LM head quantized as it loads (head_type, or CVLLM_ISQ_LM_HEAD), then computed as a GGUF file's
    head is."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        super().create_weights(layer, input_size, output_size, dtype)
        layer.table_dtype = dtype
        self.progress.head = self.qtype


def quantized_lazily(floats: LazyTensor, qtype: GGMLType, device: torch.device) -> LazyTensor:
    """The blocks ``quantize`` would make of a 2-D float LazyTensor, uint8 [rows, bytes_per_row], computed only for
    the part they are narrowed to: rows, and whole blocks of columns (a split inside a block is refused). Rows and
    blocks are quantized independently of each other, so a part's bytes equal that part of the whole's."""
    fmt = FORMATS[qtype]
    rows, columns = floats.shape

    def read(box: Box) -> torch.Tensor:
        (row, count), (byte, nbytes) = box
        if byte % fmt.type_size or nbytes % fmt.type_size:
            raise ValueError(f"bytes {byte}..{byte + nbytes} of {qtype.name} rows split a block")
        start, width = byte // fmt.type_size * fmt.block_size, nbytes // fmt.type_size * fmt.block_size
        part = floats.narrow(0, row, count).narrow(1, start, width).materialize()
        return quantize(part.to(device), qtype)

    return LazyTensor((rows, row_bytes(qtype, columns)), torch.uint8, read)


@functools.cache
def _check_implemented(qtype: GGMLType) -> None:
    # K-quant encoders arrive one by one: a type without one fails here, before any weight loads
    try:
        with torch.device("cpu"):  # called inside the engine's meta-device build
            quantize(torch.zeros(1, FORMATS[qtype].block_size, dtype=torch.float32), qtype)
    except NotImplementedError:
        raise NotImplementedError(f"in-situ quantization to {qtype.name} is not implemented yet") from None


def isq_linear_methods(checkpoint: Checkpoint, dtype: torch.dtype) -> LinearMethodFactory:
    """The "isq" quantizer: ``checkpoint.quant_config`` is the requested type ("q4k", "q8_0" ...)."""
    requested = parse_isq_type(str(checkpoint.quant_config))
    mode: Mode = "exact" if dtype == torch.float32 else "fast"
    progress = ISQProgress(requested)
    head_choice = os.environ.get(LM_HEAD_ENV, "").strip().lower()
    if head_choice and head_choice != "float":
        parse_isq_type(head_choice)   # a misspelt type fails here, before anything loads

    def method_for(layer: str, sources: Sequence[str]) -> LinearMethod | None:
        if is_moe_router(layer):   # llama.cpp's quantize keeps ffn_gate_inp as it is too
            return None
        return ISQLinearMethod(requested, mode, layer, len(sources), progress)

    def moe_method(layer: str, module: nn.Module):
        """MoE experts are quantized too, once loaded (moe.py)."""
        from cvllm_gguf.moe import ISQFusedMoEMethod

        return ISQFusedMoEMethod(requested, layer_type)

    def embedding_method(name: str, table: nn.Module) -> ISQTableMethod | None:
        """An untied LM head in llama.cpp's type for it (or the one CVLLM_ISQ_LM_HEAD names; "float": none); the
        token embedding, and a head tied to it, stay float."""
        if not isinstance(table, ParallelLMHead) or head_choice == "float":
            return None
        qtype = parse_isq_type(head_choice) if head_choice else head_type(requested)
        # (counted with the linear layers in the quantizing phase's bar and summary)
        logger.info("isq: LM head '%s' quantized to %s (%s=float keeps it float)", name, qtype.name, LM_HEAD_ENV)
        return ISQTableMethod(qtype, mode, name, 1, progress)

    method_for.moe_method = moe_method
    method_for.embedding_method = embedding_method
    return method_for
