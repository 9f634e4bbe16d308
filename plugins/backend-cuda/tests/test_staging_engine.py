"""Step staging (cvllm_cuda/staging.py) under the engine's real traffic, on the CPU: a tiny Llama whose runner puts
every step that fits into a staging region and runs its eager forward pass from the views there, against the same
engine uploading as usual. Decode rows filled from the step in flight (async scheduling), speculative verify
chunks, chunked prefill, preemption and mixed steps all pass through ``StepStaging.stage``; the graphs' side of it
is test_graph_inputs.py's, the GPU's test_speculative_gpu.py's."""

from __future__ import annotations

import pytest
import torch

from cvllm import LLM, SamplingParams
from cvllm.testing import make_checkpoint
from cvllm_cuda.staging import StepStaging

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}

def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    out = []
    for n in (5, 9, 40, 3):
        phrase = torch.randint(3, 512, (n,), generator=generator).tolist()
        out.append(phrase * 4 + [7, 8])
    return out

def run(path, staged: bool, **engine):
    llm = LLM(model=str(path), dtype="float32", block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
              async_scheduling=True, **engine)
    staging = None
    if staged:
        staging = llm.llm_engine.runner.staging = StepStaging(torch.device("cpu"), rows=64, seqs=4, max_blocks=16)
        stage, staging.count = staging.stage, 0

        def counted(host):
            views = stage(host)
            staging.count += views is not None
            return views

        staging.stage = counted
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logit_bias={300: 100.0} if i % 2 else None)
              for i in range(4)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params)
    return [list(o.outputs[0].token_ids) for o in outputs], staging, llm.llm_engine.stats

@pytest.mark.parametrize("engine", [{}, {"speculative_config": NGRAM},
                                    {"speculative_config": NGRAM, "num_kv_blocks": 14}],
                         ids=["async-decode", "speculative", "preemption"])
def test_staged_steps_give_the_uploaded_steps_tokens(tmp_path, engine):
    make_checkpoint(tmp_path, "llama")
    want, _, _ = run(tmp_path, False, **engine)
    got, staging, stats = run(tmp_path, True, **engine)
    assert got == want
    assert staging.count > 20 and stats.overlapped_steps > 0
    if "speculative_config" in engine:
        assert stats.spec_verifications > 0
    if "num_kv_blocks" in engine:
        assert stats.preemptions > 0
