"""Device drafts (engine/ngram_device.py) through the CUDA backend's kernels under the engine's real traffic, on the
CPU: a tiny Llama on the CPU backend whose ``advance_ngram`` and ``lagged_fixup`` are cvllm_cuda's Triton kernels (in
Triton's interpreter here), with the steps uploaded as usual or staged as the CUDA graphs read them (the block tables
in the region's own row stride), against plain decoding. The kernels get exactly the views the executor passes. The
GPU's run of the same is test_speculative_gpu.py's."""

from __future__ import annotations

import pytest
import torch

from cvllm import LLM, SamplingParams
from cvllm.testing import make_checkpoint
from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")  # a skip locally, an error under CI=true

from cvllm_cuda.kernels.lagged_fixup import lagged_fixup  # noqa: E402
from cvllm_cuda.kernels.ngram import advance_ngram  # noqa: E402
from cvllm_cuda.staging import StepStaging  # noqa: E402

DEVICE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
          "device_drafts": True}
BIAS = {300: 100.0, 301: 100.0}


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() * 3 + [7, 8] for n in (5, 9, 4)]


def run(path, speculative: dict | None, staged: bool = False):
    llm = LLM(model=str(path), dtype="float32", block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
              max_model_len=256, async_scheduling=True, speculative_config=speculative)
    engine = llm.llm_engine
    calls = {"advance": 0, "fixup": 0}

    def counted(name, kernel):
        def call(*args):
            calls[name] += 1
            return kernel(*args)
        return call

    engine.backend.advance_ngram = counted("advance", advance_ngram)
    engine.backend.lagged_fixup = counted("fixup", lagged_fixup)
    if staged:
        engine.runner.staging = StepStaging(torch.device("cpu"), rows=64, seqs=4, max_blocks=16)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias=BIAS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params)
    return [list(o.outputs[0].token_ids) for o in outputs], engine.stats, calls


@pytest.mark.parametrize("staged", [False, True], ids=["uploaded", "staged"])
def test_the_kernels_give_the_plain_paths_tokens(tmp_path, staged):
    make_checkpoint(tmp_path, "llama")
    want, _, _ = run(tmp_path, None)
    got, stats, calls = run(tmp_path, DEVICE, staged)
    assert got == want
    assert stats.spec_lagged_steps > 0 and calls["fixup"] == stats.spec_lagged_steps and calls["advance"] > 0
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
