"""Engine settings (what ``LLM(...)`` and ``cvserve`` flags turn into)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # not imported at run time: cvserve's API process starts the engine core before torch loads
    import torch

    from cvllm.engine.scheduler import ScheduledBatch


# "fp8" and "fp8_e4m3" (vLLM's names) are the same: e4m3 values, one scale per layer for K and one for V
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass
class EngineConfig:
    model: Any                                  # a path or repo id, or an opened cvllm Checkpoint
    dtype: str | torch.dtype = "auto"
    backend: str | None = None                  # None: the available backend of highest priority (Backend.priority)
    block_size: int = 16
    max_num_seqs: int | None = None             # None: the backend's default
    max_num_batched_tokens: int | None = None   # token budget per step; None: the backend's default
    max_model_len: int | None = None            # None: from the config, capped to what the KV pool holds
    prefill_chunk_size: int = 0                 # most prompt tokens one sequence computes per step (0: budget)
    num_kv_blocks: int | None = None            # explicit KV pool size; overrides the memory settings
    kv_cache_memory: int | None = None          # bytes for the KV pool
    kv_fraction: float | None = None            # fraction of free memory after loading
    gpu_memory_utilization: float | None = None  # vLLM's: weights + KV cache stay under this share of total memory
    enable_prefix_caching: bool = True
    seed: int = 0
    fake_step_ms: float | None = None           # no model: each step takes this long (measures the stack around it)
    isq: str | None = None                      # in-situ quantization of an unquantized checkpoint ("q4k", "q8_0" ...)
    kv_cache_dtype: str = "auto"                # "auto": the model's dtype; "fp8": e4m3 with per-layer scales
    enforce_eager: bool = False                 # no CUDA graphs: every step launches its kernels one by one
    tensor_parallel_size: int = 1               # ranks the model is split over, on all nodes (engine/tensor_parallel/)
    device_ids: tuple[int, ...] | None = None   # local rank r's device (--d 0,1); None: local rank r takes device r
    # MoE experts split whole over the tensor-parallel ranks (E / N each) instead of sharding each expert over them;
    # attention and dense MLPs stay tensor-parallel. No effect at tensor_parallel_size 1 (layers/expert_parallel.py)
    enable_expert_parallel: bool = False
    # K experts of every MoE layer in host memory, copied in when routed (layers/expert_offload.py); no CUDA graphs
    num_experts_offload_per_rank: int = 0
    async_scheduling: bool | None = None        # launch step N+1 before reading N's tokens; None: on except on CPU
    # {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": M, "prompt_lookup_min": m, ...} or
    # {"method": "draft_model", "model": PATH, "num_speculative_tokens": K} (engine/speculative.py,
    # engine/draft_model.py); None: no speculative decoding
    speculative_config: dict | None = None
    # Multi-node (tensor_parallel/multinode.py, node.py): this process is node 0's rank 0; other nodes run a launcher
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None              # rank 0's host, as every node reaches it
    master_port: int | None = None
    # Tests only: called with each scheduled batch before it runs; what it raises fails that step as a failing model
    # would (cvllm.testing.faults). Picklable, so it reaches a spawned engine core.
    fault_injector: Callable[[ScheduledBatch], None] | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.num_experts_offload_per_rank < 0:
            raise ValueError(f"num_experts_offload_per_rank must be >= 0, got {self.num_experts_offload_per_rank}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be positive, got {self.tensor_parallel_size}")
        if self.num_nodes < 1 or not 0 <= self.node_rank < self.num_nodes:
            raise ValueError(f"node_rank must be in 0..num_nodes-1 with num_nodes >= 1, got node_rank "
                             f"{self.node_rank}, num_nodes {self.num_nodes}")
        if self.tensor_parallel_size % self.num_nodes:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} (all ranks) does not split evenly "
                             f"over {self.num_nodes} nodes")
        if self.num_nodes > 1 and not (self.master_addr and self.master_port):
            raise ValueError("more than one node needs master_addr and master_port: where the other nodes reach node "
                             "0 (--master-addr, --master-port, or torchrun's MASTER_ADDR/MASTER_PORT)")
        if self.device_ids is not None:
            self.device_ids = tuple(self.device_ids)
            per_node = self.tensor_parallel_size // self.num_nodes
            if len(self.device_ids) != per_node:
                raise ValueError(f"device_ids {list(self.device_ids)}: one device per tensor-parallel rank of a node "
                                 f"({per_node})")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks", "kv_cache_memory"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.speculative_config is not None:
            from cvllm.engine.speculative import SpeculativeConfig

            SpeculativeConfig.from_dict(self.speculative_config)   # its errors now, not in the engine core
        for name in ("kv_fraction", "gpu_memory_utilization"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
