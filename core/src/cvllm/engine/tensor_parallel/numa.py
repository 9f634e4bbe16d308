"""NUMA placement of tensor-parallel ranks: ``MAP_NUMA_NODE=0,0,1,1`` (candle-vllm's variable) names one NUMA node
per rank of this node (by local rank). Each rank pins its CPU affinity to that node's CPUs and, where libnuma is
installed, prefers that node's memory, so a rank's weights and KV cache sit next to the cores that read them.

Rank 0 pins itself in the engine process (engine/build.py), ranks 1..N-1 in their worker (worker.py); the workers
read the variable from the environment they inherit, so nothing extra travels in ``WorkerSpec``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_VAR = "MAP_NUMA_NODE"
SYS_NODE_ROOT = "/sys/devices/system/node"


class NumaError(ValueError):
    """MAP_NUMA_NODE cannot be applied; the message says why."""


def parse_cpulist(text: str) -> set[int]:
    """The kernel's cpulist format: ``0-3,8,10-11`` (empty for a node without CPUs)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def available_nodes(root: str | Path = SYS_NODE_ROOT) -> list[int]:
    base = Path(root)
    if not base.is_dir():
        return []
    return sorted(int(p.name[4:]) for p in base.iterdir() if p.name.startswith("node") and p.name[4:].isdigit())


def node_cpus(node: int, root: str | Path = SYS_NODE_ROOT) -> set[int]:
    path = Path(root) / f"node{node}" / "cpulist"
    try:
        return parse_cpulist(path.read_text())
    except FileNotFoundError:
        raise NumaError(f"{ENV_VAR}: NUMA node {node} does not exist (nodes here: "
                        f"{_names(root)})") from None


def parse_numa_nodes(text: str, world_size: int, root: str | Path = SYS_NODE_ROOT) -> list[int]:
    """One node per rank, each an existing node with CPUs; a clear error otherwise."""
    try:
        nodes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise NumaError(f"{ENV_VAR}={text!r}: expected one NUMA node number per rank, e.g. 0,0,1,1") from None
    if len(nodes) != world_size:
        raise NumaError(f"{ENV_VAR}={text!r} names {len(nodes)} node(s), but tensor parallelism has {world_size} "
                        f"rank(s): give one node per rank")
    existing = available_nodes(root)
    for node in nodes:
        if node not in existing:
            raise NumaError(f"{ENV_VAR}={text!r}: NUMA node {node} does not exist (nodes here: {_names(root)})")
        if not node_cpus(node, root):
            raise NumaError(f"{ENV_VAR}={text!r}: NUMA node {node} has no CPUs (a memory-only node) to pin to")
    return nodes


def numa_nodes_from_env(world_size: int, env: Mapping[str, str] | None = None,
                        root: str | Path = SYS_NODE_ROOT) -> list[int] | None:
    """The nodes MAP_NUMA_NODE names, checked; None when it is unset or empty."""
    text = (os.environ if env is None else env).get(ENV_VAR, "").strip()
    return parse_numa_nodes(text, world_size, root) if text else None


def pin_rank(rank: int, world_size: int, env: Mapping[str, str] | None = None, root: str | Path = SYS_NODE_ROOT,
             set_affinity: Callable[[int, set[int]], None] | None = None,
             set_memory: Callable[[int], bool] | None = None) -> int | None:
    """Apply MAP_NUMA_NODE to the calling process as ``rank``; returns its node (None: the variable is unset).
    ``set_affinity`` / ``set_memory`` are for tests (defaults: os.sched_setaffinity, libnuma's preferred node)."""
    nodes = numa_nodes_from_env(world_size, env, root)
    if nodes is None:
        return None
    node = nodes[rank]
    cpus = node_cpus(node, root)
    (set_affinity or os.sched_setaffinity)(0, cpus)   # 0: this process (its threads spawned later inherit it)
    memory = (set_memory or prefer_memory_node)(node)
    # warning, not info: workers log at WARNING (worker.py), and this line is the one place placement shows
    logger.warning("tp rank %d: %s -> NUMA node %d, CPUs %s; %s", rank, ENV_VAR, node, _cpu_ranges(cpus),
                   "memory preferred on that node (libnuma)" if memory
                   else "CPU affinity only (libnuma not available: memory follows first touch)")
    return node


def prefer_memory_node(node: int) -> bool:
    """libnuma's numa_set_preferred through ctypes, so no Python package is needed; False where libnuma is absent
    or reports NUMA unavailable (numa_available() < 0: calling anything else is then undefined)."""
    name = ctypes.util.find_library("numa")
    if name is None:
        return False
    try:
        lib = ctypes.CDLL(name)
        if lib.numa_available() < 0:
            return False
        lib.numa_set_preferred(ctypes.c_int(node))
    except (OSError, AttributeError):
        return False
    return True


def _names(root: str | Path) -> str:
    return ", ".join(map(str, available_nodes(root))) or f"none under {root}"


def _cpu_ranges(cpus: set[int]) -> str:
    """The cpulist spelling back, so the log line stays short on a 128-core node."""
    ranges: list[str] = []
    for cpu in sorted(cpus):
        if ranges and cpu == int(ranges[-1].rpartition("-")[2]) + 1:
            ranges[-1] = f"{ranges[-1].partition('-')[0]}-{cpu}"
        else:
            ranges.append(str(cpu))
    return ",".join(ranges)
