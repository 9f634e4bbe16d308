"""Speculative decoding on the CUDA backend as users run it (CUDA graphs on): verify steps replay graphs captured
for (batch size, 1 + K queries), and greedy output equals the run without speculation token for token. GPU only."""

from __future__ import annotations

import pytest
import torch

from cvllm import LLM, SamplingParams
from cvllm.testing import make_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "min_acceptance_rate": 0.0}


def prompts(batch: int, mixed: bool) -> list[list[int]]:
    """Repeated phrases, so the n-gram finds drafts. ``mixed``: contexts of different lengths and one prompt
    without repeats (steps where some sequences draft and some do not run eagerly); else ``batch`` copies of one
    prompt, whose sequences draft alike every step, so their verify steps replay graphs (batch 3: padded to 4)."""
    generator = torch.Generator().manual_seed(7)
    phrase = torch.randint(3, 512, (12,), generator=generator).tolist()
    if not mixed:
        return [phrase * 9] * batch
    return [phrase * 9, phrase[:5] * 3 + phrase * 4, torch.randint(3, 512, (40,), generator=generator).tolist()]


def run(path, dtype: str, batch: int, spec: dict | None, mixed: bool = False, **options):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(str(path), backend="cuda", dtype=dtype, speculative_config=spec, num_kv_blocks=64, block_size=16,
             **options) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts(batch, mixed)], params)
        graphs = llm.llm_engine.runner.decode_forward
        return [list(o.outputs[0].token_ids) for o in outputs], graphs, llm.llm_engine.stats


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 3])
def test_verify_steps_replay_graphs_and_change_nothing(tmp_path, dtype, batch):
    make_checkpoint(tmp_path, "llama")
    want, _, _ = run(tmp_path, dtype, batch, None)
    got, graphs, stats = run(tmp_path, dtype, batch, SPEC)
    assert got == want
    assert any(q == 5 for _, q in graphs.graphs), "no verify graph captured"
    assert stats.spec_verifications > 0 and graphs.verify_replays > 0


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_mixed_batches_match(tmp_path, enforce_eager):
    make_checkpoint(tmp_path, "llama")
    want, _, _ = run(tmp_path, "float32", 3, None, mixed=True, enforce_eager=enforce_eager)
    got, _, stats = run(tmp_path, "float32", 3, SPEC, mixed=True, enforce_eager=enforce_eager)
    assert got == want and stats.spec_verifications > 0


@pytest.mark.parametrize("batch, mixed", [(1, False), (3, False), (3, True)])
def test_staged_step_inputs_change_nothing(tmp_path, monkeypatch, batch, mixed):
    """CVLLM_STAGE_STEP_INPUTS=1 (cvllm_cuda/staging.py): decode, verify and prefill steps written straight into the
    graphs' input region give the tokens of the general upload, with and without speculation (async decode rows
    filled from the step in flight, padded verify batches, mixed eager steps, lone prefill chunks)."""
    make_checkpoint(tmp_path, "llama")
    want, _, _ = run(tmp_path, "float32", batch, None, mixed=mixed)
    want_spec, _, _ = run(tmp_path, "float32", batch, SPEC, mixed=mixed)
    monkeypatch.setenv("CVLLM_STAGE_STEP_INPUTS", "1")
    got, graphs, _ = run(tmp_path, "float32", batch, None, mixed=mixed)
    got_spec, spec_graphs, stats = run(tmp_path, "float32", batch, SPEC, mixed=mixed)
    assert got == want and got_spec == want_spec == want
    assert graphs.input_staging is not None and graphs.replays > 0 and stats.spec_verifications > 0


@pytest.mark.parametrize("batch, mixed, options", [(1, False, {}), (3, False, {}), (3, True, {}),
                                                   (3, False, {"enforce_eager": True}), (3, False, {"staged": True})],
                         ids=["1", "3", "mixed", "eager", "staged"])
def test_device_drafts_change_nothing(tmp_path, monkeypatch, batch, mixed, options):
    """device_drafts (engine/ngram_device.py): verify steps launched a step behind on inputs the device computed
    (the n-gram lookup, positions, slots, lengths), replayed in the verify graphs (or eager, or staged), give the
    plain run's tokens."""
    options = dict(options)
    if options.pop("staged", False):
        monkeypatch.setenv("CVLLM_STAGE_STEP_INPUTS", "1")
    make_checkpoint(tmp_path, "llama")
    want, _, _ = run(tmp_path, "float32", batch, None, mixed=mixed, **options)
    spec = {**SPEC, "device_drafts": True, "draft_token_cost": 0}
    got, graphs, stats = run(tmp_path, "float32", batch, spec, mixed=mixed, **options)
    assert got == want
    assert stats.spec_verifications > 0
    if not mixed:
        assert stats.spec_lagged_steps > 0
        if not options:
            assert graphs.verify_replays > 0
