"""The engine core in its own process, driven through its asyncio client, on a tiny Llama.

One core process serves most tests (spawning one costs seconds); the kill and shutdown tests
start their own. The client lives in an event loop on a background thread, as in the server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections import defaultdict
from pathlib import Path

import httpx
import pytest

from cvllm import LLM, SamplingParams
from cvllm.engine.config import EngineConfig
from cvllm.engine_process.client import EngineCoreClient, EngineDeadError, RequestError, RequestStream
from cvllm.engine_process.messages import AbortRequests
from cvllm.server.app import build_app
from cvllm.testing import make_checkpoint
from cvllm.testing.fakes import make_state, sse_chunks
from cvllm.testing.faults import FailStepOnPromptToken

FAIL_TOKEN = 500          # prompts holding this token make the core's step raise (EngineConfig.fault_injector)
NUM_KV_BLOCKS = 24
MAX_MODEL_LEN = 256       # the tiny model's max_position_embeddings; 24 blocks of 16 hold more
GREEDY = {"temperature": 0.0, "ignore_eos": True}


class LoopThread:
    """An asyncio loop on its own thread: the client is bound to it, tests submit coroutines."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("core-llama")
    make_checkpoint(path, "llama", seed=5)
    return path


def engine_config(model_dir: Path, fault_injector=None) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="float32", block_size=16, num_kv_blocks=NUM_KV_BLOCKS,
                        max_num_seqs=8, fault_injector=fault_injector)


@pytest.fixture(scope="module")
def loop():
    thread = LoopThread()
    yield thread
    thread.close()


async def start_client(model_dir: Path, fail_token: int | None = None) -> EngineCoreClient:
    # the injector travels to the spawned core inside its config
    injector = None if fail_token is None else FailStepOnPromptToken(fail_token)
    return await EngineCoreClient.start(engine_config(model_dir, injector), startup_timeout=120)


@pytest.fixture(scope="module")
def client(loop, model_dir):
    client = loop.run(start_client(model_dir, fail_token=FAIL_TOKEN), timeout=150)
    yield client
    loop.run(client.shutdown())


@pytest.fixture(scope="module")
def reference(model_dir):
    """The same engine in-process: what the client's output must equal."""
    return LLM(model=str(model_dir), dtype="float32", block_size=16, num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=8)


async def collect(stream: RequestStream) -> tuple[dict[int, list[int]], dict[int, str], list]:
    """Every completion's tokens, finish reasons, and all deltas as received."""
    tokens: dict[int, list[int]] = defaultdict(list)
    reasons: dict[int, str] = {}
    received = []
    async for deltas in stream:
        for delta in deltas:
            assert delta.index not in reasons, "a delta after the completion finished"
            tokens[delta.index] += delta.token_ids
            if delta.finish_reason is not None:
                reasons[delta.index] = delta.finish_reason
            received.append(delta)
    return dict(tokens), reasons, received


async def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the core"
        await asyncio.sleep(0.01)


def prompt(length: int, start: int = 10) -> list[int]:
    return [(start + 37 * i) % 480 + 10 for i in range(length)]


def cpu_seconds(pid: int) -> float:
    try:
        import psutil
    except ImportError:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime, all threads
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


# -- the shared core ------------------------------------------------------------------------------


def test_ready_describes_the_engine(client):
    info = client.info
    assert (info.max_model_len, info.num_kv_blocks, info.block_size) == (MAX_MODEL_LEN, NUM_KV_BLOCKS, 16)
    assert (info.backend, info.dtype, info.max_num_seqs, info.vocab_size) == ("cpu", "float32", 8, 512)
    assert client.dead is None and client.pid != os.getpid()


def test_concurrent_greedy_requests_match_the_in_process_engine(client, loop, reference):
    requests = {  # request id: (prompt, params)
        "a": (prompt(5), SamplingParams(max_tokens=12, **GREEDY)),
        "b": (prompt(23, 3), SamplingParams(n=2, max_tokens=9, **GREEDY)),
        "c": (prompt(40, 7), SamplingParams(max_tokens=14, logprobs=2, **GREEDY)),
        "d": (prompt(11, 5), SamplingParams(n=2, max_tokens=6, **GREEDY)),
    }
    expected = reference.generate([{"prompt_token_ids": ids} for ids, _ in requests.values()],
                                  [params for _, params in requests.values()])

    async def run_all():
        streams = [client.add_request(rid, ids, params) for rid, (ids, params) in requests.items()]
        assert client.num_in_flight == len(requests)
        return await asyncio.gather(*(collect(stream) for stream in streams))

    results = loop.run(run_all())
    assert client.num_in_flight == 0
    for (ids, params), want, (tokens, reasons, deltas) in zip(requests.values(), expected, results):
        assert sorted(tokens) == list(range(params.n))
        for index in range(params.n):   # greedy: every one of the n completions is the same
            assert tokens[index] == want.outputs[0].token_ids
            assert reasons[index] == "length"
        assert all(delta.num_prompt_tokens == len(ids) for delta in deltas)
    # logprobs travel as (sampled, top ids, top logprobs) and equal the in-process ones
    _, _, deltas = results[2]
    sent = [lp for delta in deltas for lp in delta.logprobs]
    want = expected[2].outputs[0]
    assert len(sent) == len(want.token_ids) == 14
    for got, entry, token in zip(sent, want.logprobs, want.token_ids):
        assert got.logprob == pytest.approx(entry[token].logprob, abs=1e-4)
        top = sorted((lp.rank, tid) for tid, lp in entry.items() if lp.rank is not None)
        assert got.top_ids == [tid for _, tid in top] and got.top_ids[0] == token   # greedy: the top one
        assert got.top_logprobs == pytest.approx([entry[tid].logprob for _, tid in top], abs=1e-4)


def test_a_repeated_prompt_reports_its_prefix_cache_hits_once(client, loop):
    ids, params = prompt(37, 61), SamplingParams(max_tokens=4, **GREEDY)

    async def run(request_id: str) -> list[int]:
        _, _, deltas = await collect(client.add_request(request_id, ids, params))
        return [delta.num_cached_tokens for delta in deltas]

    assert loop.run(run("cold")) == [0, 0, 0, 0]
    # whole blocks of 16 within the first 36 tokens (the last prompt token is always computed), on the first delta
    assert loop.run(run("warm")) == [32, 0, 0, 0]


def test_abort_mid_generation_frees_the_requests_blocks(client, loop):
    async def scenario():
        generated_before = client.stats.generated_tokens
        stream = client.add_request("long", prompt(40), SamplingParams(max_tokens=200, **GREEDY))
        first = await anext(stream)
        assert first[0].token_ids and first[0].finish_reason is None
        in_use = client.stats.kv_blocks_total - client.stats.kv_blocks_free
        stream.abort()
        client.abort("long")   # idempotent
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        await wait_until(lambda: client.stats.running == 0
                         and client.stats.kv_blocks_free == client.stats.kv_blocks_total)
        return in_use, client.stats.generated_tokens - generated_before

    in_use, generated = loop.run(scenario())
    assert in_use >= 3   # 40 prompt tokens and more: at least 3 blocks of 16 were held before the abort
    assert generated < 200
    assert client.num_in_flight == 0


def test_a_stop_string_stops_one_choice_in_the_core_while_its_sibling_runs_on(client, loop, reference, monkeypatch):
    """n=2 through the server and the core process: the choice a stop string ended is stopped in the core at once
    (not generated until its sibling ends), the other runs to max_tokens, and the reply is the same as without it."""
    tokenizer = reference.get_tokenizer()
    state = make_state(tokenizer, client)
    max_tokens = 128
    body = {"prompt": "once upon a time", "n": 2, "max_tokens": max_tokens, "temperature": 1.0, "seed": 11,
            "ignore_eos": True}

    async def post(payload: dict) -> tuple[httpx.Response, int]:
        before = client.stats.generated_tokens
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            response = await http.post("/v1/completions", json=payload)
        await wait_until(lambda: client.num_in_flight == 0 and client.stats.running == 0
                         and client.stats.kv_blocks_free == client.stats.kv_blocks_total)
        return response, client.stats.generated_tokens - before

    sent = []   # what the client sends the core, recorded on its way
    real_send = client._send
    monkeypatch.setattr(client, "_send", lambda message: sent.append(message) or real_send(message))

    free, generated = loop.run(post(body))
    texts = [choice["text"] for choice in sorted(free.json()["choices"], key=lambda c: c["index"])]
    assert generated == 2 * max_tokens
    # a stop string that choice 0 completes within its first tokens and choice 1 never has
    ids = tokenizer.encode(texts[0], add_special_tokens=False)
    early = len(tokenizer.decode(ids[:6]))
    stop = next(texts[0][i:i + 3] for i in range(early - 3) if texts[0][i:i + 3].strip()
                and texts[0][i:i + 3] not in texts[1])
    cut = texts[0][:texts[0].index(stop)]

    for stream in (False, True):
        response, generated = loop.run(post({**body, "stop": [stop], "stream": stream,
                                             **({"stream_options": {"include_usage": True}} if stream else {})}))
        assert response.status_code == 200
        if stream:
            chunks = sse_chunks(response)
            got = {0: "", 1: ""}
            reasons = {}
            for chunk in chunks:
                for choice in chunk["choices"]:
                    got[choice["index"]] += choice["text"]
                    if choice["finish_reason"]:
                        reasons[choice["index"]] = choice["finish_reason"]
            usage = chunks[-1]["usage"]
        else:
            reply = response.json()
            got = {c["index"]: c["text"] for c in reply["choices"]}
            reasons = {c["index"]: c["finish_reason"] for c in reply["choices"]}
            usage = reply["usage"]
        assert got == {0: cut, 1: texts[1]} and reasons == {0: "stop", 1: "length"}
        kept = usage["completion_tokens"] - max_tokens   # choice 0's tokens, up to the one completing the stop
        assert 0 < kept < 8
        # the server told the core to stop choice 0 alone, and the core did: fewer than the 2 x 128 tokens the
        # request generates without it (how many fewer depends on how far the API process lags the core)
        partial = [m for m in sent if isinstance(m, AbortRequests) and m.indices is not None]
        assert [m.indices for m in partial] == [[0]], sent
        assert generated < 2 * max_tokens, (generated, kept)
        sent.clear()


def test_a_failing_step_fails_its_request_and_the_core_keeps_serving(client, loop, reference):
    params = SamplingParams(max_tokens=8, **GREEDY)

    async def scenario():
        bad = client.add_request("bad", [11, FAIL_TOKEN, 12, 13], params)
        with pytest.raises(RequestError) as failure:
            await collect(bad)
        assert not isinstance(failure.value, EngineDeadError)
        good = client.add_request("after-bad", prompt(9), params)
        tokens, _, _ = await collect(good)
        await wait_until(lambda: client.stats.kv_blocks_free == client.stats.kv_blocks_total)
        return failure.value, tokens[0]

    error, tokens = loop.run(scenario())
    assert "injected step failure" in str(error) and "Traceback" not in str(error)
    assert not error.invalid_request
    assert client.dead is None
    assert tokens == reference.generate({"prompt_token_ids": prompt(9)}, params)[0].outputs[0].token_ids


def test_a_too_long_prompt_fails_only_that_request(client, loop, reference):
    params = SamplingParams(max_tokens=5, **GREEDY)

    async def scenario():
        too_long = client.add_request("too-long", prompt(MAX_MODEL_LEN + 10), params)
        fine = client.add_request("fine", prompt(12, 9), params)
        with pytest.raises(RequestError) as failure:
            await anext(too_long)
        tokens, reasons, _ = await collect(fine)
        return failure.value, tokens[0], reasons[0]

    error, tokens, reason = loop.run(scenario())
    assert error.invalid_request and "maximum model length" in str(error)
    assert reason == "length"
    assert tokens == reference.generate({"prompt_token_ids": prompt(12, 9)}, params)[0].outputs[0].token_ids


def test_duplicate_request_ids_are_refused(client, loop):
    async def scenario():
        stream = client.add_request("dup", prompt(8), SamplingParams(max_tokens=30, **GREEDY))
        with pytest.raises(ValueError, match="already in flight"):
            client.add_request("dup", prompt(8), SamplingParams())
        stream.abort()
        await wait_until(lambda: client.stats.running == 0)

    loop.run(scenario())
    assert client.num_in_flight == 0


def test_an_idle_core_uses_no_cpu(client, loop):
    loop.run(wait_until(lambda: client.num_in_flight == 0 and client.stats.running == 0))
    time.sleep(0.5)   # let OpenMP worker threads stop spinning after the last step
    before = cpu_seconds(client.pid)
    time.sleep(1.0)
    # blocked on the pipe it uses nothing; even a loop polling every millisecond burns 20-30 ms a second
    assert cpu_seconds(client.pid) - before <= 0.011   # one clock tick of slack


# -- processes of their own -----------------------------------------------------------------------


def test_killing_the_core_fails_open_streams_and_marks_it_dead(loop, model_dir):
    async def scenario():
        client = await start_client(model_dir)
        stream = client.add_request("doomed", prompt(20), SamplingParams(max_tokens=200, **GREEDY))
        await anext(stream)
        os.kill(client.pid, signal.SIGKILL)
        with pytest.raises(RequestError) as failure:
            while True:
                await anext(stream)
        assert isinstance(failure.value, EngineDeadError)
        with pytest.raises(RequestError):
            client.add_request("later", prompt(5), SamplingParams())
        await client.shutdown(timeout=2)   # still safe on a dead core
        return client

    client = loop.run(scenario())
    assert "exited unexpectedly" in client.dead and str(-signal.SIGKILL) in client.dead
    assert client.exit_code == -signal.SIGKILL and client.num_in_flight == 0


def test_shutdown_is_clean_and_ends_open_streams(loop, model_dir):
    async def scenario():
        client = await start_client(model_dir)
        stream = client.add_request("cut-short", prompt(20), SamplingParams(max_tokens=200, **GREEDY))
        await anext(stream)
        started = time.monotonic()
        await client.shutdown(timeout=10)
        took = time.monotonic() - started
        with pytest.raises(EngineDeadError):
            while True:
                await anext(stream)
        with pytest.raises(RequestError):
            client.add_request("after", prompt(5), SamplingParams())
        return client, took

    client, took = loop.run(scenario())
    assert client.exit_code == 0 and took < 10   # it exited by itself, not killed at the timeout
    assert client.dead == "the engine core was shut down"
