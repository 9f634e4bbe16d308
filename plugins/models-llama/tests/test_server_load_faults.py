"""Load faults under a live cvserve, with nothing lost (issue 23, item 3): a burst of long prompts that exhausts a small
KV pool (sequences are preempted and recomputed, every answer is the one the request gets alone), a client that stops
reading a long stream (the server's memory for it stays bounded by the request's own output and other requests go
on), and 1,000 clients that hang up mid-stream (everything is freed, and each is counted as an abort)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from pathlib import Path

import httpx
import pytest

import cvllm.testing.server as live_server
from cvllm.testing import make_checkpoint
from cvllm.testing.server import LiveServer

# In the server's API process: when a request's last completion ends in the core, log how many deltas (and tokens)
# wait in its RequestStream for the response to take them, i.e. what the server holds for a client that stopped
# reading. A stream that keeps up has only that last step's.
PENDING_PROBE = """
import logging
from cvllm.engine_process.client import RequestStream
_deliver = RequestStream._deliver
def _probed_deliver(self, delta):
    _deliver(self, delta)
    if self._ended:
        logging.getLogger("cvllm.test.probe").warning("pending at the end of %s: %d deltas, %d tokens",
            self.request_id, len(self._pending), sum(len(d.token_ids) for d in self._pending))
RequestStream._deliver = _probed_deliver
"""
PENDING = re.compile(r"pending at the end of (\S+)-0: (\d+) deltas, (\d+) tokens")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("server-load-faults")
    make_checkpoint(path, "llama", seed=3)   # max_position_embeddings 256: every request here fits
    return path


def engine(model_dir, **settings) -> dict:
    return {"model": str(model_dir), "dtype": "float32", "backend": "cpu", **settings}


def metrics(server: LiveServer) -> str:
    return httpx.get(server.url + "/metrics", timeout=30).text


def metric(text: str, name: str, **labels: str) -> float:
    """A sample's value; with ``labels``, the sample that has them (0 when there is none yet)."""
    for match in re.finditer(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", text, re.M):
        if all(f'{key}="{value}"' in (match.group(1) or "") for key, value in labels.items()):
            return float(match.group(2))
    assert labels, f"{name} missing from /metrics"
    return 0.0


def wait_idle(server: LiveServer, timeout: float = 30.0) -> str:
    """/metrics once nothing runs, waits or is in flight and every KV block is free (asserted)."""
    deadline = time.monotonic() + timeout
    while True:
        text = metrics(server)
        idle = all(metric(text, f"cvllm:{name}") == 0 for name in (
            "num_requests_running", "num_requests_waiting", "num_requests_in_flight", "kv_cache_blocks_used"))
        if idle or time.monotonic() > deadline:
            assert idle, text
            assert metric(text, "cvllm:kv_cache_blocks_total") > 0
            return text
        time.sleep(0.1)


def completion(server: LiveServer, request: dict) -> dict:
    response = httpx.post(server.url + "/v1/completions", json=request, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def greedy(prompt, max_tokens: int, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def http_post(port: int, path: str, request: dict) -> bytes:
    body = json.dumps(request).encode()
    return (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (path.encode(), port, len(body), body))


def dechunk(body: bytes) -> bytes:
    """A chunked HTTP/1.1 body's bytes (it must be complete: the zero-size chunk ends it)."""
    out, at = [], 0
    while True:
        end = body.index(b"\r\n", at)
        size = int(body[at:end], 16)
        if size == 0:
            return b"".join(out)
        out.append(body[end + 2:end + 2 + size])
        at = end + 2 + size + 2


# -- (a) a burst of long prompts exhausts the KV pool ---------------------------------------------------------------

BURST, PROMPT_TOKENS, BURST_TOKENS, BLOCK_SIZE = 16, 96, 16, 16
# A prompt fills 6 blocks exactly, so its first decode takes a 7th, which lasts to its 16th token. The pool holds two
# decoding requests and one prompt: whenever two decode and a third waits, the third is admitted (its prompt just
# fits) and, unless one of the two ends that step, finds no block for its first decode: it is preempted, however the
# burst's requests reach the engine, all at once or one a step. Missing it would take a burst run at most two at a
# time, its requests some 8 steps apart (one lives 16): they reach the engine within ~10 steps, loaded machine or
# not. (With 32 blocks, 4 decodes and 4 spare, the pool overflowed only when one step admitted three or more prompts
# to make five in flight: when a loaded machine let the first three in one a step, it never did.)
PROMPT_BLOCKS = PROMPT_TOKENS // BLOCK_SIZE
POOL_BLOCKS = 2 * (PROMPT_BLOCKS + 1) + PROMPT_BLOCKS   # 20
# (the KV a request writes, its prompt and all its tokens but the last, fills those 7 blocks and no 8th)
assert PROMPT_TOKENS % BLOCK_SIZE == 0 and PROMPT_TOKENS + BURST_TOKENS - 1 <= (PROMPT_BLOCKS + 1) * BLOCK_SIZE


def long_prompt(i: int) -> list[int]:
    return [(11 + 37 * i + 7 * j) % 480 + 10 for j in range(PROMPT_TOKENS)]


def test_a_burst_past_the_kv_pool_preempts_and_loses_nothing(model_dir):
    settings = engine(model_dir, num_kv_blocks=POOL_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=BURST)
    with LiveServer(settings, log_level="warning") as server:
        before = metric(metrics(server), "cvllm:num_preemptions_total")

        async def one(client: httpx.AsyncClient, i: int) -> tuple[str, str, int]:
            request = greedy(long_prompt(i), BURST_TOKENS)
            if i % 2:   # half of them streamed: a preempted stream goes on after what it already sent
                text, finish, tokens = "", None, None
                request.update(stream=True, stream_options={"include_usage": True})
                async with client.stream("POST", "/v1/completions", json=request) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            for choice in chunk["choices"]:
                                text, finish = text + choice["text"], choice["finish_reason"] or finish
                            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                return text, finish, tokens
            response = await client.post("/v1/completions", json=request)
            assert response.status_code == 200, response.text
            body = response.json()
            return body["choices"][0]["text"], body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]

        async def burst():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                return await asyncio.gather(*(one(client, i) for i in range(BURST)))

        together = asyncio.run(burst())
        text = wait_idle(server)
        assert metric(text, "cvllm:num_preemptions_total") > before
        assert all(finish == "length" and tokens == BURST_TOKENS for _, finish, tokens in together), together
        alone = [completion(server, greedy(long_prompt(i), BURST_TOKENS))["choices"][0]["text"] for i in range(BURST)]
        assert [text for text, _, _ in together] == alone
        wait_idle(server)


# -- the server for (b) and (c) -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(model_dir):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(live_server, "_BOOT", PENDING_PROBE + live_server._BOOT)
        live = LiveServer(engine(model_dir, max_num_seqs=64), log_level="warning").start()
    try:
        yield live
    finally:
        live.close()


# -- (b) a client that stops reading a long stream ------------------------------------------------------------------

SLOW_N, SLOW_TOKENS, SLOW_LOGPROBS = 8, 120, 20


def api_rss_kib(server: LiveServer) -> int:
    with open(f"/proc/{server.process.pid}/status") as f:
        return int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M).group(1))


def stalled_reader(port: int) -> socket.socket:
    """A connection whose reader will stop: a small receive buffer, and a small MSS. On loopback (an MSS of 64 KiB)
    Linux sizes the server's send buffer at its 4 MiB maximum, which would take a whole stream of this tiny model
    before the server felt the stop; with 536-byte segments it holds a few hundred KiB."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.settimeout(60)
    sock.connect(("127.0.0.1", port))
    return sock


def others(server: LiveServer) -> tuple[list[str], float]:
    """Four short requests at once: their texts and the seconds they took."""
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            replies = await asyncio.gather(*(client.post("/v1/completions", json=greedy(f"another request {i}", 16))
                                             for i in range(4)))
        assert all(r.status_code == 200 for r in replies)
        return [r.json()["choices"][0]["text"] for r in replies]

    started = time.monotonic()
    texts = asyncio.run(run())
    return texts, time.monotonic() - started


@pytest.mark.skipif(not hasattr(socket, "TCP_MAXSEG") or not Path("/proc/self/status").exists(),
                    reason="keeps the kernel's buffers small with TCP_MAXSEG, reads the server's memory from /proc")
def test_a_stalled_reader_holds_only_its_own_output_and_others_go_on(server):
    request = greedy("a client that stops reading", SLOW_TOKENS, n=SLOW_N, logprobs=SLOW_LOGPROBS, stream=True)
    expected = completion(server, {**request, "n": 1, "logprobs": None, "stream": False})["choices"][0]["text"]
    baseline, base_seconds = others(server)
    rss_before = api_rss_kib(server)
    sock = stalled_reader(server.port)
    try:
        sock.sendall(http_post(server.port, "/v1/completions", request))
        received = b""
        while not (first := re.search(rb'"id":"(cmpl-[0-9a-f]+)"', received)):
            data = sock.recv(512)
            assert data, received
            received += data
        assert received.startswith(b"HTTP/1.1 200"), received
        request_id = first.group(1).decode()
        # it reads no more: others are served meanwhile, while its request generates beside them
        assert others(server)[0] == baseline
        deadline = time.monotonic() + 60
        while not (ended := [m for m in PENDING.findall(server.log()) if m[0] == request_id]):
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.1)
        # the core generated to the end without waiting for the reader and freed everything, the response still open
        wait_idle(server)
        pending, pending_tokens = int(ended[0][1]), int(ended[0][2])
        # the reader's stop reached the server (its tokens wait there, not in a socket buffer) ...
        assert pending_tokens > SLOW_N * SLOW_TOKENS // 4, (pending, pending_tokens)
        # ... which holds one delta per completion per step at most: the request's own output, bounded by max_tokens
        assert pending <= SLOW_N * SLOW_TOKENS, pending
        grown = api_rss_kib(server) - rss_before
        assert grown < 16 << 10, f"the API process grew by {grown} KiB"
        # a stalled connection costs the others nothing (loose: this machine's load comes and goes)
        after, after_seconds = others(server)
        assert after == baseline
        assert after_seconds < 3 * base_seconds + 3, (base_seconds, after_seconds)
        # and the reader, reading again, gets every token
        while not received.endswith(b"\r\n0\r\n\r\n"):
            data = sock.recv(1 << 16)
            assert data, "the server closed the stream early"
            received += data
    finally:
        sock.close()
    events = dechunk(received.split(b"\r\n\r\n", 1)[1]).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    texts, tokens, finish = [""] * SLOW_N, [0] * SLOW_N, [None] * SLOW_N
    for event in events[:-2]:
        for choice in json.loads(event.removeprefix("data: "))["choices"]:
            index = choice["index"]
            texts[index] += choice["text"]
            tokens[index] += len(choice["logprobs"]["tokens"]) if choice["logprobs"] else 0
            finish[index] = choice["finish_reason"] or finish[index]
    assert texts == [expected] * SLOW_N
    assert tokens == [SLOW_TOKENS] * SLOW_N and finish == ["length"] * SLOW_N


# -- (c) 1,000 clients hang up mid-stream ---------------------------------------------------------------------------

DISCONNECTS, AT_ONCE = 1000, 50


def test_1000_disconnects_mid_stream_free_everything(server):
    probe = greedy([21, 22, 23, 24], 8)
    before_text = completion(server, probe)["choices"][0]["text"]
    aborts_before = metric(metrics(server), "cvllm:request_success_total", finished_reason="abort")

    async def hang_up(i: int, slots: asyncio.Semaphore) -> None:
        async with slots:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            try:
                # 200 tokens: far more than a request makes before its client's hang-up reaches the server
                writer.write(http_post(server.port, "/v1/completions",
                                       greedy([10 + i % 400, 11, 12, 13 + i // 400], 200, stream=True)))
                status = await reader.readline()
                assert status.startswith(b"HTTP/1.1 200"), status
                while not (await reader.readline()).startswith(b"data: {"):
                    pass   # the headers, then the first chunk's size line
            finally:
                writer.close()
                await writer.wait_closed()

    async def run():
        slots = asyncio.Semaphore(AT_ONCE)
        await asyncio.gather(*(hang_up(i, slots) for i in range(DISCONNECTS)))

    asyncio.run(run())
    text = wait_idle(server)
    # each is counted once, as an abort: its only choice had no finish reason of its own when its client left
    assert metric(text, "cvllm:request_success_total", finished_reason="abort") - aborts_before == DISCONNECTS
    assert server.health() == 200
    assert completion(server, probe)["choices"][0]["text"] == before_text
