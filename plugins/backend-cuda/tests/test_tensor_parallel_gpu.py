"""Tensor parallelism on CUDA: sharded models give the tokens of one rank.

One GPU: two ranks share it, the device collectives over gloo (CVLLM_TP_DEVICE_COMM=gloo; NCCL refuses two ranks
on one device), eager. That checks everything but NCCL itself: device binding, the sharded CUDA layers, the step
messages with device tensors, async decode rows. Two GPUs or more: NCCL, with the decode steps and their
all-reduces captured in CUDA graphs (the defaults), and --d picking devices other than the first."""

from __future__ import annotations

import os

import pytest
import torch

from cvllm import LLM, SamplingParams
from cvllm.testing import make_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

PROMPTS = [[1, 5, 9, 23, 7, 11, 3, 4, 99, 100, 17, 2, 8], [4, 8, 15, 16, 23, 42], [7] * 40]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def greedy(path, **options) -> tuple[list[list[int]], object]:
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, **options)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
        return [list(o.outputs[0].token_ids) for o in outputs], llm.llm_engine.stats
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_two_ranks_on_one_gpu_match_one(tmp_path, monkeypatch, arch):
    make_checkpoint(tmp_path, arch)
    want, _ = greedy(tmp_path, enforce_eager=True)
    monkeypatch.setenv("CVLLM_TP_DEVICE_COMM", "gloo")   # inherited by the spawned rank
    got, stats = greedy(tmp_path, tensor_parallel_size=2, enforce_eager=True, device_ids=[0, 0])
    assert got == want
    assert stats.overlapped_steps > 0   # async scheduling: decode rows took rank 0's in-flight tokens


@two_gpus
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_two_gpus_over_nccl_with_graphs(tmp_path, arch):
    make_checkpoint(tmp_path, arch)
    want, _ = greedy(tmp_path)
    got, stats = greedy(tmp_path, tensor_parallel_size=2)
    assert got == want
    assert stats.overlapped_steps > 0


@two_gpus
def test_devices_other_than_the_first(tmp_path):
    """--d 1 (one rank on the second GPU) and --d 1,0 (reversed)."""
    make_checkpoint(tmp_path)
    want, _ = greedy(tmp_path)
    got, _ = greedy(tmp_path, device_ids=[1])
    assert got == want
    got, _ = greedy(tmp_path, tensor_parallel_size=2, device_ids=[1, 0])
    assert got == want
