"""MAP_NUMA_NODE (engine/tensor_parallel/numa.py) against a fake /sys node tree: no NUMA machine needed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from cvllm.engine.tensor_parallel import numa


@pytest.fixture
def sys_root(tmp_path: Path) -> Path:
    """Two nodes with CPUs (0-3,8 and 4-7) and a memory-only node 2, as /sys/devices/system/node lays them out."""
    root = tmp_path / "node"
    for node, cpus in ((0, "0-3,8\n"), (1, "4-7\n"), (2, "\n")):
        (root / f"node{node}").mkdir(parents=True)
        (root / f"node{node}" / "cpulist").write_text(cpus)
    (root / "possible").write_text("0-2\n")   # a file beside the node directories, as in the real tree
    return root


class Calls:
    def __init__(self, memory: bool = True):
        self.affinity, self.memory, self.memory_ok = [], [], memory

    def set_affinity(self, pid, cpus):
        self.affinity.append((pid, set(cpus)))

    def set_memory(self, node):
        self.memory.append(node)
        return self.memory_ok


def test_parse_cpulist():
    assert numa.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert numa.parse_cpulist("\n") == set()


def test_nodes_and_cpus(sys_root):
    assert numa.available_nodes(sys_root) == [0, 1, 2]
    assert numa.node_cpus(1, sys_root) == {4, 5, 6, 7}
    assert numa.available_nodes(sys_root / "missing") == []


def test_each_rank_pins_to_its_node(sys_root, caplog):
    env = {"MAP_NUMA_NODE": "0,0,1,1"}
    caplog.set_level(logging.INFO, logger=numa.__name__)
    for rank, node, cpus in ((0, 0, {0, 1, 2, 3, 8}), (3, 1, {4, 5, 6, 7})):
        calls = Calls()
        assert numa.pin_rank(rank, 4, env, sys_root, calls.set_affinity, calls.set_memory) == node
        assert calls.affinity == [(0, cpus)] and calls.memory == [node]
    assert "tp rank 0: MAP_NUMA_NODE -> NUMA node 0, CPUs 0-3,8; memory preferred" in caplog.text
    assert "tp rank 3: MAP_NUMA_NODE -> NUMA node 1, CPUs 4-7" in caplog.text


def test_without_libnuma_only_affinity_is_set(sys_root, caplog):
    calls = Calls(memory=False)
    numa.pin_rank(1, 2, {"MAP_NUMA_NODE": "0,1"}, sys_root, calls.set_affinity, calls.set_memory)
    assert calls.affinity == [(0, {4, 5, 6, 7})]
    assert "CPU affinity only (libnuma not available" in caplog.text


def test_unset_does_nothing(sys_root, monkeypatch):
    def refuse(*args):
        raise AssertionError("must not be called")

    for env in ({}, {"MAP_NUMA_NODE": " "}):
        assert numa.pin_rank(0, 2, env, sys_root, refuse, refuse) is None
    monkeypatch.delenv("MAP_NUMA_NODE", raising=False)
    monkeypatch.setattr(numa.os, "sched_setaffinity", refuse)
    assert numa.pin_rank(0, 1) is None   # the real defaults: os.environ, /sys, os.sched_setaffinity


def test_default_affinity_call_is_os_sched_setaffinity(sys_root, monkeypatch):
    seen = []
    monkeypatch.setattr(numa.os, "sched_setaffinity", lambda pid, cpus: seen.append((pid, set(cpus))))
    numa.pin_rank(0, 1, {"MAP_NUMA_NODE": "1"}, sys_root, set_memory=lambda node: False)
    assert seen == [(0, {4, 5, 6, 7})]


@pytest.mark.parametrize("value, message", [
    ("0,1", "names 2 node\\(s\\), but tensor parallelism has 4 rank\\(s\\)"),
    ("0,0,1,5", "NUMA node 5 does not exist \\(nodes here: 0, 1, 2\\)"),
    ("0,0,1,2", "NUMA node 2 has no CPUs"),
    ("0,0,x,1", "expected one NUMA node number per rank"),
])
def test_errors(sys_root, value, message):
    with pytest.raises(numa.NumaError, match=message):
        numa.pin_rank(0, 4, {"MAP_NUMA_NODE": value}, sys_root, Calls().set_affinity, Calls().set_memory)


def test_no_node_tree(tmp_path):
    with pytest.raises(numa.NumaError, match="nodes here: none under"):
        numa.parse_numa_nodes("0", 1, tmp_path / "absent")


def test_prefer_memory_node_without_libnuma(monkeypatch):
    monkeypatch.setattr(numa.ctypes.util, "find_library", lambda name: None)
    assert numa.prefer_memory_node(0) is False


def test_prefer_memory_node_with_libnuma(monkeypatch):
    class FakeLib:
        preferred = None

        def numa_available(self):
            return 0

        def numa_set_preferred(self, node):
            FakeLib.preferred = node.value

    monkeypatch.setattr(numa.ctypes.util, "find_library", lambda name: "libnuma.so.1")
    monkeypatch.setattr(numa.ctypes, "CDLL", lambda name: FakeLib())
    assert numa.prefer_memory_node(1) is True and FakeLib.preferred == 1
    monkeypatch.setattr(FakeLib, "numa_available", lambda self: -1)   # libnuma present, NUMA not
    assert numa.prefer_memory_node(1) is False
