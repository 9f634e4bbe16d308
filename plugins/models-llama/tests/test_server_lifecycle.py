"""Server set-ups other than the default: an API key with CORS, a thinking template whose generation prompt
opens ``<think>``, graceful SIGTERM with a request in flight, and a model that cannot be opened."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import openai
import pytest

from cvllm import LLM, SamplingParams
from cvllm.testing import CHATML_TEMPLATE, make_checkpoint
from cvllm.testing.server import LiveServer

KEY = "sekret-key"
ORIGIN = "http://app.example"
# ChatML whose generation prompt opens the thinking block, as DeepSeek-R1 distills and QwQ do
THINK_TEMPLATE = CHATML_TEMPLATE.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("server-lifecycle")
    make_checkpoint(path, "llama", seed=7)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    engine = {"model": str(model_dir), "dtype": "float32", "backend": "cpu", "max_num_seqs": 4}
    with LiveServer(engine, served_model_names=["thinker"], api_key=KEY, chat_template=THINK_TEMPLATE,
                    cors_allow_origins=[ORIGIN]) as live:
        yield live


def test_template_is_what_the_test_means():
    assert "<think>" in THINK_TEMPLATE and THINK_TEMPLATE != CHATML_TEMPLATE


def test_api_key_is_required_except_for_health_and_metrics(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.get(server.url + "/v1/models", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    denied = httpx.post(server.url + "/v1/chat/completions", json={"messages": MESSAGES})
    assert denied.status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    allowed = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert allowed.status_code == 200 and allowed.json()["data"][0]["id"] == "thinker"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_cors_preflight_and_headers(server):
    preflight = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    simple = httpx.get(server.url + "/health", headers={"Origin": ORIGIN})
    assert simple.headers["access-control-allow-origin"] == ORIGIN


def test_opened_think_block_goes_to_reasoning(server, model_dir):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    llm = LLM(model=str(model_dir), dtype="float32")
    expected = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        chat_template=THINK_TEMPLATE)[0]
    assert expected.prompt.endswith("<think>\n")
    text = expected.outputs[0].text.rstrip("\ufffd")
    assert "</think>" not in text   # the random model never closes it: all of it is reasoning

    out = client.chat.completions.create(model="thinker", messages=MESSAGES, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
    message = out.choices[0].message.model_dump()
    assert message["content"] is None
    assert message["reasoning_content"] == text and message["reasoning"] == text

    stream = client.chat.completions.create(model="thinker", messages=MESSAGES, max_tokens=12, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    deltas = [c.choices[0].delta.model_dump() for c in stream]
    assert deltas[0]["role"] == "assistant" and deltas[0]["content"] == ""
    assert all(d.get("content") is None for d in deltas[1:])
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == text
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)


def test_sigterm_lets_the_request_in_flight_finish(model_dir):
    engine = {"model": str(model_dir), "dtype": "float32", "backend": "cpu", "max_num_seqs": 4}
    live = LiveServer(engine, served_model_names=["tiny"], shutdown_timeout=30).start()
    try:
        body = {"prompt": "a long story", "max_tokens": 150, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line)
            live.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        events = [first, *rest]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == 150
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert live.process.wait(30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(live.url + "/health")
        assert "server stopped" in live.log()
    finally:
        live.close()


@pytest.fixture
def taken_port():
    """A port another program listens on."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


def test_cvserve_on_a_port_in_use_says_so_in_one_line(model_dir, taken_port):
    command = [sys.executable, "-m", "cvllm.server.cli", "--w", str(model_dir), "--backend", "cpu",
               "--p", str(taken_port)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2   # as cvserve's other start errors
    # checked before the model is opened: no model loading and no traceback, the error the last line (a library's
    # import-time warning may come before it)
    assert "Traceback" not in result.stderr and "loaded" not in result.stderr
    error = f"cvserve: error: cannot serve on 127.0.0.1:{taken_port}: address already in use"
    assert result.stderr.splitlines()[-1] == error


def test_a_server_that_cannot_bind_its_port_exits_with_2_and_no_traceback(model_dir, taken_port):
    # the server's own bind, as when another program takes the port after cvserve checked it
    engine = {"model": str(model_dir), "dtype": "float32", "backend": "cpu"}
    live = LiveServer(engine, port=taken_port)
    try:
        with pytest.raises(RuntimeError, match="exited with 2"):
            live.start(timeout=60)
        lines = live.log().splitlines()
    finally:
        live.close()
    assert not any("Traceback" in line for line in lines) and lines[-1].endswith(
        f"ERROR cvllm.server: cannot serve on 127.0.0.1:{taken_port}: address already in use"), lines


def test_a_model_that_cannot_be_opened_exits_with_1(tmp_path):
    live = LiveServer({"model": str(tmp_path / "missing"), "backend": "cpu"})
    try:
        with pytest.raises(RuntimeError, match="exited with 1"):
            live.start(timeout=60)
        assert "cannot open" in live.log() and live.process.returncode == 1
    finally:
        live.close()
