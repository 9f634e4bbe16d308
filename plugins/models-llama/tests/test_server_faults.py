"""Faults under a live cvserve, with nothing lost (issue 23): kill -9 of the engine core during 16 greedy streams and
every stream ends with the output it would have had; a hung core is killed and replaced; a request in flight through
two core deaths in a row fails instead of killing a third, or, when others were in flight with it through both, is
retried alone first, and they finish; SIGTERM while the core restarts still drains; NaN logits or a detokenization
error fail only their request; a client that stops reading is dropped after the send timeout. Faults come from a
cvllm.testing.faults plan the server's config carries."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from cvllm.testing import make_checkpoint
from cvllm.testing.server import LiveServer

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads the process tree from /proc")

SLOW_STEPS = {"stage": "forward", "action": "sleep", "seconds": 0.03}   # streams last long enough to be cut
HANG_TOKEN, DEATH_TOKEN, NAN_TOKEN, DETOKENIZE_TOKEN = 501, 502, 503, 504


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("server-faults")
    make_checkpoint(path, "llama", seed=3)
    return path


def engine(model_dir, *faults: dict, max_num_seqs: int = 8) -> dict:
    spec = {"model": str(model_dir), "dtype": "float32", "backend": "cpu", "max_num_seqs": max_num_seqs}
    if faults:
        spec["fault_injector"] = list(faults)
    return spec


def core_pid(server: LiveServer) -> int:
    """The engine core: the server's child that multiprocessing spawned (not its resource tracker)."""
    children = Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children").read_text().split()
    for pid in map(int, children):
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError(f"no engine core among {children}")


def wait_for(predicate, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def prompt(i: int) -> list[int]:
    return [(7 + 31 * i + 13 * j) % 480 + 10 for j in range(5 + i % 7)]


def body(i: int, max_tokens: int = 40, **extra) -> dict:
    return {"prompt": prompt(i), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def complete(server: LiveServer, request: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json=request, timeout=120)


class Stream(threading.Thread):
    """One streamed completion read in a thread: its text, finish reason, usage, and any error event."""

    def __init__(self, server: LiveServer, request: dict):
        super().__init__(daemon=True)
        self.url, self.request = server.url + "/v1/completions", request
        self.text, self.chunks, self.finish_reason, self.usage, self.error = "", 0, None, None, None

    def run(self) -> None:
        request = {**self.request, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", self.url, json=request, timeout=120) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.error = chunk["error"]
                    continue
                self.usage = chunk.get("usage") or self.usage
                for choice in chunk["choices"]:
                    self.text += choice["text"]
                    self.chunks += 1
                    self.finish_reason = choice["finish_reason"] or self.finish_reason

    def result(self) -> tuple:
        self.join(120)
        assert not self.is_alive()
        return self.text, self.finish_reason, self.usage and self.usage["completion_tokens"], self.error


def streams(server: LiveServer, requests: list[dict]) -> list[Stream]:
    started = [Stream(server, request) for request in requests]
    for stream in started:
        stream.start()
    return started


def test_kill_9_during_16_streams_loses_nothing(model_dir):
    requests = [body(i) for i in range(16)]   # 8 run at once, 8 queue: both kinds are in flight at the kill
    for i in (3, 12):   # constrained: the new core's grammar matcher must take up where the old one was
        requests[i] = {**body(i), "ignore_eos": False, "structured_outputs": {"regex": "[a-z]+( [a-z]+)*"}}
    with LiveServer(engine(model_dir, SLOW_STEPS), max_restarts=2) as server:
        expected = [stream.result() for stream in streams(server, requests)]
        assert all(error is None and text for text, _, _, error in expected)
        assert all(expected[i][1:3] == ("length", 40) for i in range(16) if i not in (3, 12))
        cut = streams(server, requests)
        wait_for(lambda: sum(stream.chunks >= 3 for stream in cut) >= 4, 60)
        os.kill(core_pid(server), signal.SIGKILL)
        assert [stream.result() for stream in cut] == expected
        log = server.log()
        assert "exit code -9: killed by SIGKILL" in log and "16 request(s) resumed" in log
        assert server.health() == 200


def test_a_hung_core_is_killed_and_replaced(model_dir):
    hang = {"stage": "forward", "action": "hang", "prompt_token": HANG_TOKEN}
    with LiveServer(engine(model_dir, hang), max_restarts=3, engine_hang_timeout=1.5) as server:
        before = complete(server, body(1, 8)).json()["choices"][0]["text"]
        started = time.monotonic()
        # it hangs every core it reaches: killed and resumed once, then failed by the poison rule
        hung = complete(server, {**body(2, 8), "prompt": [HANG_TOKEN, 5, 6]})
        assert hung.status_code == 500 and "each time the engine core died" in hung.json()["error"]["message"]
        assert time.monotonic() - started > 3   # two hang timeouts
        log = server.log()
        assert log.count("is hung: it made no progress") == 2 and "last step" in log
        wait_for(lambda: server.health() == 200)
        assert complete(server, body(1, 8)).json()["choices"][0]["text"] == before


def test_a_request_in_flight_through_two_deaths_fails_and_others_go_on(model_dir):
    death = {"stage": "forward", "action": "device_error", "prompt_token": DEATH_TOKEN}
    with LiveServer(engine(model_dir, death), max_restarts=3) as server:
        expected = complete(server, body(3)).json()["choices"][0]["text"]
        poison = complete(server, {**body(4), "prompt": [DEATH_TOKEN, 7]})
        assert poison.status_code == 500
        assert "in flight each time the engine core died, 2 times in a row" in poison.json()["error"]["message"]
        log = server.log()
        assert log.count("engine core dead: device error: CUDA error: injected device fault") == 2
        wait_for(lambda: server.health() == 200)
        assert complete(server, body(3)).json()["choices"][0]["text"] == expected
        assert server.process.poll() is None   # two restarts of at most 3


def test_requests_beside_a_poison_request_through_both_deaths_are_retried_alone_and_finish(model_dir):
    death = {"stage": "forward", "action": "device_error", "prompt_token": DEATH_TOKEN}
    requests = [body(i, 30) for i in range(3)]
    with LiveServer(engine(model_dir, SLOW_STEPS, death), max_restarts=3) as server:
        expected = [stream.result() for stream in streams(server, requests)]
        beside = streams(server, requests)
        wait_for(lambda: all(stream.chunks >= 2 for stream in beside), 60)
        poison = complete(server, {**body(4), "prompt": [DEATH_TOKEN, 7]})
        # all four were in flight at both deaths; retried one at a time, the poison request kills a third core
        assert poison.status_code == 500
        assert ("each time the engine core died, 3 times in a row (the last time retried as the only suspect)"
                in poison.json()["error"]["message"])
        assert [stream.result() for stream in beside] == expected
        log = server.log()
        assert log.count("engine core dead: device error: CUDA error: injected device fault") == 3
        assert "retrying them one at a time" in log
        wait_for(lambda: server.health() == 200)
        assert server.process.poll() is None   # three restarts of at most 3


def test_sigterm_while_the_core_restarts_still_drains(model_dir):
    requests = [body(i, 30) for i in range(4)]
    with LiveServer(engine(model_dir, SLOW_STEPS), max_restarts=2) as server:
        expected = [stream.result() for stream in streams(server, requests)]
        cut = streams(server, requests)
        wait_for(lambda: all(stream.chunks >= 2 for stream in cut), 60)
        os.kill(core_pid(server), signal.SIGKILL)
        wait_for(lambda: "starting a new one" in server.log(), 30)
        server.process.send_signal(signal.SIGTERM)
        assert [stream.result() for stream in cut] == expected
        assert server.process.wait(60) == 0
        assert "engine core restarted" in server.log()


def test_nan_logits_or_a_detokenization_error_fail_only_their_request(model_dir):
    nan = {"stage": "sample", "action": "nan", "prompt_token": NAN_TOKEN}
    detokenize = {"stage": "detokenize", "action": "raise", "prompt_token": DETOKENIZE_TOKEN}
    with LiveServer(engine(model_dir, nan, detokenize), max_restarts=0) as server:
        expected = [stream.result() for stream in streams(server, [body(5), body(6)])]
        bad = [{**body(7), "prompt": [NAN_TOKEN, 8, 9]}, {**body(8), "prompt": [DETOKENIZE_TOKEN, 8, 9]}]
        results = [stream.result() for stream in streams(server, [body(5), bad[0], bad[1], body(6)])]
        assert [results[0], results[3]] == expected
        assert "NaN or infinite" in results[1][3]["message"]
        assert results[2][3]["type"] == "server_error"
        assert complete(server, bad[0]).status_code == 500
        assert server.health() == 200 and server.process.poll() is None   # the core never died


def server_connection_open(server: LiveServer, client_port: int) -> bool:
    """Whether the server still holds its end of the connection from ``client_port`` (the kernel's TCP table)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, remote = (int(address.rsplit(":", 1)[1], 16) for address in line.split()[1:3])
            if (local, remote) == (server.port, client_port):
                return True
    return False


def in_flight(server: LiveServer) -> float:
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    return float(re.search(r"^cvllm:num_requests_in_flight\{[^}]*\} (\S+)$", metrics, re.M).group(1))


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="TCP_USER_TIMEOUT is Linux's")
def test_a_client_that_stops_reading_is_dropped_after_the_send_timeout(model_dir):
    slow = {"stage": "forward", "action": "sleep", "seconds": 0.1}   # 200 steps: 20 s, if nobody stops it
    with LiveServer(engine(model_dir, slow), send_timeout=2) as server:
        # a stream of ~1 MB (8 choices with 20 logprobs a token) to a client with a 4 KB receive buffer that
        # never reads and never closes: the server's buffers fill, its sends stall
        request = json.dumps({"prompt": prompt(1), "max_tokens": 200, "n": 8, "logprobs": 20, "ignore_eos": True,
                              "stream": True}).encode()
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", server.port))
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(request), request))
        client_port = stalled.getsockname()[1]
        try:
            started = time.monotonic()
            wait_for(lambda: in_flight(server) == 1, 10)
            wait_for(lambda: not server_connection_open(server, client_port), 15)
            assert time.monotonic() - started > 2   # not at once: only after its data went unread for 2 s
            wait_for(lambda: in_flight(server) == 0, 5)   # its request was aborted in the core, long before its end
            assert time.monotonic() - started < 15
            assert complete(server, body(1, 8)).status_code == 200
            log = server.log()
            assert "dropped a connection whose client left what it was sent unread" in log and "Traceback" not in log
        finally:
            stalled.close()
