"""Embeddings without a model: the sentence-transformers reader, the embedding scheduler over a real block manager
with a scripted forward pass, and ``/v1/embeddings`` through the real app with a scripted engine client."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import struct
from types import SimpleNamespace

import pytest
import torch

from cvllm.checkpoint.base import CheckpointError
from cvllm.checkpoint.sentence_transformers import is_base_model, read_declared_pooling, read_pooling
from cvllm.engine.block_manager import BlockManager
from cvllm.engine.embedding import Embedder
from cvllm.engine.scheduler import SchedulerConfig
from cvllm.engine_process.client import EngineDeadError, RequestError
from cvllm.pooling import PoolingConfig, check_dimensions, served_pooling
from cvllm.server.cli import build_server_args
from cvllm.testing.fakes import FakeClient, call, make_state

TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def st_dir(path, pooling: dict, modules=(TRANSFORMER, POOLING, NORMALIZE)):
    (path / "modules.json").write_text(json.dumps(list(modules)))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **pooling}))
    return path


# -- the checkpoint's declaration ------------------------------------------------------------------


@pytest.mark.parametrize(("pooling", "method"), [({"pooling_mode_lasttoken": True}, "last"),
                                                 ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False},
                                                  "mean"),
                                                 ({"pooling_mode_cls_token": True}, "cls"),
                                                 ({"pooling_mode": "lasttoken"}, "last")])
def test_reads_the_pooling_mode_and_normalize(tmp_path, pooling, method):
    assert read_pooling(st_dir(tmp_path, pooling)) == PoolingConfig(method, True, f"{tmp_path.name}/modules.json")
    assert read_pooling(st_dir(tmp_path, pooling, (TRANSFORMER, POOLING))).normalize is False


def test_no_modules_json_declares_nothing(tmp_path):
    assert read_pooling(tmp_path) is None


@pytest.mark.parametrize(("pooling", "modules", "words"), [
    ({"pooling_mode_max_tokens": True}, (TRANSFORMER, POOLING), "pooling_mode_max_tokens"),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": True}, (TRANSFORMER, POOLING), "exactly one"),
    ({"pooling_mode_lasttoken": True, "include_prompt": False}, (TRANSFORMER, POOLING), "include_prompt"),
    ({"pooling_mode_lasttoken": True}, (TRANSFORMER, POOLING, {"path": "2_Dense", "type": "x.models.Dense"}),
     "Dense"),
    ({"pooling_mode_lasttoken": True}, (TRANSFORMER,), "no Pooling module"),
])
def test_what_cvllm_cannot_reproduce_is_refused_by_name(tmp_path, caplog, pooling, modules, words):
    st_dir(tmp_path, pooling, modules)
    with pytest.raises(CheckpointError, match=words):
        read_pooling(tmp_path)
    with caplog.at_level(logging.WARNING):   # opening the checkpoint: logged, and generation still served
        assert read_declared_pooling(tmp_path) is None
    assert words in caplog.text


def test_base_model_names_and_served_pooling():
    assert is_base_model(["embed_tokens.weight", "layers.0.mlp.up_proj.weight", "norm.weight"])
    assert not is_base_model(["model.embed_tokens.weight", "lm_head.weight"])
    declared = PoolingConfig("mean", False, "x/modules.json")
    assert served_pooling("auto", declared) == served_pooling("embed", declared) == declared
    assert served_pooling("auto", None) is None and served_pooling("generate", declared) is None
    assert served_pooling("embed", None) == PoolingConfig("last", True)
    check_dimensions(64, 64, None)
    check_dimensions(32, 64, [32, 64])
    with pytest.raises(ValueError, match=r"Matryoshka dimensions \[32, 64\]"):
        check_dimensions(48, 64, [64, 32])


# -- the embedding scheduler -----------------------------------------------------------------------


class ScriptedExecutor:
    """Hidden state of a token = [its id, its position] (what pooling must reproduce); records each pass."""

    def __init__(self, fail_on: int | None = None):
        self.passes: list[list[int]] = []
        self.fail_on = fail_on

    def prompt_hidden(self, batch):
        self.passes.append(list(batch.num_tokens))
        rows = []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            if self.fail_on in seq.token_ids[start:start + n]:
                raise RuntimeError("scripted failure")
            rows += [[float(seq.token_ids[p]), float(p)] for p in range(start, start + n)]
        return torch.tensor(rows)


def scripted_engine(num_blocks: int, budget: int, executor: ScriptedExecutor):
    config = SimpleNamespace(hidden_size=2, get=lambda key, default=None: default)
    scheduler = SimpleNamespace(block_manager=BlockManager(num_blocks, 4), waiting=[],
                                config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget))
    return SimpleNamespace(scheduler=scheduler, executor=executor, vocab_size=100, max_model_len=32,
                           checkpoint=SimpleNamespace(config=config))


def run(embedder: Embedder) -> dict[str, list[torch.Tensor]]:
    done = {}
    while embedder.has_work():
        finished = embedder.step()
        assert finished is not None, "no progress"
        done.update({job.request_id: job.vectors for job in finished})
    return done


def test_inputs_share_passes_run_in_chunks_and_free_their_blocks():
    executor = ScriptedExecutor()
    engine = scripted_engine(num_blocks=8, budget=8, executor=executor)
    embedder = Embedder(engine)
    embedder.add("a", [[1, 2, 3], list(range(10, 30))], PoolingConfig("mean", normalize=False))
    embedder.add("b", [[7, 8]], PoolingConfig("last", normalize=False))
    embedder.add("c", [[5, 6, 9]], PoolingConfig("cls", normalize=False), dimensions=1)
    done = run(embedder)
    assert all(sum(p) <= 8 for p in executor.passes) and sum(map(sum, executor.passes)) == 3 + 20 + 2 + 3
    assert done["a"][0].tolist() == [2.0, 1.0] and done["a"][1].tolist() == [19.5, 9.5]   # means over chunks
    assert done["b"][0].tolist() == [8.0, 1.0] and done["c"][0].tolist() == [5.0]
    assert engine.scheduler.block_manager.num_free_blocks == 8


def test_inputs_wait_for_blocks_and_abort_frees_them():
    executor = ScriptedExecutor()
    engine = scripted_engine(num_blocks=8, budget=16, executor=executor)
    bm = engine.scheduler.block_manager
    embedder = Embedder(engine)
    embedder.add("long", [list(range(1, 29))], PoolingConfig())   # 7 of the 8 blocks, over two passes
    embedder.add("next", [list(range(1, 9))], PoolingConfig())    # 2 blocks
    assert embedder.step() == [] and bm.num_free_blocks == 1
    finished = embedder.step()   # long's last 12 tokens: budget is left for "next", blocks are not
    assert [job.request_id for job in finished] == ["long"] and executor.passes[-1] == [12]
    assert [job.request_id for job in embedder.step()] == ["next"] and bm.num_free_blocks == 8
    embedder.add("long", [list(range(1, 29))], PoolingConfig())
    embedder.step()
    embedder.abort("long")
    assert bm.num_free_blocks == 8 and not embedder.has_work()


def test_queued_generation_keeps_new_inputs_from_starting_beside_running_ones():
    executor = ScriptedExecutor()
    engine = scripted_engine(num_blocks=16, budget=8, executor=executor)
    embedder = Embedder(engine)
    embedder.add("a", [list(range(1, 13)), [1, 2], [3, 4]], PoolingConfig())
    assert embedder.step() == [] and executor.passes[-1] == [8]   # the budget: only the first input starts
    engine.scheduler.waiting.append("a generation waiting for blocks")
    embedder.step()
    assert executor.passes[-1] == [4]   # its last chunk alone, though budget and blocks are left for the others
    assert embedder.step() is not None and executor.passes[-1] == [2, 2]   # none running: new inputs start


def test_a_failed_pass_drops_its_requests_and_their_blocks():
    engine = scripted_engine(num_blocks=8, budget=16, executor=ScriptedExecutor(fail_on=66))
    embedder = Embedder(engine)
    embedder.add("bad", [[1, 2], [3, 66]], PoolingConfig())
    with pytest.raises(RuntimeError, match="scripted"):
        embedder.step()
    assert embedder.last_request_ids == ["bad"] and not embedder.has_work()
    assert engine.scheduler.block_manager.num_free_blocks == 8


@pytest.mark.parametrize(("prompts", "dimensions", "words"), [([], None, "empty"), ([[1], []], None, "empty"),
                                                              ([[100]], None, r"\[0, 100\)"), ([[1] * 33], None,
                                                              "maximum model length 32"), ([[1]], 3, "between 1")])
def test_the_scheduler_refuses_bad_inputs(prompts, dimensions, words):
    embedder = Embedder(scripted_engine(8, 8, ScriptedExecutor()))
    with pytest.raises(ValueError, match=words):
        embedder.add("x", prompts, PoolingConfig(), dimensions)


# -- /v1/embeddings through the app ------------------------------------------------------------------


class EmbeddingClient(FakeClient):
    """Answers each input with [len, first id, 0.5] as float32 bytes; or raises ``error``."""

    def __init__(self, pooling: PoolingConfig | None, error: Exception | None = None):
        super().__init__([[1]])
        self.info.pooling, self.info.hidden_size, self.info.matryoshka_dimensions = pooling, 3, [1, 3]
        self.error, self.calls = error, []

    async def embed(self, request_id, prompts, pooling, dimensions=None):
        await asyncio.sleep(0)
        self.calls.append((prompts, pooling, dimensions))
        if self.error is not None:
            raise self.error
        return [struct.pack("<3f", len(ids), ids[0], 0.5) for ids in prompts]


MEAN = PoolingConfig("mean")


def post(tokenizer, body: dict, pooling=MEAN, task="auto", error=None):
    client = EmbeddingClient(pooling, error)
    state = make_state(tokenizer, client)
    state.args.task = task
    response = call(state, "POST", "/v1/embeddings", body)
    return response.status_code, response.json(), client


def test_float_and_base64_and_usage(tokenizer):
    ids = tokenizer.encode("hello world")
    status, body, client = post(tokenizer, {"input": ["hello world", "x"], "model": "whatever"})
    assert status == 200 and body["object"] == "list" and body["model"] == "fake"
    assert body["data"][0] == {"object": "embedding", "index": 0, "embedding": [len(ids), ids[0], 0.5]}
    assert body["usage"] == {"prompt_tokens": len(ids) + len(tokenizer.encode("x")),
                             "total_tokens": len(ids) + len(tokenizer.encode("x"))}
    assert client.calls[0][1] == PoolingConfig("mean")
    status, body, _ = post(tokenizer, {"input": [[4, 5], [6]], "encoding_format": "base64"})
    assert status == 200
    assert [struct.unpack("<3f", base64.b64decode(d["embedding"])) for d in body["data"]] == [(2, 4, .5), (1, 6, .5)]


def test_embeddings_show_in_metrics(tokenizer):
    client = EmbeddingClient(MEAN)
    state = make_state(tokenizer, client)
    assert call(state, "POST", "/v1/embeddings", {"input": [[4, 5], [6]]}).status_code == 200
    assert call(state, "POST", "/v1/embeddings", {"input": [7, 8, 9]}).status_code == 200
    text = call(state, "GET", "/metrics").text
    assert 'cvllm:embedding_requests_total{model_name="fake"} 2.0' in text
    assert 'cvllm:embedding_inputs_total{model_name="fake"} 3.0' in text
    assert 'cvllm:prompt_tokens_total{model_name="fake"} 6.0' in text
    assert 'cvllm:embedding_request_latency_seconds_count{model_name="fake"} 2.0' in text


def test_refused_where_the_model_is_not_served_for_embeddings(tokenizer):
    status, body, _ = post(tokenizer, {"input": "hi"}, pooling=None)
    assert status == 400 and body["error"]["param"] == "model" and "--task embed" in body["error"]["message"]
    status, body, _ = post(tokenizer, {"input": "hi"}, task="generate")
    assert status == 400 and "--task generate" in body["error"]["message"]
    status, _, client = post(tokenizer, {"input": "hi"}, pooling=None, task="embed")
    assert status == 200 and client.calls[0][1] == PoolingConfig("last", True)


def test_dimensions_follow_the_declared_matryoshka_sizes(tokenizer):
    assert post(tokenizer, {"input": "hi", "dimensions": 1})[0] == 200
    status, body, _ = post(tokenizer, {"input": "hi", "dimensions": 2})
    assert status == 400 and body["error"]["param"] == "dimensions"


def test_engine_failures_map_to_their_statuses(tokenizer):
    status, body, _ = post(tokenizer, {"input": "hi"}, error=RequestError("an input is empty", True))
    assert status == 400 and "an input is empty" in body["error"]["message"]
    assert post(tokenizer, {"input": "hi"}, error=RequestError("model failed"))[0] == 500
    assert post(tokenizer, {"input": "hi"}, error=EngineDeadError("gone"))[0] == 503


def test_the_task_flag(model_dir):
    assert build_server_args(["--w", str(model_dir)]).task == "auto"
    assert build_server_args(["--w", str(model_dir), "--task", "embed"]).task == "embed"
    with pytest.raises(SystemExit):
        build_server_args(["--w", str(model_dir), "--task", "score"])
