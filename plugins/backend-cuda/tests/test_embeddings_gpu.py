"""Embeddings on the CUDA backend (the engine's prefill path without an LM head) against the CPU backend's, which
CI checks against transformers: pooled vectors of every pooling, whole and in chunks, blocks freed after; and
embedding passes interleaved with async-scheduled generation steps, whose tokens stay those of a solo run. GPU only."""

from __future__ import annotations

import pytest
import torch

from cvllm import LLM, SamplingParams
from cvllm.engine.embedding import Embedder
from cvllm.pooling import PoolingConfig
from cvllm.testing import make_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

INPUTS = [list(range(5, 200)), [9, 4, 77], [300] * 40, list(range(100, 160))]
POOLINGS = [PoolingConfig("mean"), PoolingConfig("last"), PoolingConfig("cls"), PoolingConfig("last", normalize=False)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("embed-gpu")
    make_checkpoint(path, "llama", seed=3)
    return path


@pytest.fixture(scope="module")
def cpu_vectors(checkpoint):
    with LLM(str(checkpoint), dtype="float32") as llm:
        return {p: torch.tensor([o.outputs.embedding for o in llm.embed([{"prompt_token_ids": i} for i in INPUTS],
                                                                        pooling=p)]) for p in POOLINGS}


@pytest.mark.parametrize("dtype, rtol", [("float32", 1e-4), ("bfloat16", 4e-2)])
@pytest.mark.parametrize("chunk", [None, 32])
def test_vectors_match_the_cpu_backend(checkpoint, cpu_vectors, dtype, rtol, chunk):
    with LLM(str(checkpoint), backend="cuda", dtype=dtype, max_num_batched_tokens=chunk, max_num_seqs=4) as llm:
        for pooling, want in cpu_vectors.items():
            got = torch.tensor([o.outputs.embedding
                                for o in llm.embed([{"prompt_token_ids": i} for i in INPUTS], pooling=pooling)])
            # relative to the vectors' size (unnormalised last-token states reach ~2)
            assert ((got - want).abs().max() / want.abs().max()).item() < rtol, pooling
        blocks = llm.llm_engine.scheduler.block_manager
        assert blocks.num_free_blocks == blocks.num_blocks


def test_embedding_passes_between_async_generation_steps(checkpoint):
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompt = [5, 17, 99, 3, 250]
    with LLM(str(checkpoint), backend="cuda", dtype="float32", max_num_batched_tokens=32) as llm:
        engine = llm.llm_engine
        assert engine.async_scheduling
        solo = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
        alone = engine.embed([INPUTS[0]], PoolingConfig("mean"))[0]
        seqs = engine.add_request("g", prompt, params)
        embedder = Embedder(engine)
        for i in range(6):
            embedder.add(f"e{i}", [INPUTS[0]], PoolingConfig("mean"))
        vectors, passes = [], 0
        while engine.has_unfinished() or embedder.has_work():   # the engine core's loop, by hand
            if embedder.has_work():
                for job in embedder.step() or []:
                    vectors += job.vectors
                passes += 1
            if engine.has_unfinished():
                engine.step()
        assert list(seqs[0].output_token_ids) == list(solo)
        assert len(vectors) == 6 and max((v - alone).abs().max().item() for v in vectors) < 1e-5 and passes > 6
