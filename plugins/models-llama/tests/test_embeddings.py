"""Embeddings on a tiny Llama: ``LLM.embed`` against transformers' final hidden states, a sentence-transformers
directory that declares its pooling, chunked prefill, and ``/v1/embeddings`` through the openai SDK on a live
cvserve, alongside a generation request."""

from __future__ import annotations

import base64
import json
import struct
import threading

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from cvllm import LLM, SamplingParams
from cvllm.engine_process.messages import AddRequest, Embeddings, EmbedRequest, StepOutputs
from cvllm.engine_process.process import EngineCore
from cvllm.pooling import PoolingConfig
from cvllm.testing import make_checkpoint
from cvllm.testing.fakes import ScriptedChannel
from cvllm.testing.server import LiveServer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATOL = 1e-4
MODEL = "tiny-embed"
PROMPTS = [[5, 9, 33], list(range(40, 80)), [7] + list(range(100, 230))]   # up to 131 tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("embed-llama")
    return path, make_checkpoint(path, "llama", seed=3)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(model=str(checkpoint[0]), dtype="float32", max_num_seqs=8)


def hf_hidden(model, ids: list[int]) -> torch.Tensor:
    """transformers' final hidden states (after the last norm) of one prompt, [L, H]."""
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0].float()


def pooled(model, ids: list[int], method: str, normalize: bool = True) -> torch.Tensor:
    hidden = hf_hidden(model, ids)
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[method]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def vectors(outputs) -> list[torch.Tensor]:
    return [torch.tensor(out.outputs.embedding) for out in outputs]


def as_sentence_transformers(path, pooling_key: str, normalize: bool) -> None:
    """Rewrite a checkpoint directory as sentence-transformers saves one: the base model's tensors (no ``model.``
    prefix, no LM head, as Qwen3-Embedding's files are), modules.json, 1_Pooling/config.json, maybe Normalize."""
    tensors = load_file(path / "model.safetensors")
    save_file({name.removeprefix("model."): t for name, t in tensors.items() if name != "lm_head.weight"},
              path / "model.safetensors", metadata={"format": "pt"})
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    config = {"word_embedding_dimension": 64, **{f"pooling_mode_{m}": f"pooling_mode_{m}" == pooling_key
                                                  for m in modes}, "include_prompt": True}
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(config))


# -- offline, against transformers ---------------------------------------------------------------


@pytest.mark.parametrize("method", ["last", "mean", "cls"])
def test_pooled_hidden_states_match_transformers(llm, checkpoint, method):
    got = vectors(llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS], pooling=PoolingConfig(method)))
    for ids, vector in zip(PROMPTS, got, strict=True):
        assert vector.shape == (64,)
        torch.testing.assert_close(vector, pooled(checkpoint[1], ids, method), atol=ATOL, rtol=0)
        assert abs(vector.norm().item() - 1) < 1e-5
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks   # no KV cache left behind


def test_default_is_last_token_normalised_and_text_prompts_tokenize(llm, checkpoint):
    text = "the quick brown fox"
    ids = llm.get_tokenizer().encode(text)
    out = llm.embed(text)[0]
    assert out.prompt_token_ids == ids
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), pooled(checkpoint[1], ids, "last"),
                               atol=ATOL, rtol=0)


def test_dimensions_truncate_then_renormalise(llm, checkpoint):
    full = pooled(checkpoint[1], PROMPTS[1], "last", normalize=False)
    cut = torch.tensor(llm.embed({"prompt_token_ids": PROMPTS[1]}, dimensions=16)[0].outputs.embedding)
    torch.testing.assert_close(cut, torch.nn.functional.normalize(full[:16], dim=0), atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="between 1 and the model's embedding size 64"):
        llm.embed({"prompt_token_ids": PROMPTS[0]}, dimensions=65)


def test_chunked_prefill_gives_the_same_vectors(checkpoint, llm):
    """Prompts longer than the token budget run in chunks; mean pooling must see every chunk's hidden states."""
    small = LLM(model=str(checkpoint[0]), dtype="float32", max_num_batched_tokens=16, max_num_seqs=4)
    passes = []
    forward = small.llm_engine.executor.prompt_hidden
    small.llm_engine.executor.prompt_hidden = lambda batch: passes.append(list(batch.num_tokens)) or forward(batch)
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
    for method in ("mean", "last"):
        passes.clear()
        chunked = vectors(small.embed(prompts, pooling=PoolingConfig(method)))
        whole = vectors(llm.embed(prompts, pooling=PoolingConfig(method)))
        assert all(sum(counts) <= 16 for counts in passes) and len(passes) >= sum(map(len, PROMPTS)) // 16
        for a, b in zip(chunked, whole, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    bm = small.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize(("pooling_key", "method", "normalize"), [("pooling_mode_mean_tokens", "mean", True),
                                                                  ("pooling_mode_lasttoken", "last", False),
                                                                  ("pooling_mode_cls_token", "cls", True)])
def test_sentence_transformers_directory_declares_its_pooling(tmp_path, pooling_key, method, normalize):
    model = make_checkpoint(tmp_path, "llama", seed=5)
    as_sentence_transformers(tmp_path, pooling_key, normalize)
    with LLM(model=str(tmp_path), dtype="float32") as st:
        assert st.llm_engine.checkpoint.pooling == PoolingConfig(method, normalize, f"{tmp_path.name}/modules.json")
        got = vectors(st.embed([{"prompt_token_ids": ids} for ids in PROMPTS]))
    for ids, vector in zip(PROMPTS, got, strict=True):
        torch.testing.assert_close(vector, pooled(model, ids, method, normalize), atol=ATOL, rtol=0)


# -- /v1/embeddings on a live server -------------------------------------------------------------


@pytest.fixture(scope="module")
def server(checkpoint):
    # a budget of 32 tokens: the longer inputs run in chunks inside the engine core too
    engine = {"model": str(checkpoint[0]), "dtype": "float32", "backend": "cpu", "max_num_seqs": 8,
              "max_num_batched_tokens": 32}
    with LiveServer(engine, served_model_names=[MODEL], task="embed") as live:
        yield live


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_sdk_float_and_base64_lists_and_token_ids(client, llm):
    texts = ["hello there", "the cache keeps the keys and values " * 8]
    expected = vectors(llm.embed(texts))
    # the SDK asks for base64 when encoding_format is left out, and decodes it (little-endian float32) itself;
    # asked for explicitly, the base64 text is the caller's to decode
    for encoding in ("float", openai.NOT_GIVEN, "base64"):
        out = client.embeddings.create(model=MODEL, input=texts, encoding_format=encoding)
        assert out.model == MODEL and out.object == "list" and [d.index for d in out.data] == [0, 1]
        for data, vector in zip(out.data, expected, strict=True):
            assert data.object == "embedding"
            values = data.embedding
            if encoding == "base64":
                raw = base64.b64decode(values)
                values = list(struct.unpack(f"<{len(raw) // 4}f", raw))
            torch.testing.assert_close(torch.tensor(values), vector, atol=1e-5, rtol=0)
        tokens = sum(len(llm.get_tokenizer().encode(t)) for t in texts)
        assert out.usage.prompt_tokens == out.usage.total_tokens == tokens
    one = client.embeddings.create(model=MODEL, input=PROMPTS[2], encoding_format="float")
    torch.testing.assert_close(torch.tensor(one.data[0].embedding),
                               vectors(llm.embed({"prompt_token_ids": PROMPTS[2]}))[0], atol=1e-5, rtol=0)
    many = client.embeddings.create(model=MODEL, input=PROMPTS, encoding_format="float")
    assert len(many.data) == 3 and many.usage.prompt_tokens == sum(map(len, PROMPTS))


def test_sdk_dimensions(client, llm):
    full = vectors(llm.embed({"prompt_token_ids": PROMPTS[1]}))[0]
    out = client.embeddings.create(model=MODEL, input=PROMPTS[1], dimensions=8)
    assert len(out.data[0].embedding) == 8
    torch.testing.assert_close(torch.tensor(out.data[0].embedding), torch.nn.functional.normalize(full[:8], dim=0),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": ""}, "input", "must not be empty"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": ["a", ""]}, "input", "input 1 is empty"),
    ({"input": [1, 2, 512]}, "input", "outside the vocabulary"),
    ({"input": [[1, 2], [3, -1]]}, "input", "outside the vocabulary"),
    ({"input": [1] * 300}, "input", "maximum context length is 256 tokens"),
    ({"input": [1, "a"]}, "input", "a list of lists of token ids"),
    ({"input": "hi", "dimensions": 0}, "dimensions", "between 1 and"),
    ({"input": "hi", "dimensions": 65}, "dimensions", "between 1 and"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", ""),
    ({}, "input", "input"),
])
def test_bad_requests_are_400s_naming_the_field(server, body, param, words):
    response = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"


def test_generation_runs_alongside_embeddings(server, client, llm):
    """A generation and a stream of chunked embedding requests at once on a live server: both come out as they
    would alone. Whether the core answers the embeddings between generation steps rather than after them is a
    matter of timing here (a busy 2-core CI machine ran the whole tiny generation within one HTTP round trip), so
    the core test below checks that by the order of the core's messages."""
    expected = vectors(llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS]))
    started, result = threading.Event(), {"ids": []}

    def generate():
        stream = client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=200, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
        for chunk in stream:
            for choice in chunk.choices:
                result["ids"] += choice.model_extra.get("token_ids") or []
            started.set()

    thread = threading.Thread(target=generate)
    thread.start()
    assert started.wait(60), "the generation streamed nothing"
    rounds = 0
    while thread.is_alive() or rounds == 0:
        out = client.embeddings.create(model=MODEL, input=PROMPTS, encoding_format="float")
        for data, vector in zip(out.data, expected, strict=True):
            torch.testing.assert_close(torch.tensor(data.embedding), vector, atol=1e-5, rtol=0)
        rounds += 1
    thread.join()
    want = llm.generate("once upon a time", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))[0]
    assert result["ids"] == want.outputs[0].token_ids
    assert server.health() == 200


def test_the_core_answers_embeddings_between_generation_steps(checkpoint):
    """The server's engine core (engine_process.EngineCore) gives embedding inputs and generation a forward pass
    each in turn: an embedding request that arrives with a 40-token generation is answered (its inputs in chunks of
    the 32-token budget: 6 passes) while the generation is still making tokens, and both come out as they would
    alone."""
    with LLM(model=str(checkpoint[0]), dtype="float32", max_num_seqs=8, max_num_batched_tokens=32) as llm:
        expected = vectors(llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS]))
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        prompt = [1, 5, 9, 17]
        want = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
        channel = ScriptedChannel([AddRequest("gen", prompt, params), EmbedRequest("emb", PROMPTS, PoolingConfig())])
        with pytest.raises(EOFError):   # the script ran out once both were done: the API process "went away"
            EngineCore(llm.llm_engine, channel).run()
    tokens, answered_at = [], None
    for message in channel.sent:
        if isinstance(message, Embeddings):
            answered_at = len(tokens)
            got = [torch.frombuffer(bytearray(v), dtype=torch.float32) for v in message.vectors]
            for vector, reference in zip(got, expected, strict=True):
                torch.testing.assert_close(vector, reference, atol=1e-5, rtol=0)
        elif isinstance(message, StepOutputs):
            tokens += [t for delta in message.deltas if delta.request_id == "gen" for t in delta.token_ids]
    assert tokens == want
    assert answered_at is not None and 0 < answered_at < 20, answered_at   # a few steps in, long before the end
