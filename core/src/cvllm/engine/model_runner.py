"""Builds the model, owns the KV cache, turns a scheduled batch into one flat varlen forward pass."""

from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import contextmanager

import torch
from torch import nn

from cvllm import plugins
from cvllm.checkpoint.base import Checkpoint, CheckpointError
from cvllm.distributed import tp_size
from cvllm.engine.scheduler import ScheduledBatch
from cvllm.engine.step_inputs import PreviousTokens, build_host_step, to_device
from cvllm.forward_context import ForwardContext, forward_context
from cvllm.layers import kv_fp8
from cvllm.layers.attention import Attention
from cvllm.layers.embedding import takes_table_method
from cvllm.layers.fused_moe import FusedMoE
from cvllm.layers.quantization import attach_linear_methods, isq_quantizer
from cvllm.progress import Progress

logger = logging.getLogger(__name__)


@contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def materialize(model: nn.Module, device: torch.device) -> None:
    """``to_empty`` on a meta-built model, keeping tied parameters tied and parameter attributes
    (``weight_loader``) in place: to_empty makes new Parameter objects and loses both."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    attributes: dict[int, dict] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, name))
                attributes[id(param)] = dict(vars(param))
    model.to_empty(device=device)
    for key, places in owners.items():
        first_module, first_name = places[0]
        param = getattr(first_module, first_name)
        for attr, value in attributes[key].items():
            setattr(param, attr, value)
        for module, name in places[1:]:
            setattr(module, name, param)


def attach_quantization(model: nn.Module, checkpoint: Checkpoint, dtype: torch.dtype, isq: str | None = None,
                        make_factory=None) -> None:
    """A quantized checkpoint's linear layers get the methods of the quantizer registered under its
    ``quant_method``: ``factory = quantizer(checkpoint, dtype)``, then ``factory(layer, sources)`` per layer.

    ``isq`` (in-situ quantization, e.g. "q4k") asks the "isq" quantizer (or the "isq-<type>" one a plugin registers,
    e.g. "isq-gptq") to quantize an unquantized checkpoint while it loads; it sees the checkpoint with
    ``quant_config`` set to the requested type."""
    if isq is not None:
        if checkpoint.quant_method is not None:
            raise CheckpointError(f"isq {isq}: {checkpoint.path} is already quantized ({checkpoint.quant_method}); "
                                  f"in-situ quantization needs an unquantized checkpoint")
        name = isq_quantizer(isq, plugins.quantizers())
        if make_factory is None and name not in plugins.quantizers():
            raise CheckpointError(f"isq {isq}: in-situ quantization needs the cvllm-gguf plugin (no 'isq' "
                                  f"quantizer is installed)")
        checkpoint = dataclasses.replace(checkpoint, quant_method=name, quant_config=isq)
    if checkpoint.quant_method is None:
        return
    make_factory = make_factory or plugins.quantizers().get(checkpoint.quant_method)
    factory = make_factory(checkpoint, dtype)
    changed = attach_linear_methods(model, factory)
    # a factory may also give MoE layers a method (its ``moe_method(name, layer)``; None: the layer stays float)
    moe_method = getattr(factory, "moe_method", None)
    moe = 0
    if moe_method is not None:
        for name, module in model.named_modules():
            if isinstance(module, FusedMoE) and (method := moe_method(name, module)) is not None:
                module.set_moe_method(method)
                moe += 1
    # and the token embedding and LM head (its ``embedding_method(name, table)``; None: the table stays float)
    embedding_method = getattr(factory, "embedding_method", None)
    tables = []
    if embedding_method is not None:
        for name, module in model.named_modules():
            if takes_table_method(module) and (method := embedding_method(name, module)) is not None:
                module.set_table_method(method)
                tables.append(name)
    logger.info("%s quantization: %d linear layers%s%s", checkpoint.quant_method, changed,
                f", {moe} MoE layers" if moe else "", f", tables {', '.join(tables)}" if tables else "")


def build_model(checkpoint: Checkpoint, backend, dtype: torch.dtype, isq: str | None = None,
                model_class=None, make_factory=None) -> nn.Module:
    """gpt-fast's order: build on the meta device, attach quantization methods (``isq``: quantize an
    unquantized checkpoint while loading), materialise on the backend, load by name. ``model_class`` and
    ``make_factory``: the architecture and quantizer already resolved (tensor-parallel workers)."""
    model_class = model_class or plugins.architectures().get(checkpoint.architecture)
    with torch.device("meta"), _default_dtype(dtype):
        model = model_class(checkpoint.config)
        attach_quantization(model, checkpoint, dtype, isq, make_factory)
    materialize(model, backend.device)
    expected = {name for name, _ in model.named_parameters()}
    started = time.perf_counter()
    # Counted as the checkpoint's tensors, not the model's parameters the loader returns: q/k/v and
    # gate/up load into one fused parameter each, and the count logged must be the one the bar showed.
    # A tensor-parallel rank takes the tensors lazy (checkpoint/lazy.py): its layers' loaders read only its shard.
    weights = checkpoint.weights(lazy=tp_size() > 1)
    with torch.no_grad(), Progress(logger, "Loading weights", "loaded", "weights") as progress:
        try:
            loaded = model.load_weights(progress.track(weights, nbytes=lambda weight: weight[1].nbytes))
        except CheckpointError as e:
            if e.tensor is None:   # (the error names its file already)
                raise
            raise CheckpointError(f"{checkpoint.file_of(e.tensor)}: {e}", e.tensor) from None
    missing = expected - set(loaded)
    if missing:
        raise CheckpointError(f"{checkpoint.path}: weights missing from the checkpoint: "
                              f"{', '.join(sorted(missing)[:8])}{' ...' if len(missing) > 8 else ''}")
    _process_after_loading(model)
    for module in model.modules():   # a module that derives something from its loaded weights (MLA's absorption)
        hook = getattr(module, "after_weights_loaded", None)
        if callable(hook):
            hook()
    logger.info("%s ready on %s in %.1f s, dtype %s", checkpoint.architecture, backend.name,
                time.perf_counter() - started, dtype)
    return model.eval()


def _process_after_loading(model: nn.Module) -> None:
    """Give each quantized layer its compute form (repacking, dequantizing): seconds on a big model."""
    quantized = [module for module in model.modules() if getattr(module, "quant_method", None) is not None]
    if not quantized:
        return
    with Progress(logger, "Preparing quantized layers", "prepared", "quantized layers", len(quantized)) as progress:
        for module in quantized:
            module.quant_method.process_weights_after_loading(module)
            progress.update()


class ModelRunner:
    def __init__(self, model: nn.Module, backend, block_size: int, dtype: torch.dtype,
                 kv_cache_dtype: torch.dtype | None = None):
        self.model = model
        self.backend = backend
        self.device = backend.device
        self.block_size = block_size
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype   # float8_e4m3fn: an FP8 cache (layers/kv_fp8.py)
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        # a layer that reads the sequences' lengths on the host (ForwardContext.seq_lens_cpu) in verify steps (MLA's
        # prefill path) rules out lagged steps on a GPU, whose host lengths are a step behind (ngram_device.py)
        self.reads_host_lengths = any(getattr(m, "reads_host_lengths", False) for m in model.modules())
        self.num_blocks = 0
        self.decode_forward = self.decode_logits   # decode-only steps; the backend may wrap it (CUDA graphs)
        self.chunk_forward = self.decode_logits    # a lone sequence's last prefill chunk (is_decode_path)
        self.graph_chunk_tokens = 0   # the longest such chunk the graphs take (enable_decode_graphs)
        # where the graphs read their inputs, if the backend's graphs offer such a place (``input_staging``, whose
        # ``stage(host)`` puts a step that fits there: step_inputs.to_device)
        self.staging = None
        self._kv_scales_pending = True

    def kv_bytes_per_block(self) -> int:
        per_token = sum(layer.kv_cache_tensors() * torch.Size(layer.kv_cache_shape()).numel()
                        for layer in self.attention_layers)
        return per_token * self.block_size * self.kv_cache_dtype.itemsize

    def allocate_kv_cache(self, num_blocks: int) -> None:
        for layer in self.attention_layers:
            shape = (num_blocks, self.block_size, *layer.kv_cache_shape())
            # empty, not zeros: filling gigabytes costs seconds at start-up (every page touched), and no kernel lets
            # a slot past a sequence's length reach its output (masked loads; the CPU reference zeroes such values,
            # since 0 * NaN = NaN), which tests check with a cache full of NaN
            layer.k_cache = self.backend.empty_kv_cache(shape, self.kv_cache_dtype, self.device, values=False)
            layer.v_cache = layer.k_cache if layer.kv_cache_tensors() == 1 else self.backend.empty_kv_cache(
                shape, self.kv_cache_dtype, self.device, values=True)
            if kv_fp8.is_fp8(layer.k_cache):
                kv_fp8.init_scales(layer, self.device)
        self.num_blocks = num_blocks

    def enable_decode_graphs(self, max_num_seqs: int, max_model_len: int, verify_seqs: int = 0,
                             verify_query_len: int = 1, chunk_tokens: int = 0) -> None:
        """Let the backend capture decode-only steps, LM head included (CUDA graphs), once the KV cache exists;
        speculative verify steps of up to ``verify_seqs`` sequences of 2..``verify_query_len`` queries each; and a
        lone sequence's prefill chunks of up to ``chunk_tokens`` tokens (what is_decode_path admits)."""
        verify = (verify_seqs, verify_query_len) if verify_seqs and verify_query_len > 1 else None
        graphs = self.backend.wrap_decode(self.decode_logits, max_num_seqs, -(-max_model_len // self.block_size),
                                          verify, chunk_tokens)
        if graphs is not None:
            with torch.inference_mode():
                graphs.capture_all()
            self.decode_forward, self.chunk_forward = graphs, graphs.prefill_chunk
            self.graph_chunk_tokens = chunk_tokens
            self.staging = getattr(graphs, "input_staging", None)

    def decode_path(self, batch: ScheduledBatch, ctx: ForwardContext, all_logits: bool = False,
                    extra_indices: torch.Tensor | None = None) -> bool:
        """Whether ``batch`` takes ``decode_forward`` (is_decode_path with this runner's graphs). A lone prefill
        chunk does not while an FP8 cache still waits for the first prefill to set its scales (layers/kv_fp8.py):
        a graph replays no calibration."""
        chunk_tokens = self.graph_chunk_tokens
        if chunk_tokens and self._kv_scales_pending:   # (looked at until the scales are set, then never again)
            self._kv_scales_pending = any(getattr(layer, "kv_scales_pending", False)
                                          for layer in self.attention_layers)
            chunk_tokens = 0 if self._kv_scales_pending else chunk_tokens
        return is_decode_path(batch, ctx, all_logits, extra_indices, chunk_tokens)

    def decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Logits of every row (in a decode-only step every row is a sequence's last token and samples), in the
        model's dtype: the sampler makes the fp32 copy only where it needs one (a greedy argmax does not)."""
        with forward_context(ctx):  # the lm_head too may take the backend's matmul
            self.backend.prepare(ctx)   # here, inside what a graph captures (Backend.prepare)
            return self.model.compute_logits(self.model(input_ids, positions))

    def prepare(self, batch: ScheduledBatch, previous_tokens: PreviousTokens | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, ForwardContext, torch.Tensor]:
        """Flat varlen tensors for the batch on the device (step_inputs.py).

        ``previous_tokens``: the step still in flight; a sequence whose last token (a lagged one: every token of its
        chunk) is among its ids takes it from there (async scheduling)."""
        if previous_tokens is None:
            return to_device(build_host_step(batch, self.block_size, None), self.backend, self.block_size, None,
                             self.staging)
        host = build_host_step(batch, self.block_size, previous_tokens.rows)
        return to_device(host, self.backend, self.block_size, previous_tokens.ids, self.staging,
                         previous_tokens.positions)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, all_logits: bool = False, extra_indices: torch.Tensor | None = None,
            previous_tokens: PreviousTokens | None = None) -> torch.Tensor:
        """Logits (fp32) of the last token of every sequence that samples, followed by those of the flat
        batch rows in ``extra_indices`` (prompt logprobs); or, with ``all_logits``, of every token. A
        decode-only step's come in the model's dtype (decode_logits)."""
        return self.forward(batch, self.prepare(batch, previous_tokens), all_logits, extra_indices)

    @torch.inference_mode()
    def hidden_states(self, batch: ScheduledBatch) -> torch.Tensor:
        """fp32 final hidden states of every token of ``batch``: the model's forward (its last norm included)
        without the LM head, what embeddings pool."""
        input_ids, positions, ctx, logits_indices = self.prepare(batch)
        return self.forward_prepared(input_ids, positions, ctx, logits_indices, False, False, hidden_only=True)

    def forward(self, batch: ScheduledBatch, inputs: tuple[torch.Tensor, torch.Tensor, ForwardContext, torch.Tensor],
                all_logits: bool = False, extra_indices: torch.Tensor | None = None) -> torch.Tensor:
        """``run`` after ``prepare``: the forward pass on prepared inputs, under inference mode (the executor
        calls the two halves itself to time them apart)."""
        input_ids, positions, ctx, logits_indices = inputs
        decode_path = self.decode_path(batch, ctx, all_logits, extra_indices)
        if extra_indices is not None:
            logits_indices = torch.cat([logits_indices, extra_indices.to(logits_indices.device)])
        return self.forward_prepared(input_ids, positions, ctx, logits_indices, decode_path, all_logits)

    def forward_prepared(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                         logits_indices: torch.Tensor, decode_path: bool, all_logits: bool,
                         hidden_only: bool = False) -> torch.Tensor:
        """The forward pass once the batch is tensors: what every tensor-parallel rank runs (the workers get these
        from rank 0, tensor_parallel/messages.py). ``logits_indices`` includes any prompt-logprob rows;
        ``hidden_only``: every token's fp32 final hidden state instead of logits (embeddings)."""
        if decode_path:
            if input_ids.shape[0] == logits_indices.shape[0]:   # decode and verify steps: every row samples
                return self.decode_forward(input_ids, positions, ctx)
            return self.chunk_forward(input_ids, positions, ctx)[logits_indices]   # a lone chunk: its last row
        with forward_context(ctx):
            self.backend.prepare(ctx)
            hidden = self.model(input_ids, positions)
            if hidden_only:
                return hidden.float()
            if not all_logits:
                hidden = hidden[logits_indices]
            return self.model.compute_logits(hidden).float()


def is_decode_path(batch: ScheduledBatch, ctx: ForwardContext, all_logits: bool,
                   extra_indices: torch.Tensor | None, chunk_tokens: int = 0) -> bool:
    """Every sequence samples and runs the same number of queries Q: a decode-only step (Q = 1), a speculative
    verify step where each sequence verifies Q - 1 drafts (every row gives logits), or the last prefill chunk of a
    lone sequence of at most ``chunk_tokens`` tokens (its last row's logits). Such steps take ``decode_forward``
    (graphs on devices that have them)."""
    if all_logits or extra_indices is not None or len(batch.sample_indices) != len(batch.seqs):
        return False
    if ctx.is_decode_only:
        return True
    if len(batch.seqs) == 1 and not batch.num_decodes and not batch.num_draft_chunk_tokens:
        return ctx.max_query_len <= chunk_tokens
    if batch.num_decodes or not batch.num_draft_chunk_tokens:
        return False
    q = ctx.max_query_len   # every sequence a decode with Q - 1 drafts (its chunk: its last token and the drafts)
    return all(n == q and seq.num_drafts == q - 1 for seq, n in zip(batch.seqs, batch.num_tokens))
