"""Faults under tensor parallelism, through the real server (``cvserve --d 0,1``: CPU, gloo, rank 1 a child of the
engine core): a worker killed mid-generation, one that dies while the server is idle, and one that hangs (SIGSTOP)
each end the engine core with a clear reason in the log, and the server's supervisor starts all ranks again: the
open stream continues on the new ranks to the output an uninterrupted run gives, /health is 200 again, and stopping
the server leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from cvllm.testing import make_checkpoint
from cvllm.testing.server import PARENT_WATCH, free_port

# cvserve's own entry point, stopping itself if the test runner dies (as LiveServer's servers do)
BOOT = PARENT_WATCH + """
import sys
from cvllm.server.cli import main
sys.exit(main(sys.argv[1:]))
"""
MESSAGES = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-server")
    make_checkpoint(path, "llama", seed=7, max_position_embeddings=4096)   # room for a long generation
    return path


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name: [state, ppid, ...]; None once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def spawned_children(pid: int) -> list[int]:
    """Live children of ``pid`` started by multiprocessing's spawn (not its resource tracker), oldest first."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) and int(fields[1]) == pid and fields[0] != "Z":
            try:
                if b"spawn_main" in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return sorted(found)


def descendants(pid: int) -> set[int]:
    tree, frontier = set(), [pid]
    while frontier:
        parent = frontier.pop()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and (fields := _stat(int(entry.name))) and int(fields[1]) == parent:
                tree.add(int(entry.name))
                frontier.append(int(entry.name))
    return tree


def running(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


class Cvserve:
    """``cvserve --w DIR --d 0,1`` on a free port of 127.0.0.1, in its own session; ``env``: extra variables."""

    def __init__(self, model_dir: Path, **env: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = ["--w", str(model_dir), "--d", "0,1", "--h", "127.0.0.1", "--p", str(self.port),
                     "--backend", "cpu", "--dtype", "float32", "--num-kv-blocks", "300", "--max-num-seqs", "4"]
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **env}
        self.log = tempfile.NamedTemporaryFile("w+", prefix="cvserve-tp-", suffix=".log", delete=False)
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> Cvserve:
        self.process = subprocess.Popen([sys.executable, "-c", BOOT, *self.argv], env=self.env, stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"cvserve exited with {self.process.returncode}:\n{self.output()}"
            if self.health()[0] == 200:
                return self
            time.sleep(0.2)
        self.__exit__()
        pytest.fail(f"cvserve was not healthy within 240 s:\n{self.output()}")

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()
        os.unlink(self.log.name)

    def health(self) -> tuple[int | None, str]:
        try:
            response = httpx.get(self.url + "/health", timeout=5)
        except httpx.TransportError:
            return None, ""
        return response.status_code, response.text

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def rank1(self) -> int:
        """The worker: the engine core's spawned child (the core is the server's)."""
        cores = spawned_children(self.process.pid)
        assert len(cores) == 1, f"one engine core under the server, found {cores}"
        workers = spawned_children(cores[0])
        assert len(workers) == 1, f"one tensor-parallel worker under the engine core, found {workers}"
        return workers[0]

    def events(self, lines) -> list[dict | str]:
        return [line[len("data: "):] if line == "data: [DONE]" else json.loads(line[len("data: "):])
                for line in lines if line.startswith("data: ")]

    def stream_then(self, fault, max_tokens: int = 3500) -> tuple[list, list, float]:
        """A long streamed chat; after its first content, ``fault()``. (events before, events after, seconds from the
        fault to the stream's end)."""
        body = {"messages": MESSAGES, "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0}
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            lines, before = response.iter_lines(), []
            while not any(e["choices"] and e["choices"][0]["delta"].get("content") for e in before):
                before += self.events([next(lines)])
            fault()
            start = time.monotonic()
            after = self.events(lines)
            return before, after, time.monotonic() - start


def reference(server: Cvserve, max_tokens: int) -> str:
    """The greedy text of stream_then's request, uninterrupted."""
    body = {"messages": MESSAGES, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def text(events: list) -> str:
    chunks = [e for e in events if isinstance(e, dict) and e["choices"]]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks)


def assert_resumed(server: Cvserve, before: list, after: list, want: str, reason: str) -> None:
    """The stream went on after the fault on a new engine core (all ranks started again) to the uninterrupted
    output; the log says why the core ended and that the request resumed; the server serves again."""
    assert after[-1] == "[DONE]" and after[-2]["choices"][0]["finish_reason"] == "length", after[-2:]
    assert text(before + after[:-1]) == want
    log = server.output()
    assert reason in log and "1 request(s) resumed" in log, log[-3000:]
    assert server.health()[0] == 200
    assert reference(server, 8)


def assert_nothing_left(server: Cvserve, tree: set[int]) -> None:
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(30) == 0
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in tree if running(pid)], "a process outlived the server"


RESUMED_TOKENS = 400


def test_a_worker_killed_mid_generation_restarts_the_ranks_and_the_stream_goes_on(model_dir):
    with Cvserve(model_dir) as server:
        want = reference(server, RESUMED_TOKENS)
        tree, worker = descendants(server.process.pid), server.rank1()
        before, after, _ = server.stream_then(lambda: os.kill(worker, signal.SIGKILL), RESUMED_TOKENS)
        assert_resumed(server, before, after, want, f"tensor-parallel worker 1 (pid {worker}, killed by SIGKILL) died")
        assert server.rank1() != worker
        assert_nothing_left(server, tree | descendants(server.process.pid))


def test_a_worker_that_dies_while_the_server_is_idle_is_replaced(model_dir):
    with Cvserve(model_dir) as server:
        tree, worker = descendants(server.process.pid), server.rank1()
        os.kill(worker, signal.SIGKILL)   # no request in flight: the core's idle wait sees it
        deadline = time.monotonic() + 5
        while server.health()[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.health()[0] == 503
        deadline = time.monotonic() + 120
        while server.health()[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.health()[0] == 200 and reference(server, 8)
        assert f"tensor-parallel worker 1 (pid {worker}, killed by SIGKILL) died" in server.output()
        assert_nothing_left(server, tree | descendants(server.process.pid))


def test_a_hung_worker_is_detected_and_the_ranks_restart(model_dir):
    """SIGSTOP: the worker is alive but makes no progress; gloo alone would wait 600 s."""
    with Cvserve(model_dir, CVLLM_TP_STALL_TIMEOUT_S="2") as server:
        want = reference(server, RESUMED_TOKENS)
        tree, worker = descendants(server.process.pid), server.rank1()
        try:
            before, after, _ = server.stream_then(lambda: os.kill(worker, signal.SIGSTOP), RESUMED_TOKENS)
        finally:
            if running(worker):   # the watch kills it; should it not have, leave no stopped process behind
                os.kill(worker, signal.SIGKILL)
        assert_resumed(server, before, after, want,
                       f"tensor-parallel worker 1 (pid {worker}, stopped) made no progress for 2 s")
        assert "CVLLM_TP_STALL_TIMEOUT_S" in server.output()
        assert_nothing_left(server, tree | descendants(server.process.pid))
