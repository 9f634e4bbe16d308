"""Embedding requests in the engine-core process, through its asyncio client, on a tiny Llama with a small KV pool:
embeddings and a generation that together need more blocks than the pool has both come out right (an input waits
for free blocks, a generation may be preempted and recomputed; nothing deadlocks), a cancelled or refused request
leaves no blocks behind, and Ready tells the API process what the model declares."""

from __future__ import annotations

import asyncio

import pytest
import torch

from cvllm import LLM, SamplingParams
from cvllm.engine.config import EngineConfig
from cvllm.engine_process.client import EngineCoreClient, RequestError
from cvllm.pooling import PoolingConfig
from cvllm.server.serving_embeddings import float32_values
from cvllm.testing import make_checkpoint

NUM_KV_BLOCKS = 24        # 384 tokens of 16-token blocks
LAST = PoolingConfig()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("embed-core-llama")
    make_checkpoint(path, "llama", seed=5)
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)


async def with_core(model_dir, scenario):
    config = EngineConfig(model=str(model_dir), dtype="float32", block_size=16, num_kv_blocks=NUM_KV_BLOCKS,
                          max_num_seqs=8, max_num_batched_tokens=32)
    client = await EngineCoreClient.start(config, startup_timeout=120)
    try:
        return await scenario(client)
    finally:
        await client.shutdown()


def test_embeddings_and_a_generation_share_a_small_pool(model_dir, llm):
    prompt = list(range(3, 103))      # 100 tokens + 150 generated: 16 of the 24 blocks at the end
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    inputs = [list(range(10, 210)), [4, 5, 6]]   # 13 blocks and 1: more than the generation leaves free

    async def scenario(client):
        assert (client.info.pooling, client.info.hidden_size) == (None, 64)
        stream = client.add_request("gen", prompt, params)
        tokens = [t for delta in await stream.__anext__() for t in delta.token_ids]   # its prompt is in the cache
        vectors = await asyncio.wait_for(client.embed("emb", inputs, LAST), 60)
        tokens += [t async for deltas in stream for delta in deltas for t in delta.token_ids]
        await asyncio.sleep(0.2)      # the idle core's last stats snapshot
        return vectors, tokens, client.stats

    vectors, tokens, stats = asyncio.run(with_core(model_dir, scenario))
    assert tokens == llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    for raw, expected in zip(vectors, llm.llm_engine.embed(inputs, LAST), strict=True):
        torch.testing.assert_close(torch.tensor(float32_values(raw)), expected, atol=1e-5, rtol=0)
    assert stats.kv_blocks_free == NUM_KV_BLOCKS


def test_cancelled_and_refused_requests_leave_nothing_behind(model_dir):
    async def scenario(client):
        task = asyncio.ensure_future(client.embed("gone", [list(range(10, 250))] * 8, LAST))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(RequestError, match=r"must be in \[0, 512\)") as refused:
            await client.embed("bad", [[1, 999]], LAST)
        assert refused.value.invalid_request
        again = await client.embed("again", [[7, 8, 9]], LAST)   # the core goes on serving
        await asyncio.sleep(0.2)
        return again, client.stats, client.num_in_flight

    again, stats, in_flight = asyncio.run(with_core(model_dir, scenario))
    assert len(again) == 1 and len(again[0]) == 64 * 4
    assert stats.kv_blocks_free == NUM_KV_BLOCKS and in_flight == 0
