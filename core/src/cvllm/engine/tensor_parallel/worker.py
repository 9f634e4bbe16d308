"""A tensor-parallel worker process (ranks 1..N-1): build this rank's shard of the model, then run each step's
forward pass as rank 0 sends it, until told to stop.

A worker finds no plugins: rank 0 sends it the resolved targets (``WorkerSpec``), and it imports only those.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """Everything a worker needs, pickled once when it is spawned."""
    checkpoint: Any             # cvllm Checkpoint without its tokenizer (its weight iterator is a picklable partial)
    model_class: str            # "module:Class" targets, resolved by rank 0's plugin registries
    backend_class: str
    quantizer: str | None
    dtype: Any                  # torch.dtype
    isq: str | None
    block_size: int
    world_size: int
    ranks_per_node: int         # the world is num_nodes x ranks_per_node; rank r is local rank r % ranks_per_node
    device_ids: tuple[int, ...]  # local rank l's device
    dist_backend: str           # the process group's: "gloo", or "cpu:gloo,cuda:nccl" (process_group_backend)
    init_method: str            # tcp://host:port of rank 0's store (rendezvous.py)
    timeout_s: float
    enable_expert_parallel: bool = False   # MoE experts split whole over the ranks (cvllm.distributed)
    num_experts_offload_per_rank: int = 0  # experts per MoE layer kept in host memory (layers/expert_offload.py)
    kv_cache_dtype: Any = None             # torch.dtype of the KV cache; None: dtype


def run_worker(spec: WorkerSpec, rank: int, local_rank: int, parent_pid: int) -> None:
    """The spawned process's target: rank ``rank`` of the world, ``local_rank`` on its node. It reports through rank
    0's store (rendezvous.py): "ready" once built, or the traceback of what failed."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s tp{rank} %(levelname)s %(name)s: %(message)s")
    _exit_with_parent(parent_pid)
    from cvllm.engine.tensor_parallel import rendezvous

    store = None
    try:
        store = rendezvous.join_store(spec.init_method, spec.world_size, spec.timeout_s)
        runner, backend = _build(spec, rank, local_rank, store)
    except BaseException:
        if store is None:
            traceback.print_exc()   # no store to report to: the exit itself is the report (rank 0 or the node's
        else:                       # launcher watches this process)
            store.set(rendezvous.status_key(rank), traceback.format_exc())
        sys.exit(1)
    store.set(rendezvous.status_key(rank), "ready")
    try:
        _serve(runner, backend, spec.block_size)
    except BaseException:
        # rank 0 gone or a failed step: rank 0 notices this process's exit (TensorParallelGroup.check)
        traceback.print_exc()
        os._exit(1)
    import torch.distributed as dist

    dist.destroy_process_group()


def _exit_with_parent(parent_pid: int) -> None:
    """A worker blocked in a collective would outlive a killed engine: leave when the parent is gone."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="cvllm-tp-parent-watch", daemon=True).start()


def _build(spec: WorkerSpec, rank: int, local_rank: int, store):
    from cvllm.engine.tensor_parallel.numa import pin_rank

    pin_rank(local_rank, spec.ranks_per_node)   # MAP_NUMA_NODE, inherited; first, so the shard's pages land there
    import torch
    import torch.distributed as dist

    from cvllm.distributed import set_tensor_parallel
    from cvllm.engine.model_runner import ModelRunner, build_model
    from cvllm.engine.tensor_parallel.messages import eager_init_device
    from cvllm.engine.tensor_parallel.rendezvous import joined_key
    from cvllm.layers.expert_offload import offload_experts
    from cvllm.registry import load_target

    torch.set_num_threads(1)   # ranks share the host's cores; rank 0 keeps its own setting
    backend_class = load_target(spec.backend_class)
    backend_class.bind_device(spec.device_ids[local_rank])
    backend = backend_class()
    # joined: the device is bound, so what follows is the group's rendezvous (rank 0 waits for every rank's key
    # first: a worker that failed before it is an error at once, not a timeout inside init_process_group)
    store.set(joined_key(rank), "1")
    dist.init_process_group(spec.dist_backend, store=store, rank=rank, world_size=spec.world_size,
                            timeout=timedelta(seconds=spec.timeout_s),
                            device_id=eager_init_device(spec.dist_backend, backend.device))
    set_tensor_parallel(rank, spec.world_size, spec.enable_expert_parallel)
    make_factory = load_target(spec.quantizer) if spec.quantizer else None
    model = build_model(spec.checkpoint, backend, spec.dtype, isq=spec.isq,
                        model_class=load_target(spec.model_class), make_factory=make_factory)
    offload_experts(model, spec.num_experts_offload_per_rank, backend.device)
    return ModelRunner(model, backend, spec.block_size, spec.dtype, spec.kv_cache_dtype), backend


def _serve(runner, backend, block_size: int) -> None:
    import torch
    import torch.distributed as dist

    from cvllm.engine.tensor_parallel import messages

    header = messages.new_header()
    with torch.inference_mode():
        while True:
            dist.broadcast(header, 0)
            op = int(header[0])
            if op == messages.STEP:
                runner.forward_prepared(*messages.receive_step(header, backend, block_size))
            elif op == messages.SHUTDOWN:
                return
            elif op == messages.ALLOCATE_KV:
                runner.allocate_kv_cache(*messages.op_args(header, 1))
            elif op == messages.MEMORY:
                messages.least_memory(backend)
            elif op == messages.CAPTURE_GRAPHS:
                runner.enable_decode_graphs(*messages.op_args(header, 5))
            else:
                raise RuntimeError(f"unknown tensor-parallel message {op}")
