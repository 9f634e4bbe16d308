"""Another node's launcher (``cvserve --num-nodes N --node-rank K --master-addr A --master-port P``, K > 0): start
this node's ranks and wait for them.

It needs nothing but the address: rank 0 publishes the WorkerSpec (the checkpoint by path, the resolved
"module:Class" targets, dtype, devices per node) in its store, so every node runs the same model the same way. The
checkpoint's files must be at the same path on every node (candle-vllm's rule too). The launcher exits when its
ranks do: after rank 0's shutdown message (0), or when the group breaks (1). A rank that dies before reporting is
reported for it, so rank 0 fails its start with a clear error instead of waiting out the timeout.
"""

from __future__ import annotations

import logging
import time

from cvllm.engine.tensor_parallel import rendezvous
from cvllm.engine.tensor_parallel.multinode import NodeSettings

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0   # node 0 may still be loading its own shard, or not started yet


def run_node(settings: NodeSettings, timeout_s: float = STARTUP_TIMEOUT_S) -> int:
    """This node's ranks, from start to end; the exit code for the launcher's process."""
    if settings.node_rank < 1 or not (settings.master_addr and settings.master_port):
        raise ValueError("a node launcher needs node_rank >= 1, master_addr and master_port")
    address = f"tcp://{settings.master_addr}:{settings.master_port}"
    logger.info("node %d of %d: waiting for node 0 at %s", settings.node_rank, settings.num_nodes, address)
    store = rendezvous.join_store(address, None, timeout_s)
    spec = rendezvous.read_spec(store)
    per_node = spec.ranks_per_node
    if spec.world_size != per_node * settings.num_nodes:
        raise ValueError(f"num_nodes {settings.num_nodes} disagrees with node 0's: {spec.world_size} ranks of "
                         f"{per_node} per node")
    first = settings.node_rank * per_node
    ranks = [(first + local, local) for local in range(per_node)]
    processes = rendezvous.spawn_workers(spec, ranks)
    logger.info("node %d: ranks %d..%d started (%s)", settings.node_rank, first, first + per_node - 1,
                spec.dist_backend)
    return _wait(store, dict(zip((rank for rank, _ in ranks), processes)))


def _wait(store, processes: dict) -> int:
    """Until every rank's process has ended; one that fails before its status is in the store gets one."""
    while processes:
        for rank, process in list(processes.items()):
            if process.is_alive():
                continue
            del processes[rank]
            logger.info("rank %d ended with exit code %s", rank, process.exitcode)
            if process.exitcode:
                if not _has_status(store, rank):
                    try:
                        store.set(rendezvous.status_key(rank), f"exited with code {process.exitcode} before it "
                                                               "was built (its error is in its node's log)")
                    except RuntimeError:   # rank 0's store is gone: nobody is left to tell
                        pass
                _end(processes)   # the group is broken: the others would wait in a collective
                return 1
        time.sleep(0.2)
    return 0


def _has_status(store, rank: int) -> bool:
    try:
        return store.check([rendezvous.status_key(rank)])
    except RuntimeError:
        return True


def _end(processes: dict) -> None:
    for process in processes.values():
        process.kill()
        process.join()
