"""Malformed and hostile input against a live server: every case gets the right 4xx in OpenAI's error
shape, nothing leaks a traceback, and the server keeps serving afterwards."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from cvllm.testing import make_checkpoint
from cvllm.testing.server import LiveServer

MODEL = "tiny"
BODY_LIMIT = 64 << 10
MAX_NUM_SEQS, MAX_QUEUE = 2, 2
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("server-errors")
    make_checkpoint(path, "llama", seed=5)
    engine = {"model": str(path), "dtype": "float32", "backend": "cpu", "max_num_seqs": MAX_NUM_SEQS,
              "max_model_len": 128}
    # strict: an unknown model is one of the errors checked (by default any name means the served model)
    with LiveServer(engine, served_model_names=[MODEL], max_body_bytes=BODY_LIMIT, max_queue=MAX_QUEUE,
                    strict_model_name=True) as live:
        yield live


def chat(**fields):
    return ("POST", "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 2, **fields})


def completion(**fields):
    return ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields})


CONTEXT_MESSAGE = ("This model's maximum context length is 128 tokens. However, you requested {m} tokens "
                   "({p} in the messages, {c} in the completion).")

# (id, (method, path, body: dict | bytes | None), status, param or None)
CASES = [
    ("malformed-json", ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user"'), 400, None),
    ("not-utf8", ("POST", "/v1/chat/completions", b'\xff\xfe{"messages": 1}'), 400, None),
    ("json-array", ("POST", "/v1/chat/completions", b"[1, 2, 3]"), 400, None),
    ("empty-body", ("POST", "/v1/completions", b""), 400, None),
    ("missing-messages", ("POST", "/v1/chat/completions", {"model": MODEL}), 400, None),
    ("messages-not-list", chat(messages="hi"), 400, "messages"),
    ("temperature-string", chat(temperature="hot"), 400, "temperature"),
    ("max-tokens-string", chat(max_tokens="5"), 400, "max_tokens"),
    ("n-float", chat(n=1.5), 400, "n"),
    ("stream-string", chat(stream="yes"), 400, "stream"),
    ("bad-role", chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
    ("content-number", chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    ("empty-messages", chat(messages=[]), 400, "messages"),
    ("temperature-negative", chat(temperature=-0.5), 400, "temperature"),
    ("top-p-zero", chat(top_p=0), 400, "top_p"),
    ("top-p-above-one", chat(top_p=1.5), 400, "top_p"),
    ("n-zero", chat(n=0), 400, "n"),
    ("n-huge", chat(n=100000), 400, "n"),
    ("max-tokens-negative", chat(max_tokens=-1), 400, "max_tokens"),
    ("max-completion-tokens-zero", chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("top-logprobs-21", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top-logprobs-negative", chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs"),
    ("presence-penalty", chat(presence_penalty=2.5), 400, "presence_penalty"),
    ("frequency-penalty", chat(frequency_penalty=-3), 400, "frequency_penalty"),
    ("top-k", chat(top_k=-2), 400, "top_k"),
    ("min-p", chat(min_p=1.5), 400, "min_p"),
    ("repetition-penalty", chat(repetition_penalty=0), 400, "repetition_penalty"),
    ("min-tokens-negative", chat(min_tokens=-1), 400, "min_tokens"),
    ("min-tokens-above-max", chat(min_tokens=5, max_tokens=2), 400, "min_tokens"),
    ("empty-stop", chat(stop=["ok", ""]), 400, "stop"),
    ("stop-token-out-of-vocab", chat(stop_token_ids=[10**6]), 400, "stop_token_ids"),
    ("logit-bias-key", chat(logit_bias={"five": 10}), 400, "logit_bias"),
    ("logit-bias-range", chat(logit_bias={"5": 101}), 400, "logit_bias"),
    ("logit-bias-vocab", chat(logit_bias={"100000": 1}), 400, "logit_bias"),
    # numbers past what SamplingParams, the sampler's generator or the transport to the engine core can take
    ("seed-past-64-bits", completion(seed=1180591620717411303424), 400, "seed"),
    ("seed-below-int64", chat(seed=-2**63 - 1), 400, "seed"),
    ("temperature-infinite", ("POST", "/v1/completions", b'{"prompt": "hi", "temperature": 1e999}'), 400,
     "temperature"),
    ("top-k-past-int32", chat(top_k=2**64), 400, "top_k"),
    ("min-tokens-past-int32", chat(min_tokens=2**31, max_tokens=None), 400, "min_tokens"),
    ("max-tokens-past-64-bits", completion(max_tokens=2**70), 400, "max_tokens"),
    ("max-completion-tokens-past-64-bits", chat(max_completion_tokens=2**70), 400, "max_completion_tokens"),
    ("stop-token-past-64-bits", chat(stop_token_ids=[2**70]), 400, "stop_token_ids"),
    ("logit-bias-key-past-64-bits", chat(logit_bias={str(2**70): 1}), 400, "logit_bias"),
    ("logit-bias-key-superscript", chat(logit_bias={"²": 1}), 400, "logit_bias"),
    ("top-logprobs-past-64-bits", chat(logprobs=True, top_logprobs=2**70), 400, "top_logprobs"),
    ("best-of-past-64-bits", completion(best_of=2**70), 400, "best_of"),
    ("prompt-token-past-64-bits", completion(prompt=[1, 2**70]), 400, "prompt"),
    ("prompts-times-n", completion(prompt=["hi"] * 9, n=128), 400, "n"),
    ("image-part", chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
     400, "messages[0].content[1].type"),
    ("json-schema", chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "nope"}}}), 400, "response_format"),
    ("json-schema-not-an-object", chat(response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                                              "schema": [1]}}),
     400, "response_format"),
    ("tool-choice-required-without-tools", chat(tool_choice="required"), 400, "tool_choice"),
    ("continue-and-generation-prompt", chat(continue_final_message=True, add_generation_prompt=True), 400,
     "continue_final_message"),
    ("context-overflow-chat", chat(max_tokens=1000), 400, "max_tokens"),
    ("completion-logprobs-21", completion(logprobs=21), 400, "logprobs"),
    ("prompt-token-out-of-vocab", completion(prompt=[1, 2, 10**6]), 400, "prompt"),
    ("prompt-token-negative", completion(prompt=[[1, 2], [-1]]), 400, "prompt"),
    ("prompt-mixed-list", completion(prompt=[[1, 2], "text"]), 400, "prompt"),
    ("prompt-empty-list", completion(prompt=[]), 400, "prompt"),
    ("prompt-empty-string", completion(prompt=""), 400, "prompt"),
    ("prompt-bools", completion(prompt=[True, False]), 400, "prompt"),
    ("prompt-too-long", completion(prompt=list(range(3, 203))), 400, "prompt"),
    ("suffix", completion(suffix="tail"), 400, "suffix"),
    ("detokenize-bad-ids", ("POST", "/detokenize", {"tokens": [1, 10**7]}), 400, "tokens"),
    ("unknown-model", chat(model="gpt-17"), 404, "model"),
    ("unknown-model-get", ("GET", "/v1/models/gpt-17", None), 404, "model"),
    ("unknown-route", ("GET", "/v1/nothing-here", None), 404, None),
    ("unknown-route-post", ("POST", "/v2/chat/completions", {"messages": HI}), 404, None),
    ("wrong-method-get", ("GET", "/v1/chat/completions", None), 405, None),
    ("wrong-method-delete", ("DELETE", "/v1/models", None), 405, None),
    ("too-large", ("POST", "/v1/chat/completions", b'{"messages": "' + b"x" * BODY_LIMIT + b'"}'), 413, None),
]


@pytest.mark.parametrize("request_spec,status,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_gets_an_openai_error(server, request_spec, status, param):
    method, path, body = request_spec
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    response = httpx.request(method, server.url + path, content=content, timeout=30,
                             headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"] and "Traceback" not in error["message"]
    assert error["param"] == param


def test_context_overflow_message_is_exact(server):
    response = httpx.post(server.url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 1000})
    prompt_tokens = len(httpx.post(server.url + "/tokenize", json={"messages": HI, "add_generation_prompt": True})
                        .json()["tokens"])
    message = CONTEXT_MESSAGE.format(m=prompt_tokens + 1000, p=prompt_tokens, c=1000)
    assert response.json()["error"]["message"] == message
    too_long = httpx.post(server.url + "/v1/completions", json={"prompt": list(range(3, 203))})
    assert too_long.json()["error"]["message"] == CONTEXT_MESSAGE.format(m=201, p=200, c=1)


def test_unknown_fields_and_nulls_are_ignored(server):
    body = {"model": MODEL, "messages": [{"role": "developer", "content": "be nice"}, *HI], "max_tokens": 2,
            "store": False, "metadata": {"a": "b"}, "user": "u1", "parallel_tool_calls": True, "tools": None,
            "stop": None, "temperature": None, "top_p": None, "n": None, "seed": None, "stream_options": None,
            "logprobs": None, "response_format": {"type": "text"}, "something_new": [1, 2, 3],
            "extra_body": {"x": 1}, "service_tier": "auto", "frequency_penalty": None}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    parts = {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]}
    assert httpx.post(server.url + "/v1/chat/completions", json=parts, timeout=30).status_code == 200
    no_model = {"prompt": "hi", "max_tokens": 2}
    assert httpx.post(server.url + "/v1/completions", json=no_model, timeout=30).json()["model"] == MODEL


def test_queue_full_is_429_with_retry_after(server):
    async def hold(client):
        body = {"prompt": "keep going", "max_tokens": 120, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for _ in response.aiter_lines():
                await asyncio.sleep(1)   # a slow reader: the request stays in flight

    async def in_flight(client) -> float:
        text = (await client.get("/metrics")).text
        return float(re.search(r"^cvllm:num_requests_in_flight{.*} (\S+)$", text, re.M).group(1))

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            holders = [asyncio.create_task(hold(client)) for _ in range(MAX_NUM_SEQS + MAX_QUEUE)]
            try:
                for _ in range(200):
                    if await in_flight(client) == MAX_NUM_SEQS + MAX_QUEUE:
                        break
                    await asyncio.sleep(0.02)
                return await client.post("/v1/completions", json={"prompt": "one more", "max_tokens": 2})
            finally:
                for task in holders:
                    task.cancel()
                await asyncio.gather(*holders, return_exceptions=True)

    refused = asyncio.run(run())
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"


def test_still_healthy_and_serving_afterwards(server):
    assert server.health() == 200
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True},
                          timeout=30)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    assert "Traceback" not in server.log()


def test_chunked_body_is_cut_off_at_the_limit(server):
    def body():   # no Content-Length: the limit must hold while reading, not after
        for _ in range(BODY_LIMIT // 1024 + 64):
            yield b" " * 1024

    response = httpx.post(server.url + "/v1/completions", content=body(), timeout=30,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
