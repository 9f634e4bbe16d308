"""The OpenAI-compatible server end to end: a real cvserve process on a tiny Llama, driven by the openai
SDK (sync, async, streaming) and raw HTTP, checked against the offline ``LLM`` on the same checkpoint."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
import torch

from cvllm import LLM, SamplingParams
from cvllm.testing import make_checkpoint
from cvllm.testing.server import LiveServer

MODEL = "tiny"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Tell me about the dragon."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("server-llama")
    make_checkpoint(path, "llama", seed=3)
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), dtype="float32", max_num_seqs=8)


@pytest.fixture(scope="module")
def server(model_dir):
    engine = {"model": str(model_dir), "dtype": "float32", "backend": "cpu", "max_num_seqs": 8}
    with LiveServer(engine, served_model_names=[MODEL], reasoning_parser="think") as live:
        yield live


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def whole_chars(text: str) -> str:
    """The offline API decodes all ids at once, so a character cut off by the last token shows as U+FFFD;
    the server's incremental detokenizer never emits part of a character."""
    return text.rstrip("\ufffd")


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def sse_payloads(body: str) -> list[str]:
    """Split an SSE body, checking the framing: only `data: ...` events, each ended by a blank line."""
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: "):] for e in events]


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


# -- the SDK against the offline engine ---------------------------------------------------------------


def test_chat_matches_offline_greedy(client, llm):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
    expected = llm.chat(MESSAGES, greedy(12))[0]
    choice = out.choices[0]
    assert choice.message.content == whole_chars(expected.outputs[0].text)
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == 12 and out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert out.model == MODEL and out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    raw = out.model_dump()["choices"][0]
    assert raw["logprobs"] is None and raw["message"]["refusal"] is None and raw["message"]["tool_calls"] is None


def test_completions_several_prompts_and_n(client, llm):
    prompts = ["the quick brown fox", "once upon a time"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=10, temperature=0, n=2,
                                    extra_body={"ignore_eos": True})
    expected = [whole_chars(o.outputs[0].text) for o in llm.generate(prompts, greedy(10))]
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    by_index = {c.index: c for c in out.choices}
    for prompt_index in range(2):
        for i in range(2):   # index = prompt_index * n + i
            assert by_index[prompt_index * 2 + i].text == expected[prompt_index]
    ids = llm.get_tokenizer().encode(prompts[0])
    assert out.usage.prompt_tokens == len(ids) + len(llm.get_tokenizer().encode(prompts[1]))
    assert out.usage.completion_tokens == 40
    tokens = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert tokens.choices[0].text == expected[0]


def test_completions_default_max_tokens_is_16(client):
    out = client.completions.create(model=MODEL, prompt="hello", temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"


def test_chat_default_max_tokens_fills_the_context(client, llm):
    long_story = [{"role": "user", "content": "the cache keeps the keys and values " * 16}]
    out = client.chat.completions.create(model=MODEL, messages=long_story, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.usage.total_tokens == llm.llm_engine.max_model_len and out.choices[0].finish_reason == "length"
    assert 0 < out.usage.completion_tokens < 60   # a long prompt leaves a short rest: quick to generate


def test_async_streaming_equals_non_streaming(server, llm):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        whole = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16,
                                                     temperature=0, extra_body={"ignore_eos": True})
        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
                                                      stream=True, stream_options={"include_usage": True},
                                                      extra_body={"ignore_eos": True})
        chunks = [chunk async for chunk in stream]
        completion_stream = await client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=16,
                                                            temperature=0, stream=True,
                                                            extra_body={"ignore_eos": True})
        text = "".join([c.choices[0].text async for c in completion_stream if c.choices])
        await client.close()
        return whole, chunks, text

    whole, chunks, text = asyncio.run(run())
    assert text == whole_chars(llm.generate("once upon a time", greedy(16))[0].outputs[0].text)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    content_chunks = chunks[1:-2]
    assert content_chunks and all(c.choices[0].delta.content for c in content_chunks)   # never empty after
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    assert "".join(c.choices[0].delta.content for c in content_chunks) == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-2].choices[0].delta.model_dump(exclude_none=True) == {}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1


def test_sse_wire_format(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "temperature": 0, "stream": True,
            "ignore_eos": True}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert all("usage" not in c for c in chunks)   # include_usage not asked


def test_32_concurrent_streams_complete(server, llm):
    prompts = [f"request number {i} asks about the cache" for i in range(32)]
    expected = [whole_chars(o.outputs[0].text) for o in llm.generate(prompts, greedy(8))]

    async def one(client, prompt):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        parts, finish = [], None
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        try:
            return await asyncio.gather(*(one(client, p) for p in prompts))
        finally:
            await client.close()

    results = asyncio.run(run())
    assert [text for text, _ in results] == expected
    assert all(finish == "length" for _, finish in results)


def test_disconnect_flood_frees_everything(server):
    def aborts() -> float:
        text = httpx.get(server.url + "/metrics").text
        match = re.search(r'^cvllm:request_success_total{.*finished_reason="abort".*} (\S+)$', text, re.M)
        return float(match.group(1)) if match else 0.0

    before = aborts()

    async def leave_early(client, i):
        body = {"model": MODEL, "prompt": f"stream {i} that nobody reads", "max_tokens": 200, "stream": True,
                "ignore_eos": True, "temperature": 0}
        async with client.stream("POST", server.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    return   # closes the connection with the request still generating

    async def in_flight(client) -> float:
        return metric((await client.get(server.url + "/metrics")).text, "cvllm:num_requests_in_flight")

    async def give_up_waiting(client, i):   # non-streaming: the client hangs up while the answer is made
        body = json.dumps({"model": MODEL, "prompt": f"answer {i} that nobody waits for", "max_tokens": 200,
                           "n": 8, "ignore_eos": True}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        deadline = time.monotonic() + 10
        while await in_flight(client) == 0:
            assert time.monotonic() < deadline, await reader.read(1000)
            await asyncio.sleep(0.005)
        writer.close()
        await writer.wait_closed()
        while await in_flight(client) != 0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)

    async def run():
        async with httpx.AsyncClient(timeout=30) as client:
            for i in range(4):
                await give_up_waiting(client, i)
            await asyncio.gather(*(leave_early(client, i) for i in range(20)))

    asyncio.run(run())
    deadline = time.monotonic() + 15
    while True:
        text = httpx.get(server.url + "/metrics").text
        idle = (metric(text, "cvllm:num_requests_running") == 0 and metric(text, "cvllm:num_requests_waiting") == 0
                and metric(text, "cvllm:kv_cache_blocks_used") == 0
                and metric(text, "cvllm:num_requests_in_flight") == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert idle, text
    assert metric(text, "cvllm:kv_cache_blocks_total") > 0
    assert aborts() - before == 4 * 8 + 20   # every choice of every one was aborted, none ran to its end
    assert server.health() == 200


# -- output details -----------------------------------------------------------------------------------


def test_stop_strings_stream_equals_non_stream(client, llm):
    full = whole_chars(llm.chat(MESSAGES, greedy(24))[0].outputs[0].text)
    assert len(full) > 12
    stop = full[6:9]
    cut = full[: full.index(stop)]
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, stop=[stop],
                                         extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == cut and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 24
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0,
                                            stop=stop, stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    kept = client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=24, temperature=0,
                                     stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    text = whole_chars(llm.generate("once upon a time", greedy(24))[0].outputs[0].text)
    if stop in text:
        assert kept.choices[0].text == text[: text.index(stop) + len(stop)]


def test_chat_logprobs_bytes_and_values(client, llm):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                         logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == 10
    # The random model writes invalid UTF-8 at times, which both sides show as U+FFFD; a character the last
    # token left unfinished is not in the content at all. (test_server_output checks exact bytes on clean text.)
    joined = b"".join(bytes(e.bytes) for e in entries)
    assert whole_chars(joined.decode("utf-8", errors="replace")) == whole_chars(choice.message.content)
    reference = llm.chat(MESSAGES, greedy(10, logprobs=3))[0].outputs[0]
    for entry, token_id, expected in zip(entries, reference.token_ids, reference.logprobs):
        assert entry.logprob == pytest.approx(expected[token_id].logprob, abs=1e-4)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)   # greedy: the top one
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
    streamed = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                              logprobs=True, stream=True, extra_body={"ignore_eos": True})
    stream_entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in stream_entries] == [e.token for e in entries]


def test_completion_logprobs(client, llm):
    out = client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=6, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    text = out.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    reference = llm.generate("once upon a time", greedy(6, logprobs=2))[0].outputs[0]
    for value, top, token_id, expected in zip(lp.token_logprobs, lp.top_logprobs, reference.token_ids,
                                              reference.logprobs):
        assert value == pytest.approx(expected[token_id].logprob, abs=1e-4)
        assert max(top.values()) == pytest.approx(value, abs=1e-6)
    if all(not t.startswith("bytes:") for t in lp.tokens):
        assert "".join(lp.tokens) == text


def test_echo(client, llm):
    out = client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=4, temperature=0, echo=True,
                                    extra_body={"ignore_eos": True})
    expected = whole_chars(llm.generate("once upon a time", greedy(4))[0].outputs[0].text)
    assert out.choices[0].text == "once upon a time" + expected
    with_logprobs = httpx.post(client.base_url.join("completions").__str__(), json={
        "model": MODEL, "prompt": "once upon a time", "max_tokens": 2, "temperature": 0, "echo": True,
        "logprobs": 1, "ignore_eos": True}, timeout=30)
    assert with_logprobs.status_code == 200, with_logprobs.text
    lp = with_logprobs.json()["choices"][0]["logprobs"]
    prompt_ids = llm.get_tokenizer().encode("once upon a time")
    assert len(lp["tokens"]) == len(prompt_ids) + 2
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # the prompt tokens' values are the model's log-softmax at the position before each of them
    logits = llm.llm_engine.prompt_logits([prompt_ids])[0]
    expected = torch.log_softmax(logits, dim=-1)
    for position in range(1, len(prompt_ids)):
        value = expected[position - 1, prompt_ids[position]].item()
        assert lp["token_logprobs"][position] == pytest.approx(value, abs=1e-4)
        assert max(lp["top_logprobs"][position].values()) == pytest.approx(expected[position - 1].max().item(),
                                                                          abs=1e-4)
    assert lp["text_offset"][:len(prompt_ids)] == sorted(lp["text_offset"][:len(prompt_ids)])


def test_seed_reproducible_and_n_choices_differ(client):
    def ask():
        return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=77,
                                              n=3, extra_body={"ignore_eos": True})
    a, b = ask(), ask()
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1, 2] and len(set(texts)) == 3


def test_models_tokenize_and_friends(server, client, llm):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_dump()["max_model_len"] == llm.llm_engine.max_model_len
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(server.url + "/models").json()["data"][0]["id"] == MODEL   # the /v1-less spelling
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "hello world"}).json()
    assert tok["tokens"] == llm.get_tokenizer().encode("hello world") and tok["count"] == len(tok["tokens"])
    assert httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "hello world"}
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    schema = httpx.get(server.url + "/openapi.json").json()
    assert "/v1/chat/completions" in schema["paths"] and "ChatCompletionRequest" in schema["components"]["schemas"]
    assert "EmbeddingRequest" in schema["components"]["schemas"] and "/v1/embeddings" in schema["paths"]
    # no --api-key: any Authorization header is ignored
    ok = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer whatever"})
    assert ok.status_code == 200


def test_metrics_count_tokens_and_latency(server, client):
    before = httpx.get(server.url + "/metrics").text
    client.completions.create(model=MODEL, prompt="count me", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    after = httpx.get(server.url + "/metrics").text
    gen = "cvllm:generation_tokens_total"
    assert metric(after, gen) - metric(before, gen) == 5
    ttft = "cvllm:time_to_first_token_seconds_count"
    assert metric(after, ttft) - metric(before, ttft) == 1
    itl = "cvllm:inter_token_latency_seconds_count"
    assert metric(after, itl) - metric(before, itl) == 4
