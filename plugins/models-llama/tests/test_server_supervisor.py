"""A dead engine core is replaced: kill -9 of the core under a live cvserve, /health goes 503 then 200 again and
requests are served by the new core; past --max-restarts the server exits 1."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from cvllm.testing import make_checkpoint
from cvllm.testing.server import LiveServer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("server-supervisor")
    make_checkpoint(path, "llama", seed=3)
    return path


def core_pid(server: LiveServer) -> int:
    """The engine core: the server's child that multiprocessing spawned (not its resource tracker)."""
    children = Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children").read_text().split()
    for pid in map(int, children):
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError(f"no engine core among {children}")


def complete(server: LiveServer) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4,
                                                             "temperature": 0}, timeout=60)


def wait_for(predicate, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads the process tree from /proc")
def test_a_killed_core_is_replaced_and_serving_goes_on(model_dir):
    engine = {"model": str(model_dir), "dtype": "float32", "backend": "cpu", "max_num_seqs": 4}
    with LiveServer(engine, served_model_names=["tiny"], max_restarts=2) as server:
        before = complete(server).json()["choices"][0]["text"]
        first = core_pid(server)
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: server.health() != 200, 30)
        wait_for(lambda: server.health() == 200)
        assert core_pid(server) != first
        assert complete(server).json()["choices"][0]["text"] == before   # the new core serves the same model
        assert "engine core restarted" in server.log()


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads the process tree from /proc")
def test_past_max_restarts_the_server_exits_non_zero(model_dir):
    engine = {"model": str(model_dir), "dtype": "float32", "backend": "cpu", "max_num_seqs": 4}
    with LiveServer(engine, served_model_names=["tiny"], max_restarts=0) as server:
        os.kill(core_pid(server), signal.SIGKILL)
        assert server.process.wait(60) == 1
        assert "giving up" in server.log()
