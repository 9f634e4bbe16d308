"""How the ranks find each other and say how their start went, on one node or several.

Rank 0 (the engine's process on node 0) hosts a TCP store: on 127.0.0.1 and a port the OS picks on one node, on
``master_addr:master_port`` over several (under torchrun, whose agent already hosts a store there, rank 0 joins
that one). It publishes the ``WorkerSpec`` there, so another node's launcher needs only the address
(tensor_parallel/node.py). Each worker, on any node, reports through the store: ``joined`` once its device is bound
(it is about to join the process group), then ``status`` "ready" or the traceback of what failed. Rank 0 polls these
and, for the workers it started itself, their processes: a failed worker is a clear error now, not a collective's
timeout later.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time
from collections.abc import Sequence
from datetime import timedelta
from multiprocessing.process import BaseProcess

import torch.distributed as dist

SPEC_KEY = "cvllm/tp/spec"


def joined_key(rank: int) -> str:
    return f"cvllm/tp/joined/{rank}"


def status_key(rank: int) -> str:
    return f"cvllm/tp/status/{rank}"


def under_torchrun_agent() -> bool:
    """torchrun's agent hosts a store on MASTER_ADDR:MASTER_PORT and tells its processes so."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def host_store(master_addr: str | None, master_port: int | None, world_size: int, timeout_s: float
               ) -> tuple[dist.TCPStore, str]:
    """Rank 0's store and its ``tcp://host:port`` for the others."""
    host = master_addr or "127.0.0.1"
    timeout = timedelta(seconds=timeout_s)
    if master_port and under_torchrun_agent():
        store = dist.TCPStore(host, master_port, world_size, is_master=False, timeout=timeout)
    else:
        store = dist.TCPStore(host, master_port or 0, world_size, is_master=True, wait_for_workers=False,
                              timeout=timeout)
    return store, f"tcp://{host}:{store.port}"


def join_store(init_method: str, world_size: int | None, timeout_s: float) -> dist.TCPStore:
    """A worker's or another node's client of rank 0's store (waits up to ``timeout_s`` for it to be up)."""
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    return dist.TCPStore(host, int(port), world_size, is_master=False, timeout=timedelta(seconds=timeout_s))


def publish_spec(store: dist.TCPStore, spec) -> None:
    store.set(SPEC_KEY, pickle.dumps(spec))


def read_spec(store: dist.TCPStore):
    """The WorkerSpec rank 0 published (blocks until it is there, up to the store's timeout)."""
    return pickle.loads(store.get(SPEC_KEY))


def spawn_workers(spec, ranks: Sequence[tuple[int, int]]) -> list[BaseProcess]:
    """One process per (rank, local rank), started with ``spawn``. Not daemons: a daemonic process cannot have
    children, and the engine may itself run in cvserve's core process; the workers leave when this process ends
    (their parent watch)."""
    from cvllm.engine.tensor_parallel.worker import run_worker

    context = multiprocessing.get_context("spawn")
    processes = []
    for rank, local_rank in ranks:
        process = context.Process(target=run_worker, args=(spec, rank, local_rank, os.getpid()),
                                  name=f"cvllm-tp-worker-{rank}", daemon=False)
        process.start()
        processes.append(process)
    return processes


def wait_for(store: dist.TCPStore, key, ranks: Sequence[int], local: dict[int, BaseProcess], timeout_s: float,
             what: str) -> None:
    """Until every rank in ``ranks`` has set ``key(rank)``, raising on the first error a rank reports (its status)
    or on a local worker's exit before it reported."""
    deadline = time.monotonic() + timeout_s
    waiting = list(ranks)
    while waiting:
        for rank in list(waiting):
            failure = reported_failure(store, rank)
            if failure is not None:
                raise RuntimeError(f"tensor-parallel worker {rank} failed to start:\n{failure}")
            if store.check([key(rank)]):
                waiting.remove(rank)
            elif rank in local and not local[rank].is_alive():
                process = local[rank]
                # its own error is on stderr above; the usual one is a script without a main guard, which each
                # spawned process re-runs on import
                raise RuntimeError(f"tensor-parallel worker {rank} (pid {process.pid}) exited with code "
                                   f"{process.exitcode} before {what} (its error is printed above; a script that "
                                   "starts tensor parallelism needs an `if __name__ == \"__main__\":` guard)")
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel workers {waiting} did not finish {what} within {timeout_s:g} s "
                               "(on other nodes: is each node's launcher running, with the same --master-addr and "
                               "--master-port?)")
        if waiting:
            time.sleep(0.05)


def reported_failure(store: dist.TCPStore, rank: int) -> str | None:
    if not store.check([status_key(rank)]):
        return None
    status = store.get(status_key(rank)).decode()
    return None if status == "ready" else status
