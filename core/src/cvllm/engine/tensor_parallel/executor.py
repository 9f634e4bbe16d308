"""Rank 0 of tensor parallelism: start the workers, join the gloo group, and send each step to the workers before
running rank 0's own shard of it.

The engine's process is rank 0: it builds its shard like any rank, and its runner is wrapped (``BroadcastingRunner``)
so that ``InProcessExecutor`` drives it unchanged (sampling, penalties, prompt logprobs stay on rank 0: the LM
head gathers the full logits there). World size 1 never reaches this module.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from cvllm import plugins
from cvllm.distributed import set_tensor_parallel
from cvllm.engine.executor import InProcessExecutor
from cvllm.engine.model_runner import ModelRunner, build_model, is_decode_path
from cvllm.engine.tensor_parallel import messages
from cvllm.engine.tensor_parallel.worker import WorkerSpec, run_worker
from cvllm.registry import target_name

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0   # workers import torch and load their shard; gloo's own collectives time out after this


def check_tensor_parallel_size(config, size: int) -> None:
    """The heads must split evenly: say which sizes would."""
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    fits = [n for n in range(1, heads + 1) if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)]
    if size not in fits:
        raise ValueError(f"tensor_parallel_size {size} does not split the model's {heads} attention heads "
                         f"({kv_heads} KV heads) evenly; sizes that would: {', '.join(map(str, fits))}")


class TensorParallelGroup:
    """The worker processes and the process group, from start to shutdown."""

    def __init__(self, spec: WorkerSpec):
        self.size = spec.world_size
        # rank 0's store first, on a port the OS picks: the workers join it, then mark themselves joined
        self.store = dist.TCPStore("127.0.0.1", 0, self.size, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=spec.timeout_s))
        spec = dataclasses.replace(spec, init_method=f"tcp://127.0.0.1:{self.store.port}")
        context = multiprocessing.get_context("spawn")
        self.processes, self.conns = [], []
        # Not daemons: a daemonic process cannot have children, and the engine may itself run in cvserve's core
        # process. atexit (below) and the workers' parent watch end them when this process ends.
        for rank in range(1, self.size):
            parent, child = context.Pipe(duplex=False)
            process = context.Process(target=run_worker, args=(spec, rank, child, os.getpid()),
                                      name=f"cvllm-tp-worker-{rank}", daemon=False)
            process.start()
            child.close()
            self.processes.append(process)
            self.conns.append(parent)
        self.closed = False
        atexit.register(self.close)
        try:
            self._wait_joined(spec.timeout_s)
            dist.init_process_group("gloo", store=self.store, rank=0, world_size=self.size,
                                    timeout=timedelta(seconds=spec.timeout_s))
        except BaseException:
            self.close()
            raise
        set_tensor_parallel(0, self.size)

    def _wait_joined(self, timeout_s: float) -> None:
        """Every worker has reached the store (``messages.joined_key``), polling that each is still alive: one
        that dies first (a failed import or unpickling) fails the start now, not after gloo's ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        keys = [messages.joined_key(rank) for rank in range(1, self.size)]
        while not self.store.check(keys):
            for rank, process in enumerate(self.processes, start=1):
                if not process.is_alive():
                    # its own error is on stderr above; the usual one is a script without a main guard, which
                    # each spawned process re-runs on import
                    raise RuntimeError(f"tensor-parallel worker {rank} (pid {process.pid}) exited with code "
                                       f"{process.exitcode} before joining the process group (its error is printed "
                                       "above; a script that starts tensor parallelism needs an "
                                       "`if __name__ == \"__main__\":` guard)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not join the process group within {timeout_s:g} s")
            time.sleep(0.05)

    def wait_ready(self, timeout_s: float) -> None:
        """Each worker's shard is built, or the error of the first that failed."""
        deadline = time.monotonic() + timeout_s
        for rank, (process, conn) in enumerate(zip(self.processes, self.conns), start=1):
            while not conn.poll(0.1):
                if not process.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel worker {rank} did not start (exit code {process.exitcode})")
            status, detail = conn.recv()
            if status != "ready":
                raise RuntimeError(f"tensor-parallel worker {rank} failed to build its shard:\n{detail}")

    def check(self) -> None:
        """Raise if a worker has died: the next collective would wait for it until gloo's timeout."""
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                raise RuntimeError(f"tensor-parallel worker {rank} (pid {process.pid}) died with exit code "
                                   f"{process.exitcode}; the engine cannot run steps any more")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
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

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.group.check()
        messages.send_op(messages.ALLOCATE_KV, num_blocks)
        self.inner.allocate_kv_cache(num_blocks)

    def enable_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Not yet: the workers capture nothing, and a graph would have to replay the collectives too."""

    @torch.inference_mode()
    def run(self, batch, all_logits: bool = False, extra_indices=None, previous_tokens=None) -> torch.Tensor:
        return self.forward(batch, self.inner.prepare(batch, previous_tokens), all_logits, extra_indices)

    def forward(self, batch, inputs, all_logits: bool = False, extra_indices=None) -> torch.Tensor:
        input_ids, positions, ctx, logits_indices = inputs
        decode_path = is_decode_path(batch, ctx, all_logits, extra_indices)
        if extra_indices is not None:
            logits_indices = torch.cat([logits_indices, extra_indices.to(logits_indices.device)])
        self.group.check()
        try:
            messages.send_step(input_ids, positions, ctx, logits_indices, decode_path, all_logits)
            return self.inner.forward_prepared(input_ids, positions, ctx, logits_indices, decode_path, all_logits)
        except RuntimeError:
            self.group.check()   # a worker's death is the error to report, not gloo's lost connection
            raise


class TensorParallelExecutor(InProcessExecutor):
    def __init__(self, runner: BroadcastingRunner, sampler, backend, vocab_size: int):
        super().__init__(runner, sampler, backend, vocab_size)
        self.group = runner.group

    def shutdown(self) -> None:
        super().shutdown()
        self.group.close()


def build_tensor_parallel(checkpoint, backend, dtype: torch.dtype, config) -> BroadcastingRunner:
    """Start ``config.tensor_parallel_size - 1`` workers and build rank 0's shard; returns rank 0's runner."""
    size = config.tensor_parallel_size
    check_tensor_parallel_size(checkpoint.config, size)
    if backend.device.type != "cpu":
        raise NotImplementedError(f"tensor parallelism runs on the CPU backend only for now (gloo, one process per "
                                  f"rank); the {backend.name} backend needs NCCL and a device per rank")
    quant = "isq" if config.isq else checkpoint.quant_method
    spec = WorkerSpec(
        checkpoint=dataclasses.replace(checkpoint, tokenizer=None),   # workers never tokenize
        model_class=target_name(plugins.architectures().spec(checkpoint.architecture)),
        backend_class=target_name(type(backend)),
        quantizer=target_name(plugins.quantizers().spec(quant)) if quant else None,
        dtype=dtype, isq=config.isq, block_size=config.block_size, world_size=size,
        init_method="", timeout_s=STARTUP_TIMEOUT_S)   # init_method: set by TensorParallelGroup
    group = TensorParallelGroup(spec)
    try:
        model = build_model(checkpoint, backend, dtype, isq=config.isq)
        group.wait_ready(STARTUP_TIMEOUT_S)
    except BaseException:
        group.close()
        raise
    logger.info("tensor parallel: %d ranks (gloo), rank 0 in this process", size)
    return BroadcastingRunner(ModelRunner(model, backend, config.block_size, dtype), group)
