"""A GGUF file as the draft model of speculative decoding: opened and loaded as a target GGUF is (its quantized
layers too). The target here is a Hugging Face directory of the same weights, so every draft is accepted."""

from __future__ import annotations

from cvllm import LLM
from cvllm.sampling_params import SamplingParams
from cvllm_gguf.testing import write_tiny_llama


def test_a_gguf_draft_model_proposes_what_the_target_generates(tmp_path, make_rows):
    path, hf_dir, _ = write_tiny_llama(tmp_path, make_rows)
    prompts = [[5, 17, 33, 2], [90, 1, 44, 44, 3, 8, 61, 12, 70, 9, 11, 4, 85, 30, 31, 32, 33, 50], [7]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    draft = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    plain, spec = (LLM(model=str(hf_dir), dtype="float32", num_kv_blocks=32, speculative_config=s)
                   for s in (None, draft))
    want, got = ([out.outputs[0].token_ids for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
                 for llm in (plain, spec))
    stats = spec.llm_engine.stats
    assert got == want
    assert stats.spec_verifications > 0 and stats.spec_accepted_tokens >= 0.95 * stats.spec_draft_tokens
