"""The Backend interface: what the engine needs from a device, and nothing more.

Everything the engine or a layer reads from a backend is declared here with its type and default; a backend plugin
subclasses ``Backend`` and overrides what differs (docs/plugins.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from cvllm.distributed import tp_size
from cvllm.engine.ngram_device import advance_ngram, lagged_fixup
from cvllm.forward_context import ForwardContext, current_forward_context

Tensor = torch.Tensor
# (positions, q, k, v, cos_sin, head_dim, k_cache, v_cache, slot_mapping) -> rotated q
RotaryWriteKv = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int, Tensor, Tensor, Tensor], Tensor]


class GraphedDecode(Protocol):
    """What ``Backend.wrap_decode`` returns: the decode-only forward pass, replayed from captured graphs."""

    def __call__(self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor: ...

    def prefill_chunk(self, input_ids: Tensor, positions: Tensor, ctx: ForwardContext) -> Tensor:
        """A lone sequence's prefill chunk (every row's logits), replayed where a chunk graph holds it."""

    def capture_all(self) -> None:
        """Capture the graphs; called once, after the KV cache exists."""


class Backend:
    name: str = "base"
    # When no backend is named (--backend), the available one of highest priority runs (ties: by name): the CPU
    # backend has 0, the CUDA backend 100
    priority: int = 0
    device: torch.device = torch.device("cpu")
    dist_backend: str = "gloo"          # torch.distributed backend for tensor parallelism
    default_dtype: torch.dtype = torch.float32
    # engine settings the user left unset (--max-num-seqs, --max-num-batched-tokens, --async-scheduling)
    default_max_num_seqs: int = 16
    default_max_num_batched_tokens: int = 2048
    # launch a step before the last one's tokens are read back: pays where the device runs beside the host
    default_async_scheduling: bool = False
    # torch CPU threads for the engine's process once the model is loaded (None: leave torch's default). A device
    # backend's host work is many small tensor ops each step: a pool of threads adds wake-ups to the larger ones
    # and spins between steps on cores the server and its clients need (OMP_NUM_THREADS, when set, wins)
    host_threads: int | None = None
    # Decode-only forward passes read nothing back to the host: the backend captures them in graphs (CUDA) or
    # queues the next step behind them. Layers whose plain form syncs (MoE's per-expert counts) take a sync-free
    # form on such a backend.
    sync_free_decode: bool = False
    # what one speculative draft adds to a decode step's time, as a fraction of it (how many drafts pay:
    # engine/speculative.py draft_length). A device whose step reads the weights once whatever the rows pays little
    # for a draft; a CPU computes every row's products, so each draft costs a share of the step
    draft_token_cost: float = 0.1
    # n-gram speculation's default for drafts looked up on the device (SpeculativeConfig.device_drafts), and the
    # function that does it after a verify step (ngram_device.advance_ngram's contract; a kernel may replace it)
    device_drafts: bool = False
    advance_ngram = staticmethod(advance_ngram)
    lagged_fixup = staticmethod(lagged_fixup)   # a lagged step's inputs put in place (ngram_device.py)

    # Optional fused kernels. The layers call one when the backend of the forward pass in progress
    # has it (not None) and run their torch code otherwise, so model code never changes; a fused
    # kernel must return the numbers of that torch code (same roundings) in new tensors. ``fused_add_rms_norm``
    # and ``rotary`` may return None for inputs they do not take (the CPU's C kernels: small bf16 decode rows
    # only); the layer then runs its torch code. Set plain functions on the instance (or as staticmethods): a
    # function class attribute would bind ``self``.
    #   fused_add_rms_norm(x, residual, weight, eps): RMSNorm.forward (layers/layernorm.py); residual
    #       may be None: ``weight * rms_norm(x)``, else ``(weight * rms_norm(x + residual), x + residual)``
    #   rotary(positions, q, k, cos_sin, head_dim) -> (q, k): RotaryEmbedding's neox rotation of every
    #       head of q [T, ...] and k (or None) by the rows ``positions`` of the table cos_sin
    #       [max_position, rotary_dim] (cos ‖ sin, in the activations' dtype); an interleaved rotary (GPT-J
    #       pairs 2i, 2i + 1) calls it with ``interleaved=True``
    #   rotary_write_kv(positions, q, k, v, cos_sin, head_dim, k_cache, v_cache, slot_mapping) -> q: the
    #       Attention layer's rotary(positions, q, k) then write_kv(k, v, ...) with the rotated k; returns the
    #       rotated q (layers/attention.py); an FP8 cache's call adds ``scales=(k_scale, v_scale)`` as write_kv's
    #       and one with per-head norms (Qwen3) ``qk_norm=(q_weight, k_weight, eps)``: RMSNorm over each head of q
    #       and k before the rotation (q_norm and k_norm share eps); an interleaved rotary adds ``interleaved=True``
    #   silu_and_mul(x [..., 2I]) -> [..., I]: SiluAndMul (layers/activation.py)
    #   (with ``takes_feeds``, fused_add_rms_norm, fused_add_rms_norm_plus_one, silu_and_mul and gelu_and_mul
    #   also take ``feeds=layer``: the linear layer the model hands the output to next, where it says so
    #   (RMSNorm.feeds, SiluAndMul.feeds, GeluAndMul.feeds, layers/decoder.feed), and ``attention``'s layer may
    #   carry one (Attention.feeds); the backend may make that layer's input form beside the output in the same
    #   launch: CUDA's int8 activations of a low-bit GEMV)
    #   gelu_and_mul(x [..., 2I], approximate) -> [..., I]: GeluAndMul, ``approximate`` "none" or "tanh"
    #   fused_add_rms_norm_plus_one(x, residual, weight, eps): GemmaRMSNorm.forward (scales by 1 + weight, in fp32,
    #       rounded once), residual as fused_add_rms_norm's
    #   fused_add_layer_norm(x, residual, weight, bias, eps): LayerNorm.forward (bias may be None), residual as
    #       fused_add_rms_norm's; a 2-D weight [H, D] (bias None) normalises each head of x [T, H, D] with its own
    #       weight (layers/layernorm.layer_norm_per_head)
    #   linear(x, weight, bias): ``F.linear`` of an unquantized linear layer and of the LM head
    #       (layers/quantization.dense), for a backend with its own matmul for some shapes (CUDA: Triton GEMVs)
    #   fused_moe(hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k], local_ids [T, k]) -> [T, H]:
    #       UnquantizedFusedMoEMethod's weighted sum of the experts (silu), ids local to this rank (E: another
    #       rank's expert, adding nothing), without reading anything back to the host (CUDA: a grouped GEMM)
    #   route_experts(logits [T, E], bias (float32 [E]) or None, rule) -> (float32 [T, k], int64 [T, k]): a MoE
    #       router's top-k choice by a layers/moe_routing.TopkRouting rule (its route_topk), best expert first
    #   argmax(x [B, V]) -> int64 [B]: ``x.argmax(dim=-1)`` (first index of the max; NaN ranks highest), for
    #       the sampler (the engine hands it over; no forward pass is in progress when it samples)
    argmax: Callable[[Tensor], Tensor] | None = None
    takes_feeds: bool = False
    #   argmax_reported(x [B, V]) -> (int64 [B], int64 [B]): ``argmax`` and the ids the host is told, -1 where a row
    #       holds NaN or +inf (the sampler's greedy path then needs no check of its own)
    argmax_reported: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None
    fused_add_rms_norm: Callable[[Tensor, Tensor | None, Tensor, float], Tensor | tuple[Tensor, Tensor]] | None = None
    fused_add_rms_norm_plus_one: Callable[[Tensor, Tensor | None, Tensor, float],
                                          Tensor | tuple[Tensor, Tensor]] | None = None
    fused_add_layer_norm: Callable[[Tensor, Tensor | None, Tensor, Tensor | None, float],
                                   Tensor | tuple[Tensor, Tensor]] | None = None
    gelu_and_mul: Callable[[Tensor, str], Tensor] | None = None
    fused_moe: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor] | None = None
    linear: Callable[[Tensor, Tensor, Tensor | None], Tensor] | None = None
    route_experts: Callable[[Tensor, Tensor | None, Any], tuple[Tensor, Tensor]] | None = None
    rotary: Callable[[Tensor, Tensor, Tensor | None, Tensor, int], tuple[Tensor, Tensor | None]] | None = None
    rotary_write_kv: RotaryWriteKv | None = None
    silu_and_mul: Callable[[Tensor], Tensor] | None = None

    @classmethod
    def is_available(cls) -> bool:
        """Cheap check, called while choosing a backend."""
        raise NotImplementedError

    @classmethod
    def bind_device(cls, index: int) -> None:
        """Make device ``index`` this process's, before an instance is built (``--d``; tensor parallelism: one
        device per rank). The CPU is one device that every rank shares: nothing to do."""

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of the memory the KV cache would come from."""
        raise NotImplementedError

    def default_kv_cache_bytes(self, free: int) -> int:
        """The KV pool when no size is asked for (--mem, --kv-fraction, --gpu-memory-utilization), given the free
        memory after loading the model: 90% of it."""
        return int(free * 0.9)

    def empty_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                       values: bool) -> torch.Tensor:
        """An uninitialised K (or, ``values``, V) cache of logical shape ``shape`` ([num_blocks, block_size,
        *layer.kv_cache_shape()]). Only this backend's write_kv and attention read it, so it may lay the tensor out in
        memory as its kernels read it best (its strides: CUDA keeps an FP8 V cache by key); contiguous here."""
        return torch.empty(shape, dtype=dtype, device=device)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Store this step's K/V ``[T, Hkv, D]`` at ``slot_mapping`` (block * block_size + offset). An FP8 cache
        (float8_e4m3fn) comes with ``scales`` (K's and V's per KV head, float32 [Hkv] on the device): store
        ``x / scale`` saturated to ±448 (layers/kv_fp8.py); ``attention`` then reads ``layer.k_scale`` and
        ``layer.v_scale``."""
        raise NotImplementedError

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: Any,
                  layer: Any) -> torch.Tensor:
        """Varlen queries ``[T, H, D]`` over the paged cache; prefill chunks and decodes in one call."""
        raise NotImplementedError

    def prepare(self, ctx: ForwardContext) -> None:
        """Once per forward pass, before the first layer: derive from ``ctx`` what every layer's attention shares,
        into ``ctx.backend_data`` (the CPU backend's plan of decode and prefill rows). The model runner calls it
        inside the forward pass, so a decode step replayed from a graph (``wrap_decode``) ran it when the graph was
        captured: there it may only launch device work on the context's tensors, which the graph replays. Nothing
        by default."""

    def wrap_decode(self, forward: Callable[[Tensor, Tensor, ForwardContext], Tensor], max_num_seqs: int,
                    max_blocks_per_seq: int, verify: tuple[int, int] | None = None,
                    chunk_tokens: int = 0) -> GraphedDecode | None:
        """Graphs of the decode-only forward pass ``forward(input_ids, positions, ctx) -> logits`` for up to
        ``max_num_seqs`` rows (CUDA graphs), or None (the default): decode steps run ``forward`` as it is.
        ``verify``: (most sequences, largest Q): also the speculative verify steps where every sequence runs Q
        queries and every row gives logits (Q from 2 up), which reach the same ``forward``. ``chunk_tokens``: also
        a lone sequence's prefill chunks of up to that many tokens (one sequence, every row's logits returned)."""
        return None

    def start_readback(self, tensors: list[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
        """Start copying a step's results (sampled ids, logprobs) to the host; the returned function waits
        for them and returns CPU tensors. A device backend must not make the wait include work queued after
        this call (the next step, under async scheduling): a plain ``.cpu()`` waits for the whole stream."""
        return lambda: [t.cpu() for t in tensors]

    def synchronize(self) -> None:
        pass

    def record_event(self) -> Any:
        """An event in the device's queue of work, now: ``a.elapsed_time(b)`` is the device's milliseconds from
        ``a`` to ``b`` once both ran. None (the default) where the device has none (the CPU's work is the host's).
        Only step observers that ask for device timing call it (engine/observers.py)."""
        return None

    def empty_cache(self) -> None:
        """Return memory that freed tensors left in the framework's cache to the device (after a shutdown)."""

    # Collectives of tensor parallelism, over the ranks' process group (torch.distributed with ``dist_backend``);
    # identities at world size 1. The layers reach them through cvllm.distributed.

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum of every rank's ``x``, in place; returns ``x``."""
        if tp_size() > 1:
            torch.distributed.all_reduce(x)
        return x

    def all_gather(self, x: Tensor, dim: int = -1) -> Tensor:
        """Every rank's ``x`` concatenated along ``dim``, in rank order. One output tensor (not a list of them):
        the form a CUDA graph can capture."""
        size = tp_size()
        if size == 1:
            return x
        gathered = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(gathered, x.contiguous())   # rank r's x in rows [r * len(x), (r + 1) * len(x))
        dim = dim % x.dim()
        return gathered.view(size, *x.shape).movedim(0, dim).flatten(dim, dim + 1)

    def broadcast(self, x: Tensor, src: int = 0) -> Tensor:
        """Rank ``src``'s ``x`` on every rank, in place (rank 0's step inputs); returns ``x``."""
        if tp_size() > 1:
            torch.distributed.broadcast(x, src)
        return x


# torch 2.13 renamed all_gather_into_tensor (and deprecated the old name); older torch has only that
_all_gather_single = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor


def forward_backend() -> Backend | None:
    """The backend running the current forward pass, or None outside one (a layer called on its own runs its torch
    code): the layers read its fused kernels here."""
    ctx = current_forward_context()
    return None if ctx is None else ctx.backend
