"""Rank 0 of tensor parallelism: start the workers, join the process group (gloo on the CPU; gloo for host
messages and NCCL for tensors on CUDA), and send each step to the workers before running rank 0's own shard of it.

The engine's process is rank 0: it builds its shard like any rank, and its runner is wrapped (``BroadcastingRunner``)
so that ``InProcessExecutor`` drives it unchanged (sampling, penalties, prompt logprobs stay on rank 0: the LM
head gathers the full logits there). World size 1 never reaches this module.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from cvllm import plugins
from cvllm.distributed import set_tensor_parallel
from cvllm.engine.errors import EngineBrokenError
from cvllm.engine.executor import InProcessExecutor
from cvllm.engine.model_runner import ModelRunner, build_model
from cvllm.engine.step_inputs import build_host_step, to_device
from cvllm.engine.tensor_parallel import messages, rendezvous
from cvllm.engine.tensor_parallel.watchdog import DEATH_GRACE_S, WorkerWatch, stall_timeout_s
from cvllm.engine.tensor_parallel.worker import WorkerSpec
from cvllm.layers.expert_offload import offload_experts
from cvllm.layers.kv_fp8 import kv_cache_torch_dtype
from cvllm.layers.quantization import isq_quantizer
from cvllm.registry import target_name

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0   # workers import torch and load their shard; gloo's own collectives time out after this
# the device half of the process group, instead of the backend's own (NCCL): "gloo" lets several ranks share one GPU
# (NCCL refuses that), so one GPU can check sharded CUDA inference; it cannot be captured in CUDA graphs
DEVICE_COMM_ENV = "CVLLM_TP_DEVICE_COMM"


def check_tensor_parallel_size(config, size: int) -> None:
    """The heads must split evenly: say which sizes would."""
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    fits = [n for n in range(1, heads + 1) if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)]
    if size not in fits:
        raise ValueError(f"tensor_parallel_size {size} does not split the model's {heads} attention heads "
                         f"({kv_heads} KV heads) evenly; sizes that would: {', '.join(map(str, fits))}")


class TensorParallelGroup:
    """The worker processes and the process group, from start to shutdown. This node's workers (local ranks
    1..ranks_per_node-1) are this process's children; other nodes' are their launchers' (node.py)."""

    def __init__(self, spec: WorkerSpec, device: torch.device | None = None, master_addr: str | None = None,
                 master_port: int | None = None):
        """``device``: rank 0's (NCCL binds its communicator to it). ``master_addr``/``master_port``: where the
        other nodes reach rank 0's store (None: this node only, a port the OS picks)."""
        self.size = spec.world_size
        self.dist_backend = spec.dist_backend
        stall_s = stall_timeout_s()   # a malformed CVLLM_TP_STALL_TIMEOUT_S fails before anything starts
        self.store, init_method = rendezvous.host_store(master_addr, master_port, self.size, spec.timeout_s)
        spec = dataclasses.replace(spec, init_method=init_method)
        if spec.ranks_per_node < self.size:
            rendezvous.publish_spec(self.store, spec)   # other nodes' launchers read it (node.py)
        self.processes = rendezvous.spawn_workers(spec, [(rank, rank) for rank in range(1, spec.ranks_per_node)])
        self.local = dict(enumerate(self.processes, start=1))
        self.watch = WorkerWatch(self.processes, stall_s)   # deaths, and hangs during a step (watchdog.py)
        self.closed = False
        atexit.register(self.close)   # and the workers' parent watch: none outlives this process
        try:
            rendezvous.wait_for(self.store, rendezvous.joined_key, range(1, self.size), self.local, spec.timeout_s,
                                "joining the process group")
            dist.init_process_group(spec.dist_backend, store=self.store, rank=0, world_size=self.size,
                                    timeout=timedelta(seconds=spec.timeout_s),
                                    device_id=messages.eager_init_device(spec.dist_backend, device))
        except BaseException:
            self.close()
            raise
        set_tensor_parallel(0, self.size, spec.enable_expert_parallel)

    def wait_ready(self, timeout_s: float) -> None:
        """Each worker's shard is built, or the error of the first that failed."""
        rendezvous.wait_for(self.store, rendezvous.status_key, range(1, self.size), self.local, timeout_s,
                            "building its shard")

    def check(self, grace_s: float = 0.0) -> None:
        """Raise EngineBrokenError if a worker has died or hung: the next collective would wait for it until gloo's
        timeout."""
        self.watch.check(grace_s)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        self.watch.close()
        sent = False
        try:
            if dist.is_initialized() and all(p.is_alive() for p in self.processes):
                messages.send_op(messages.SHUTDOWN)
                sent = True
        except RuntimeError as e:   # a worker died meanwhile: the kill below ends the others
            logger.warning("tensor-parallel shutdown message failed: %s", e)
        for process in self.processes:
            process.join(timeout=10 if sent else 0)   # no group, or no message: nothing will end them but a kill
            if process.is_alive():
                process.kill()
                process.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store = None
        set_tensor_parallel(0, 1)


class BroadcastingRunner:
    """Rank 0's ModelRunner: each forward pass is first sent to the workers (messages.send_step)."""

    def __init__(self, runner: ModelRunner, group: TensorParallelGroup):
        self.inner, self.group = runner, group
        self._sent_host = None   # prepare's host step and its packed bytes, until forward sends them

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.group.check()
        messages.send_op(messages.ALLOCATE_KV, num_blocks)
        self.inner.allocate_kv_cache(num_blocks)

    def memory(self) -> tuple[int, int]:
        self.group.check()
        messages.send_op(messages.MEMORY)
        return messages.least_memory(self.inner.backend)

    def enable_decode_graphs(self, max_num_seqs: int, max_model_len: int, verify_seqs: int = 0,
                             verify_query_len: int = 1, chunk_tokens: int = 0) -> None:
        """Every rank captures the same graphs at once: the warm-up passes run the collectives for real, and each
        captured graph replays its rank's part of them (NCCL inside CUDA graphs)."""
        if self.inner.device.type != "cpu" and self.group.dist_backend.endswith(":gloo"):
            logger.warning("tensor parallel: no CUDA graphs, the device collectives run over gloo (%s)",
                           self.group.dist_backend)
            return
        self.group.check()
        messages.send_op(messages.CAPTURE_GRAPHS, max_num_seqs, max_model_len, verify_seqs, verify_query_len,
                         chunk_tokens)
        self.inner.enable_decode_graphs(max_num_seqs, max_model_len, verify_seqs, verify_query_len, chunk_tokens)

    def prepare(self, batch, previous_tokens=None):
        host = build_host_step(batch, self.inner.block_size, previous_tokens[1] if previous_tokens else None)
        inputs = to_device(host, self.inner.backend, self.inner.block_size,
                           previous_tokens[0] if previous_tokens else None)
        self._sent_host = (host, host.packed)   # the bytes rank 0 uploads are the bytes the workers get
        return inputs

    @torch.inference_mode()
    def run(self, batch, all_logits: bool = False, extra_indices=None, previous_tokens=None) -> torch.Tensor:
        return self.forward(batch, self.prepare(batch, previous_tokens), all_logits, extra_indices)

    def forward(self, batch, inputs, all_logits: bool = False, extra_indices=None) -> torch.Tensor:
        decode_path = self.inner.decode_path(batch, inputs[2], all_logits, extra_indices)
        return self._forward(inputs, decode_path, all_logits, extra_indices)

    @torch.inference_mode()
    def hidden_states(self, batch) -> torch.Tensor:
        """Every rank runs the model without its LM head (the hidden states are whole on each rank after the last
        all-reduce); rank 0's are the embeddings' input."""
        return self._forward(self.prepare(batch), False, False, None, hidden_only=True)

    def _forward(self, inputs, decode_path: bool, all_logits: bool, extra_indices, hidden_only: bool = False):
        input_ids, positions, ctx, logits_indices = inputs
        (host, packed), self._sent_host = self._sent_host, None
        if extra_indices is not None:
            logits_indices = torch.cat([logits_indices, extra_indices.to(logits_indices.device)])
        self.group.check()
        with self.group.watch.step():
            try:
                messages.send_step(host, packed, input_ids, extra_indices, decode_path, all_logits, hidden_only)
                return self.inner.forward_prepared(input_ids, positions, ctx, logits_indices, decode_path, all_logits,
                                                   hidden_only)
            except Exception as e:
                # a worker's death or hang is the error to report, not gloo's lost connection; any other failure
                # part-way leaves the workers inside collectives rank 0 will never join, so no step can follow
                self.group.check(grace_s=DEATH_GRACE_S)
                raise EngineBrokenError(f"a tensor-parallel step failed part-way, leaving the ranks out of step: "
                                        f"{e}") from e


class TensorParallelExecutor(InProcessExecutor):
    # the workers' step inputs come from rank 0's packed bytes; a lagged step's are fixed up on rank 0's device only
    supports_device_drafts = False

    def __init__(self, runner: BroadcastingRunner, sampler, backend, vocab_size: int):
        super().__init__(runner, sampler, backend, vocab_size)
        self.group = runner.group

    def memory(self) -> tuple[int, int]:
        return self.runner.memory()

    def sentinels(self) -> list[int]:
        """Ready when a worker process ends: the engine core's idle wait watches them (engine_process/process.py)."""
        return self.group.watch.sentinels()

    def check(self) -> None:
        """A worker's sentinel is ready: raise EngineBrokenError naming it and how it ended (its exit status shows
        a moment after the sentinel)."""
        self.group.check(grace_s=DEATH_GRACE_S)

    def shutdown(self) -> None:
        super().shutdown()
        self.group.close()


def build_tensor_parallel(checkpoint, backend, dtype: torch.dtype, config) -> BroadcastingRunner:
    """Start ``config.tensor_parallel_size - 1`` workers and build rank 0's shard; returns rank 0's runner."""
    size = config.tensor_parallel_size
    check_tensor_parallel_size(checkpoint.config, size)
    dist_backend = messages.process_group_backend(backend, os.environ.get(DEVICE_COMM_ENV))
    per_node = size // config.num_nodes
    device_ids = config.device_ids or tuple(range(per_node))
    if "nccl" in dist_backend and len(set(device_ids)) < per_node:
        raise ValueError(f"device ids {list(device_ids)}: NCCL needs a device of its own for each rank")
    quant = isq_quantizer(config.isq, plugins.quantizers()) if config.isq else checkpoint.quant_method
    spec = WorkerSpec(
        checkpoint=dataclasses.replace(checkpoint, tokenizer=None),   # workers never tokenize
        model_class=target_name(plugins.architectures().spec(checkpoint.architecture)),
        backend_class=target_name(type(backend)),
        quantizer=target_name(plugins.quantizers().spec(quant)) if quant else None,
        dtype=dtype, isq=config.isq, block_size=config.block_size, world_size=size, ranks_per_node=per_node,
        device_ids=device_ids, dist_backend=dist_backend,
        init_method="", timeout_s=STARTUP_TIMEOUT_S,   # init_method: set by TensorParallelGroup
        enable_expert_parallel=config.enable_expert_parallel,
        num_experts_offload_per_rank=config.num_experts_offload_per_rank,
        kv_cache_dtype=kv_cache_torch_dtype(config.kv_cache_dtype, dtype))
    group = TensorParallelGroup(spec, backend.device, config.master_addr, config.master_port)
    try:
        model = build_model(checkpoint, backend, dtype, isq=config.isq)
        offload_experts(model, config.num_experts_offload_per_rank, backend.device)
        group.wait_ready(STARTUP_TIMEOUT_S)
    except BaseException:
        group.close()
        raise
    logger.info("tensor parallel: %d ranks on %d node(s) (%s), rank 0 in this process on %s", size,
                config.num_nodes, spec.dist_backend, backend.device)
    return BroadcastingRunner(ModelRunner(model, backend, config.block_size, dtype, spec.kv_cache_dtype), group)
