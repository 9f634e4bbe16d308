"""Tensor parallelism over two "nodes" on one machine (loopback, gloo): node 0 is the engine (``LLM`` or cvserve),
node 1 is `cvserve --num-nodes 2 --node-rank 1 --master-addr 127.0.0.1 --master-port P`, each with its own ranks.
The greedy tokens equal one rank's, node 1's launcher ends when node 0 shuts down, and one that fails is a clear
error on node 0."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from cvllm import LLM
from cvllm.testing.checkpoints import cvllm_greedy, make_checkpoint
from cvllm.testing.server import free_port

PROMPTS = [[1, 5, 9, 23, 7, 11, 3, 4, 99, 100, 17, 2, 8], [4, 8, 15, 16, 23, 42]]


def launch_node(port: int, **env: str) -> subprocess.Popen:
    """Node 1 of 2's launcher; ``env``: variables its ranks inherit."""
    return subprocess.Popen([sys.executable, "-m", "cvllm.server.cli", "--num-nodes", "2", "--node-rank", "1",
                             "--master-addr", "127.0.0.1", "--master-port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **env})


def finish(process: subprocess.Popen, timeout: float = 60) -> tuple[int, str]:
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        pytest.fail(f"node launcher still running after {timeout} s:\n{output}")
    return process.returncode, output


@pytest.mark.parametrize("per_node", [1, 2])
def test_two_nodes_match_one_rank(tmp_path, per_node):
    make_checkpoint(tmp_path)   # 4 heads, 2 KV heads: 2 or 4 ranks
    want = cvllm_greedy(tmp_path, PROMPTS, 8, num_kv_blocks=32)
    port = free_port()
    node1 = launch_node(port)   # started first: it waits for node 0's store
    try:
        got = cvllm_greedy(tmp_path, PROMPTS, 8, num_kv_blocks=32, tensor_parallel_size=2 * per_node, num_nodes=2,
                           master_addr="127.0.0.1", master_port=port)
    finally:
        code, output = finish(node1)
    assert got == want
    assert code == 0, output
    assert f"node 1: ranks {per_node}..{2 * per_node - 1} started" in output


def cvserve_node(launcher: str, node_rank: int, store_port: int, *argv: str) -> subprocess.Popen:
    """cvserve as node ``node_rank`` of 2: told by flags, or started by torchrun (which hosts the store itself and
    sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT)."""
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
                   "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(store_port),
                   "-m", "cvllm.server.cli", *argv]
    else:
        command = [sys.executable, "-m", "cvllm.server.cli", "--num-nodes", "2", "--node-rank", str(node_rank),
                   "--master-addr", "127.0.0.1", "--master-port", str(store_port), *argv]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("launcher", ["flags", "torchrun"])
def test_cvserve_on_two_nodes(tmp_path, launcher):
    """Only node 0 serves HTTP; stopping it ends node 1's launcher."""
    make_checkpoint(tmp_path)
    store_port, http_port = free_port(), free_port()
    node1 = cvserve_node(launcher, 1, store_port)
    node0 = cvserve_node(launcher, 0, store_port, "--w", str(tmp_path), "--backend", "cpu", "--dtype", "float32",
                         "--num-kv-blocks", "32", "--h", "127.0.0.1", "--p", str(http_port))
    try:
        url = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert node0.poll() is None, node0.communicate()[0]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        response = httpx.post(url + "/v1/completions", timeout=60,
                              json={"model": "m", "prompt": [4, 8, 15, 16], "max_tokens": 8, "temperature": 0,
                                    "ignore_eos": True})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8
    finally:
        node0.terminate()   # torchrun passes SIGTERM on to cvserve
        code0, output0 = finish(node0)
        code1, output1 = finish(node1)
    assert "tensor parallel: 2 ranks on 2 node(s)" in output0
    assert code1 == 0, output1


def test_a_node_that_fails_is_a_clear_error_on_node_zero(tmp_path):
    """Node 1's rank fails while it starts (its MAP_NUMA_NODE names a NUMA node this machine lacks): node 0's start
    fails with that rank's error, not after a timeout, and node 1's launcher exits 1."""
    make_checkpoint(tmp_path)
    port = free_port()
    node1 = launch_node(port, MAP_NUMA_NODE="63")
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="(?s)tensor-parallel worker 1 failed to start.*MAP_NUMA_NODE"):
            LLM(str(tmp_path), num_kv_blocks=32, tensor_parallel_size=2, num_nodes=2, master_addr="127.0.0.1",
                master_port=port)
    finally:
        code, output = finish(node1)
    assert time.monotonic() - started < 120
    assert code == 1, output
