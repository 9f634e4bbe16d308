"""Multi-node settings (``--num-nodes``, ``--node-rank``, ``--master-addr``, ``--master-port``), and the same
settings read from a launcher's environment: torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or
Open MPI's mpirun (OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK).

candle-vllm's convention is kept: one launched process per node, which then starts that node's ranks itself. So a
launcher's process rank is the node rank and its world size the node count, and a LOCAL_RANK other than 0 means
several processes were launched on one node, which this layout does not use.

Node 0's process is the engine (rank 0, and the HTTP server); each other node's process is a launcher of that
node's ranks (node.py), which reads everything else from rank 0's store.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


class MultiNodeError(ValueError):
    """Multi-node settings that cannot be used; the message says why."""


@dataclass(frozen=True)
class NodeSettings:
    """The EngineConfig fields of the same names. ``source`` names where they came from, for messages."""
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    source: str = "defaults"


# launcher → its (rank, world size, local rank) variables; torchrun's first: mpirun sets no RANK, but a torchrun run
# inside an MPI allocation may inherit OMPI_* variables that describe the allocation, not this process.
_LAUNCHERS = (
    ("torchrun", ("RANK", "WORLD_SIZE", "LOCAL_RANK")),
    ("mpirun", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")),
)


def from_launcher_env(env: Mapping[str, str] | None = None) -> NodeSettings | None:
    """The node settings a torchrun / mpirun environment implies; None when neither launcher's variables are set.
    Pure apart from reading ``os.environ`` when ``env`` is None."""
    env = os.environ if env is None else env
    for launcher, (rank_var, size_var, local_var) in _LAUNCHERS:
        if rank_var not in env and size_var not in env:
            continue
        rank = _int(env, rank_var, 0)
        size = _int(env, size_var, 1)
        local_rank = _int(env, local_var, 0)
        if local_rank != 0:
            raise MultiNodeError(f"{local_var}={local_rank}: cvllm takes one process per node ({launcher} with one "
                                 f"process per node, e.g. torchrun --nproc-per-node 1); it starts that node's ranks "
                                 f"itself")
        port = _int(env, "MASTER_PORT", None)
        settings = NodeSettings(num_nodes=size, node_rank=rank, master_addr=env.get("MASTER_ADDR") or None,
                                master_port=port, source=f"{launcher}'s {rank_var}/{size_var}")
        check_values(settings)
        return settings
    return None


def merge(flags: NodeSettings, launcher: NodeSettings | None, given: set[str]) -> NodeSettings:
    """Flags win where given; the launcher's environment fills the rest. A given flag that disagrees with the
    launcher is an error rather than a silent choice: the other nodes would see the launcher's value."""
    if launcher is None:
        return flags
    values = {}
    for name in ("num_nodes", "node_rank", "master_addr", "master_port"):
        ours, theirs = getattr(flags, name), getattr(launcher, name)
        if name in given and theirs is not None and ours != theirs:
            flag = "--" + name.replace("_", "-")
            raise MultiNodeError(f"{flag} {ours} disagrees with {launcher.source} environment ({name} {theirs})")
        values[name] = ours if name in given or theirs is None else theirs
    return NodeSettings(**values, source=launcher.source)


def check_values(settings: NodeSettings) -> None:
    if settings.num_nodes < 1:
        raise MultiNodeError(f"num_nodes must be positive, got {settings.num_nodes}")
    if not 0 <= settings.node_rank < settings.num_nodes:
        raise MultiNodeError(f"node_rank must be in 0..{settings.num_nodes - 1}, got {settings.node_rank}")
    if settings.master_port is not None and not 0 < settings.master_port <= 65535:
        raise MultiNodeError(f"master_port must be a port number (1-65535), got {settings.master_port}")


def check_engine_node(node_rank: int) -> None:
    """The engine (and cvserve's HTTP server) runs on node 0 only; another node runs its ranks' launcher."""
    if node_rank != 0:
        raise ValueError(f"node_rank {node_rank}: the engine runs on node 0; on this node run `cvserve --num-nodes N "
                         f"--node-rank {node_rank} --master-addr HOST --master-port PORT`, which starts this node's "
                         f"ranks (cvllm.engine.tensor_parallel.node)")


def _int(env: Mapping[str, str], name: str, default):
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise MultiNodeError(f"{name}={text!r}: expected an integer") from None
