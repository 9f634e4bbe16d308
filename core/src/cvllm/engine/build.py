"""Assembling an engine from its settings: checkpoint, backend, model runner and sampler (the executor), KV pool,
graphs, scheduler. ``LLMEngine`` itself only takes the assembled parts."""

from __future__ import annotations

import logging
import os

import torch

from cvllm import plugins
from cvllm.backends.selection import select_backend
from cvllm.checkpoint.base import Checkpoint
from cvllm.config import resolve_dtype
from cvllm.engine.block_manager import BlockManager
from cvllm.engine.config import EngineConfig
from cvllm.engine.draft_model import build_draft
from cvllm.engine.executor import InProcessExecutor
from cvllm.engine.fake_runner import FakeModelRunner
from cvllm.engine.llm_engine import LLMEngine
from cvllm.engine.model_runner import ModelRunner, build_model
from cvllm.engine.sampler import Sampler
from cvllm.engine.scheduler import Scheduler, SchedulerConfig
from cvllm.engine.speculative import SpeculativeConfig
from cvllm.layers.expert_offload import offload_experts
from cvllm.layers.kv_fp8 import kv_cache_torch_dtype
from cvllm.startup import StartupPhases

logger = logging.getLogger(__name__)

# the longest prefill chunk of a lone sequence run in a CUDA graph (padded to 8, 16, 32 or 64 tokens): eagerly such a
# chunk costs the host ~1 ms a layer in launches, more than its kernels take on a GPU; 0: none (for A/B runs)
GRAPH_CHUNK_TOKENS = int(os.environ.get("CVLLM_GRAPH_CHUNK_TOKENS", "64"))


def build_engine(config: EngineConfig, imports_seconds: float | None = None) -> LLMEngine:
    """``imports_seconds``: what the process spent before creating the engine (the engine core's imports),
    reported as the first phase of the start-up line."""
    phases = StartupPhases(imports_seconds)
    # before anything loads: a refused setting fails at once, and pages rank 0 touches land on its NUMA node
    from cvllm.engine.tensor_parallel import multinode, numa

    multinode.check_engine_node(config.node_rank)
    numa.pin_rank(0, config.tensor_parallel_size // config.num_nodes)   # workers pin themselves (worker.py)
    # a path (opened by whichever plugin claims it), or a Checkpoint built in memory (benchmarks' random weights)
    model = config.model
    checkpoint = model if isinstance(model, Checkpoint) else plugins.open_checkpoint(model)
    phases.mark("checkpoint")
    backend = select_backend(config.backend, config.device_ids[0] if config.device_ids else None)
    dtype = resolve_dtype(config.dtype, checkpoint.config)
    if config.fake_step_ms is not None:
        runner = FakeModelRunner(checkpoint.config.vocab_size, config.block_size, config.fake_step_ms / 1000,
                                 checkpoint.eos_token_ids())
    elif config.tensor_parallel_size > 1:
        # imported here: world size 1 never loads torch.distributed's process-group code
        from cvllm.engine.tensor_parallel.executor import build_tensor_parallel

        runner = build_tensor_parallel(checkpoint, backend, dtype, config)
    else:
        model = build_model(checkpoint, backend, dtype, isq=config.isq)
        offload_experts(model, config.num_experts_offload_per_rank, backend.device)
        runner = ModelRunner(model, backend, config.block_size, dtype,
                             kv_cache_torch_dtype(config.kv_cache_dtype, dtype))
    # the backend's argmax kernels where it has them (None: torch's)
    sampler = Sampler(backend.argmax, backend.argmax_reported)
    draft = build_draft(config, checkpoint, backend, dtype)   # draft-model speculation's, else None
    executor = _executor(config, runner, sampler, backend, checkpoint.config.vocab_size, draft)
    phases.mark("weights")
    try:
        context_len = checkpoint.config.get("max_position_embeddings") or 2048
        if draft is not None and config.max_model_len is None and draft.max_model_len < context_len:
            logger.warning("max_model_len %d: the draft model's context", draft.max_model_len)
            context_len = draft.max_model_len
        max_model_len = config.max_model_len or context_len
        if max_model_len > context_len:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context "
                             f"(max_position_embeddings = {context_len})")
        if draft is not None and max_model_len > draft.max_model_len:
            raise ValueError(f"max_model_len {max_model_len} exceeds the draft model's context "
                             f"(max_position_embeddings = {draft.max_model_len})")
        max_num_seqs = config.max_num_seqs or backend.default_max_num_seqs
        num_blocks = kv_blocks(config, backend, executor.memory(), executor.kv_bytes_per_block(), max_model_len,
                               max_num_seqs)
        executor.allocate_kv_cache(num_blocks)
        phases.mark("KV cache")
        if num_blocks * config.block_size < max_model_len:
            logger.warning("max_model_len %d capped to %d: the KV pool holds only %d blocks",
                           max_model_len, num_blocks * config.block_size, num_blocks)
            max_model_len = num_blocks * config.block_size
        budget = config.max_num_batched_tokens or backend.default_max_num_batched_tokens
        # expert offload reads each step's routing back to the host: a graph could not replay that
        if not config.enforce_eager and config.fake_step_ms is None and not config.num_experts_offload_per_rank:
            # speculative verify steps too: a sequence's last token and its K drafts, in batches small enough to
            # speculate
            spec = SpeculativeConfig.from_dict(config.speculative_config)
            verify = (spec.disable_by_batch_size, spec.num_speculative_tokens + 1) if spec else (0, 1)
            # and a lone sequence's short prefill chunks (a short prompt, what the prefix cache left of a chat)
            chunk_tokens = min(GRAPH_CHUNK_TOKENS, budget, max_model_len)
            executor.capture_graphs(max_num_seqs, max_model_len, *verify, chunk_tokens)
        phases.mark("graphs")
        if backend.host_threads and "OMP_NUM_THREADS" not in os.environ \
                and torch.get_num_threads() != backend.host_threads:
            logger.info("torch CPU threads %d -> %d for the %s backend's host work (OMP_NUM_THREADS overrides)",
                        torch.get_num_threads(), backend.host_threads, backend.name)
            torch.set_num_threads(backend.host_threads)
        scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                            max_model_len=max_model_len, prefill_chunk_size=config.prefill_chunk_size),
            BlockManager(num_blocks, config.block_size, config.enable_prefix_caching))
        engine = LLMEngine(config, checkpoint, backend, dtype, executor, scheduler)
        torch.manual_seed(config.seed)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens%s), max_model_len %d, backend %s, dtype %s",
                    num_blocks, config.block_size, num_blocks * config.block_size,
                    ", fp8" if config.kv_cache_dtype != "auto" else "", max_model_len, backend.name, dtype)
        logger.info("engine started in %s", phases.summary())
        return engine
    except BaseException:
        executor.shutdown()   # tensor-parallel workers must not outlive a failed start
        raise


def _executor(config: EngineConfig, runner, sampler, backend, vocab_size: int, draft=None) -> InProcessExecutor:
    if config.tensor_parallel_size > 1 and config.fake_step_ms is None:
        from cvllm.engine.tensor_parallel.executor import TensorParallelExecutor

        return TensorParallelExecutor(runner, sampler, backend, vocab_size)
    return InProcessExecutor(runner, sampler, backend, vocab_size, draft)


def kv_blocks(config: EngineConfig, backend, memory: tuple[int, int], per_block: int, max_model_len: int,
              max_num_seqs: int) -> int:
    """KV blocks of ``per_block`` bytes: the number asked for, else what the memory settings leave room for in
    ``memory`` ((free, total) bytes after loading; under tensor parallelism, the tightest rank's)."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    free, total = memory
    if config.kv_cache_memory:
        budget = config.kv_cache_memory
    elif config.kv_fraction:
        budget = int(free * config.kv_fraction)
    elif config.gpu_memory_utilization:
        # measured after loading, so what is in use already includes the weights
        budget = int(config.gpu_memory_utilization * total) - (total - free)
    else:
        budget = backend.default_kv_cache_bytes(free)
    # More blocks than every sequence at full length could use is memory nobody touches.
    useful = max_num_seqs * -(-max_model_len // config.block_size)
    blocks = min(budget // per_block, useful)
    if blocks < 1:
        raise RuntimeError(f"no room for a KV cache: {budget} bytes available, {per_block} needed per block")
    return blocks
