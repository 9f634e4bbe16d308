"""cvserve on a checkpoint without a tokenizer: token ids in, token ids out (vLLM's ``return_token_ids`` fields),
through the openai SDK; what needs text is a 400 that says why. Also ``return_token_ids`` on a server that has
a tokenizer."""

from __future__ import annotations

import httpx
import openai
import pytest

from cvllm import LLM, SamplingParams
from cvllm.testing import make_checkpoint
from cvllm.testing.server import LiveServer

PROMPT = [5, 17, 42, 99, 7, 3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("no-tokenizer")
    make_checkpoint(path, "llama", seed=5)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    return path


@pytest.fixture(scope="module")
def expected(model_dir) -> list[int]:
    llm = LLM(model=str(model_dir), dtype="float32", max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def server(model_dir):
    engine = {"model": str(model_dir), "dtype": "float32", "backend": "cpu", "max_num_seqs": 4}
    with LiveServer(engine, served_model_names=["tiny"]) as live:
        yield live


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_token_ids_in_token_ids_out(client, expected):
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert choice.text == "" and choice.token_ids == list(expected) and choice.prompt_token_ids == PROMPT
    assert reply.usage.prompt_tokens == len(PROMPT) and reply.usage.completion_tokens == 8


def test_a_stream_carries_the_ids_of_each_piece(client, expected):
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    ids = [i for chunk in chunks for choice in chunk.choices for i in (choice.token_ids or [])]
    assert ids == list(expected)
    assert chunks[0].choices[0].prompt_token_ids == PROMPT
    assert all(getattr(c, "prompt_token_ids", None) is None for chunk in chunks[1:] for c in chunk.choices)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_logprobs_name_tokens_by_id(client, expected):
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    assert reply.choices[0].logprobs.tokens == [f"token_id:{i}" for i in expected[:3]]


@pytest.mark.parametrize(("path", "body", "needs"), [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 2}, "A text prompt"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stop": ["x"]}, "A stop string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "Chat completion"),
    ("/tokenize", {"prompt": "hi"}, "Tokenizing"),
    ("/detokenize", {"tokens": [1, 2]}, "Detokenizing"),
])
def test_what_needs_text_is_a_clear_400(server, path, body, needs):
    reply = httpx.post(server.url + path, json={"model": "tiny", **body})
    assert reply.status_code == 400
    message = reply.json()["error"]["message"]
    assert message.startswith(needs) and "served without one" in message and "token ids" in message
    assert server.health() == 200


def test_return_token_ids_with_a_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("with-tokenizer")
    make_checkpoint(path, "llama", seed=5)
    engine = {"model": str(path), "dtype": "float32", "backend": "cpu", "max_num_seqs": 4}
    with LiveServer(engine, served_model_names=["tiny"]) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        plain = client.completions.create(model="tiny", prompt="Hello dragon", max_tokens=6, temperature=0)
        assert getattr(plain.choices[0], "token_ids", None) is None
        reply = client.completions.create(model="tiny", prompt="Hello dragon", max_tokens=6, temperature=0,
                                          extra_body={"return_token_ids": True})
        choice = reply.choices[0]
        assert choice.text == plain.choices[0].text and len(choice.token_ids) == reply.usage.completion_tokens
        # (the random model ends on part of a character, which the streamed text holds back)
        assert httpx.post(live.url + "/detokenize", json={"tokens": choice.token_ids}).json()["prompt"].startswith(
            choice.text)
        assert choice.prompt_token_ids == httpx.post(live.url + "/tokenize",
                                                     json={"prompt": "Hello dragon"}).json()["tokens"]
