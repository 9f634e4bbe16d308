"""`cvllm chat` and `cvllm bench` against fake servers (httpx.MockTransport) that stream known SSE."""

from __future__ import annotations

import asyncio
import io
import json
import math
import socket

import httpx
import pytest
from rich.console import Console

from cvllm import cli
from cvllm.clients import api_url, server_root, sse_events
from cvllm.clients import bench as bench_mod
from cvllm.clients import chat as chat_mod
from cvllm.clients.bench import BenchOptions, RequestRecord, describe_error, percentile, run_level, summarize
from cvllm.clients.chat import ChatDelta, ChatError, ChatOptions, ChatSession, run_repl, stream_chat


def sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def chat_chunk(content: str | None = None, reasoning: str | None = None, finish: str | None = None) -> dict:
    delta = {}
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta["reasoning_content"] = delta["reasoning"] = reasoning  # as the server sends it: both names
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


# -- helpers ---------------------------------------------------------------------------------------

def test_urls():
    assert api_url("http://h:2000") == "http://h:2000/v1"
    assert api_url("http://h:2000/v1/") == "http://h:2000/v1"
    assert api_url("http://h/proxy/v1") == "http://h/proxy/v1"
    assert server_root("http://h:2000/v1") == "http://h:2000"


def test_sse_events_follow_the_format():
    lines = [": a comment", "data: {\"a\": 1}", "", "event: ignored", "data: {\"b\":", "data: 2}\r", "",
             "data:{\"c\": 3}", "", "data: [DONE]", "", "data: {\"after\": 1}", ""]
    assert list(sse_events(lines)) == [{"a": 1}, {"b": 2}, {"c": 3}]
    assert list(sse_events(["data: {\"last\": true}"])) == [{"last": True}]  # no final blank line


# -- chat ------------------------------------------------------------------------------------------

def test_stream_chat_yields_content_and_reasoning():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get("authorization"), json.loads(request.content)))
        body = sse(chat_chunk(content=""), chat_chunk(reasoning="Let me"), chat_chunk(reasoning=" think."),
                   chat_chunk(content="Hel"), chat_chunk(content="lo **there**"), chat_chunk(finish="stop"),
                   {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}},
                   "[DONE]")
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        deltas = list(stream_chat(client, "http://x:2000/v1", {"messages": []}, api_key="k"))
    assert deltas == [ChatDelta(), ChatDelta(reasoning="Let me"), ChatDelta(reasoning=" think."),
                      ChatDelta("Hel"), ChatDelta("lo **there**"), ChatDelta(finish_reason="stop"),
                      ChatDelta(usage={"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9})]
    assert seen == [("/v1/chat/completions", "Bearer k", {"messages": [], "stream": True})]


def test_stream_chat_errors():
    def refuse(request):
        return httpx.Response(400, json={"error": {"message": "temperature must be >= 0", "type": "bad"}})

    with httpx.Client(transport=httpx.MockTransport(refuse)) as client:
        with pytest.raises(ChatError, match="^HTTP 400: temperature must be >= 0$"):
            list(stream_chat(client, "http://x/v1", {}))

    def fail_midway(request):
        return httpx.Response(200, content=sse(chat_chunk(content="par"), {"error": {"message": "engine died"}},
                                               "[DONE]"))

    with httpx.Client(transport=httpx.MockTransport(fail_midway)) as client:
        got = []
        with pytest.raises(ChatError, match="^engine died$"):
            for delta in stream_chat(client, "http://x/v1", {}):
                got.append(delta.content)
        assert got == ["par"]

    def unreachable(request):
        raise httpx.ConnectError("connection refused")

    with httpx.Client(transport=httpx.MockTransport(unreachable)) as client:
        with pytest.raises(ChatError, match="cannot reach http://x/v1 .*is cvserve running"):
            list(stream_chat(client, "http://x/v1", {}))


class FakeChatServer:
    """Answers turn k with "Reply k" (and reasoning when thinking is on); turn `fail_on` gets a 503."""

    def __init__(self, fail_on: int | None = None):
        self.requests: list[dict] = []
        self.fail_on = fail_on

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny-model"}]})
        body = json.loads(request.content)
        self.requests.append(body)
        turn = len(self.requests)
        if turn == self.fail_on:
            return httpx.Response(503, json={"error": {"message": "the engine is not ready"}})
        thinking = body.get("chat_template_kwargs", {}).get("enable_thinking")
        chunks = [chat_chunk(content="")]
        if thinking:
            chunks.append(chat_chunk(reasoning=f"pondering {turn}"))
        chunks += [chat_chunk(content="Reply "), chat_chunk(content=f"*{turn}*"), chat_chunk(finish="stop")]
        return httpx.Response(200, content=sse(*chunks, "[DONE]"))


def scripted(lines: list[str]):
    queue = list(lines)

    def read_line(prompt: str) -> str:
        if not queue:
            raise EOFError
        return queue.pop(0)
    return read_line


def run_chat(server: FakeChatServer, lines: list[str], options: ChatOptions) -> tuple[ChatSession, str]:
    out = io.StringIO()
    console = Console(file=out, width=80, color_system=None)
    with httpx.Client(transport=httpx.MockTransport(server)) as client:
        session = ChatSession(options, client)
        assert run_repl(session, console, scripted(lines)) == 0
    return session, out.getvalue()


def test_repl_keeps_history_and_resets():
    server = FakeChatServer()
    options = ChatOptions(url="http://x:2000", system="Be brief.", temperature=0.5, top_k=20, max_tokens=64)
    session, out = run_chat(server, ["Hello", "", "Again", "/reset", "Third", "/help", "/exit", "never sent"],
                            options)
    system = {"role": "system", "content": "Be brief."}
    assert [r["messages"] for r in server.requests] == [
        [system, {"role": "user", "content": "Hello"}],
        [system, {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Reply *1*"},
         {"role": "user", "content": "Again"}],
        [system, {"role": "user", "content": "Third"}],
    ]
    assert all(r["temperature"] == 0.5 and r["top_k"] == 20 and r["max_tokens"] == 64 for r in server.requests)
    assert all("chat_template_kwargs" not in r and "top_p" not in r for r in server.requests)
    assert session.history == [{"role": "user", "content": "Third"}, {"role": "assistant", "content": "Reply *3*"}]
    # Markdown is rendered (the emphasis markers are gone), each reply once.
    assert [line.strip() for line in out.splitlines() if line.startswith("Reply")] == ["Reply 1", "Reply 2",
                                                                                          "Reply 3"]
    assert "conversation cleared" in out and "unknown command /help" in out


def test_repl_thinking_and_errors():
    server = FakeChatServer(fail_on=2)
    session, out = run_chat(server, ["one", "two", "three"], ChatOptions(thinking=True))
    assert all(r["chat_template_kwargs"] == {"enable_thinking": True} for r in server.requests)
    assert "pondering 1" in out and "pondering 3" in out
    assert "error: HTTP 503: the engine is not ready" in out
    # The failed turn left nothing behind: turn 3 carries turn 1's exchange only.
    assert server.requests[2]["messages"] == [
        {"role": "user", "content": "one"}, {"role": "assistant", "content": "Reply *1*"},
        {"role": "user", "content": "three"}]
    assert len(session.history) == 4


def test_chat_command_line(monkeypatch):
    server = FakeChatServer()
    args = cli.build_parser().parse_args(["chat", "--url", "http://x:2000/v1", "--no-thinking", "--top-p", "0.8"])
    monkeypatch.delenv("CVLLM_API_KEY", raising=False)
    out = io.StringIO()
    client = httpx.Client(transport=httpx.MockTransport(server))
    code = chat_mod.main(args, client=client, console=Console(file=out, width=80), read_line=scripted(["hi"]))
    assert code == 0
    assert "cvllm chat with tiny-model at http://x:2000/v1" in out.getvalue()
    assert server.requests[0]["chat_template_kwargs"] == {"enable_thinking": False}
    assert server.requests[0]["top_p"] == 0.8


@pytest.mark.parametrize("model", [None, "named-model"])   # naming the model must not skip the check
def test_chat_fails_at_start_when_the_server_cannot_be_reached(model, capsys):
    with socket.socket() as closed:   # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    argv = ["chat", "--url", f"http://127.0.0.1:{port}"] + (["--model", model] if model else [])
    out = io.StringIO()

    def no_prompt(prompt: str) -> str:
        pytest.fail("started the prompt loop with no server to talk to")

    code = chat_mod.main(cli.build_parser().parse_args(argv), console=Console(file=out), read_line=no_prompt)
    assert code == 1 and out.getvalue() == ""
    url = f"http://127.0.0.1:{port}/v1"
    assert capsys.readouterr().err == f"cvllm chat: error: cannot reach {url}: connection refused\n"


# -- bench -----------------------------------------------------------------------------------------

def test_percentile_interpolates_linearly():
    values = [float(v) for v in range(10, 0, -1)]  # unsorted on purpose
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_summarize_counts_and_latencies():
    records = [
        RequestRecord(start=0.0, end=1.0, chunk_times=[0.2, 0.4, 1.0], output_tokens=5),
        RequestRecord(start=0.5, end=2.0, chunk_times=[1.0, 2.0], output_tokens=2),
        RequestRecord(start=0.0, end=0.1, error="HTTP 429: queue full"),
        RequestRecord(start=0.0, end=0.1, error="HTTP 429: queue full"),
    ]
    s = summarize(records, concurrency=2, wall=2.0, cpu=0.5)
    assert (s["requests"], s["completed"], s["errors"]) == (4, 2, 2)
    assert s["error_messages"] == {"HTTP 429: queue full": 2}
    assert (s["requests_per_s"], s["output_tokens"], s["output_tok_per_s"]) == (1.0, 7, 3.5)
    assert s["ttft_ms"]["p50"] == pytest.approx(350.0)             # 200 and 500 ms
    assert s["itl_ms"]["mean"] == pytest.approx((200 + 600 + 1000) / 3)
    assert s["tpot_ms"]["p50"] == pytest.approx((200 + 1000) / 2)  # 0.8 s / 4 and 1.0 s / 1
    assert s["e2e_ms"]["p90"] == pytest.approx(1000 + 0.9 * 500)
    assert s["client_cpu_percent"] == pytest.approx(25.0)
    assert s["failed_after_s"] == [0.1, 0.1] and s["failed_chunks"] == [0, 0]


def test_describe_error_names_the_cause_of_a_bare_error():
    try:
        try:
            raise ConnectionResetError(104, "Connection reset by peer")
        except ConnectionResetError as reset:
            raise httpx.ReadError("") from reset
    except httpx.ReadError as exc:
        assert describe_error(exc) == "ReadError:  <- ConnectionResetError: [Errno 104] Connection reset by peer"
    assert describe_error(httpx.ConnectError("refused")) == "ConnectError: refused"


class FakeCompletionServer:
    """Streams /v1/completions on a fake clock: request k's first token after ttfts[k], then one
    token every `itl` seconds. Counts requests in flight; answers /tokenize with a fixed pool."""

    def __init__(self, ttfts=None, itl=0.02, fail=(), fail_midway=()):
        self.now = 0.0
        self.ttfts, self.itl, self.fail, self.fail_midway = ttfts, itl, set(fail), set(fail_midway)
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0

    def clock(self) -> float:
        return self.now

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize":
            assert json.loads(request.content)["add_special_tokens"] is False
            return httpx.Response(200, json={"tokens": [11, 12, 13], "count": 3, "max_model_len": 64})
        body = json.loads(request.content)
        k = len(self.bodies)
        self.bodies.append(body)
        if k in self.fail:
            return httpx.Response(500, json={"error": {"message": "boom"}})
        if not body["stream"]:
            n = body["max_tokens"]
            return httpx.Response(200, json={"choices": [{"index": 0, "text": "t" * n, "finish_reason": "length"}],
                                             "usage": {"prompt_tokens": 4, "completion_tokens": n,
                                                       "total_tokens": 4 + n}})
        return httpx.Response(200, content=self._stream(k, body["max_tokens"]))

    async def _stream(self, k: int, max_tokens: int):
        # In flight until the last chunk is handed over (the client stops reading at [DONE], so
        # code after the final yield would never run).
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        yield sse({"choices": [{"index": 0, "text": "", "finish_reason": None}]})
        for i in range(max_tokens):
            self.now += self.ttfts[k] if i == 0 and self.ttfts else self.itl
            await asyncio.sleep(0)  # let the other streams interleave
            if k in self.fail_midway and i == 1:
                self.in_flight -= 1
                yield sse({"error": {"message": "step failed"}}, "[DONE]")
                return
            yield sse({"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]})
        self.in_flight -= 1
        yield sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
                  {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": max_tokens,
                                            "total_tokens": 4 + max_tokens}}, "[DONE]")


def test_run_level_measures_known_timings():
    server = FakeCompletionServer(ttfts=[0.01, 0.02, 0.03, 0.04, 0.05], itl=0.02)
    options = BenchOptions(url="http://x:2000/v1", model="m", input_len=4, output_len=6)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as client:
            return await run_level(client, options, [[1, 2, 3, 4]] * 5, concurrency=1, clock=server.clock)

    r = asyncio.run(go())
    assert (r["requests"], r["completed"], r["errors"], r["output_tokens"]) == (5, 5, 0, 30)
    assert r["ttft_ms"]["p50"] == pytest.approx(30.0)
    assert r["ttft_ms"]["p90"] == pytest.approx(46.0)
    assert r["ttft_ms"]["p99"] == pytest.approx(49.6)
    assert r["itl_ms"]["p50"] == pytest.approx(20.0) and r["itl_ms"]["p99"] == pytest.approx(20.0)
    assert r["tpot_ms"]["mean"] == pytest.approx(20.0)
    assert r["e2e_ms"]["p50"] == pytest.approx(30.0 + 5 * 20.0)
    wall = sum(server.ttfts) + 5 * 5 * 0.02
    assert r["duration_s"] == pytest.approx(wall)
    assert r["output_tok_per_s"] == pytest.approx(30 / wall)
    assert server.max_in_flight == 1
    assert server.bodies[0] == {"prompt": [1, 2, 3, 4], "max_tokens": 6, "ignore_eos": True, "temperature": 0.0,
                                "stream": True, "model": "m", "stream_options": {"include_usage": True}}


def test_run_level_concurrency_and_errors():
    server = FakeCompletionServer(fail={3}, fail_midway={5})
    options = BenchOptions(url="http://x:2000/v1", output_len=3)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as client:
            return await run_level(client, options, [[1]] * 12, concurrency=4, clock=server.clock)

    r = asyncio.run(go())
    assert len(server.bodies) == 12 and "model" not in server.bodies[0]
    assert server.max_in_flight == 4
    assert (r["completed"], r["errors"], r["output_tokens"]) == (10, 2, 30)
    assert r["error_messages"] == {"HTTP 500: boom": 1, "step failed": 1}


def test_bench_command_line(tmp_path, capsys):
    server = FakeCompletionServer()
    out_file = tmp_path / "bench.json"
    args = cli.build_parser().parse_args(["bench", "--url", "http://x:2000", "--concurrency", "1,2",
                                          "--num-requests", "3", "--input-len", "5", "--output-len", "4",
                                          "--json", str(out_file)])
    assert bench_mod.main(args, transport=httpx.MockTransport(server)) == 0
    prompts = [b["prompt"] for b in server.bodies]
    assert len(prompts) == 1 + 3 + 3  # warm-up, then 3 per level
    assert all(len(p) == 5 and set(p) <= {11, 12, 13} for p in prompts)
    assert [b["max_tokens"] for b in server.bodies] == [4] * 7  # the warm-up is 4 tokens too
    saved = json.loads(out_file.read_text())
    assert [(r["concurrency"], r["completed"], r["output_tokens"]) for r in saved["results"]] == [(1, 3, 12),
                                                                                                   (2, 3, 12)]
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["conc", "reqs", "err"] and [row.split()[:3] for row in table[1:]] == [
        ["1", "3", "0"], ["2", "3", "0"]]


def test_bench_without_streaming(capsys):
    server = FakeCompletionServer()
    args = cli.build_parser().parse_args(["bench", "--url", "http://x:2000/v1", "--concurrency", "2",
                                          "--num-requests", "4", "--output-len", "3", "--no-stream"])
    assert bench_mod.main(args, transport=httpx.MockTransport(server)) == 0
    assert all(b["stream"] is False and "stream_options" not in b for b in server.bodies)
    row = capsys.readouterr().out.splitlines()[1].split()
    # conc reqs err req/s tok/s, then TTFT (3) ITL (3) TPOT: not measurable without a stream
    assert row[:3] == ["2", "4", "0"] and row[5:12] == ["-"] * 7


def test_bench_concurrency_flag_is_checked(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--concurrency", "0,4"])
    assert "expected positive integers such as 1,16,64" in capsys.readouterr().err
