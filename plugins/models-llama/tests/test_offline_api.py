"""The offline API (vLLM's shape) end to end on a tiny Llama with a real tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from cvllm import LLM, SamplingParams
from cvllm.testing import EOS_TOKEN_ID, hf_greedy, make_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("api-llama")
    make_checkpoint(path, "llama", seed=3)
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), dtype="float32", block_size=16, max_num_seqs=8)


def test_string_prompts_are_tokenized_and_decoded(llm):
    tok = llm.get_tokenizer()
    out = llm.generate(["hello world", "the quick brown fox"], SamplingParams(temperature=0, max_tokens=12,
                                                                              ignore_eos=True))
    assert [o.prompt for o in out] == ["hello world", "the quick brown fox"]
    for o in out:
        assert o.prompt_token_ids == tok.encode(o.prompt)
        comp = o.outputs[0]
        assert len(comp.token_ids) == 12 and comp.finish_reason == "length"
        assert comp.text == tok.decode(comp.token_ids)


def test_greedy_matches_transformers_for_text_prompts(llm, model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ids = llm.get_tokenizer().encode("a small test of the engine")
    ours = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert ours[0].outputs[0].token_ids == hf_greedy(hf, [ids], 20)[0]


def test_chat_applies_the_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    expected_prompt = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert out[0].prompt == expected_prompt
    assert out[0].prompt_token_ids == tok.encode(expected_prompt, add_special_tokens=False)
    many = llm.chat([messages, messages[1:]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(many) == 2 and many[0].outputs[0].token_ids == out[0].outputs[0].token_ids
    # tools reach the template
    template = "{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}|{{ messages[-1].content }}"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    with_tools = llm.chat(messages, SamplingParams(max_tokens=1), chat_template=template, tools=tools)
    assert with_tools[0].prompt == "get_weather|hi"


def test_max_tokens_eos_and_stop_token_ids(llm):
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_at]))[0].outputs[0]
    if EOS_TOKEN_ID in free.token_ids[:first]:
        pytest.skip("greedy output hits EOS first")
    assert out.token_ids == free.token_ids[:first + 1]   # the stop token is kept in token_ids
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    # min_tokens suppresses the stop set until enough tokens exist
    held = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_at],
                                               min_tokens=first + 2))[0].outputs[0]
    assert len(held.token_ids) >= first + 2
    assert stop_at not in held.token_ids[:first + 2]


def test_stop_strings_cut_the_text(llm):
    prompt = "once upon a time"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    text = free.text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    comp = out.outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop
    assert comp.text == text[: text.index(stop)]
    assert len(comp.token_ids) < 24
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                               include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_seeded_sampling_is_reproducible_and_n_children_differ(llm):
    params = SamplingParams(temperature=1.0, top_k=50, max_tokens=16, seed=1234, n=3, ignore_eos=True)
    prompt = {"prompt_token_ids": [11, 12, 13]}
    a = llm.generate(prompt, params)[0]
    b = llm.generate([prompt, {"prompt_token_ids": [40, 41]}], params)[0]  # batch composition must not matter
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3


def test_logprobs_are_raw_log_softmax(llm):
    ids = [21, 22, 23, 24]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=3, logprobs=4,
                                                                 ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 3
    logits = llm.llm_engine.prompt_logits([ids + out.token_ids[:2]])[0]
    expected = torch.log_softmax(logits[len(ids) - 1:], dim=-1)
    for step, (entry, token) in enumerate(zip(out.logprobs, out.token_ids)):
        assert token in entry and len(entry) == 4   # greedy: the sampled token is the top one
        assert entry[token].rank == 1
        top = torch.topk(expected[step], 4)
        assert list(entry) == top.indices.tolist()
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(expected[step, tid].item(), abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(out.logprobs, out.token_ids)))


def test_prompt_longer_than_the_context_is_rejected(model_dir):
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=32)
    with pytest.raises(ValueError, match="maximum model length 32"):
        llm.generate({"prompt_token_ids": list(range(3, 40))}, SamplingParams(max_tokens=2))
    # and generation stops at the context limit, never past it
    out = llm.generate({"prompt_token_ids": list(range(3, 30))}, SamplingParams(max_tokens=50, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 32 - 27 and out[0].outputs[0].finish_reason == "length"


def test_max_model_len_is_capped_to_the_kv_pool(model_dir):
    llm = LLM(model=str(model_dir), dtype="float32", block_size=16, num_kv_blocks=4)
    assert llm.llm_engine.max_model_len == 64


def test_generation_config_supplies_default_sampling(model_dir, tmp_path):
    import shutil

    path = tmp_path / "m"
    shutil.copytree(model_dir, path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                                            "eos_token_id": [EOS_TOKEN_ID, 7]}))
    llm = LLM(model=str(path), dtype="float32")
    defaults = llm.default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.6, 0.9, 20)
    assert llm.llm_engine.eos_token_ids == {EOS_TOKEN_ID, 7}
    # vLLM's generation_config="vllm": SamplingParams' own defaults; the file's stop ids still apply
    plain = LLM(model=str(path), dtype="float32", generation_config="vllm")
    assert plain.default_sampling_params() == SamplingParams()
    assert plain.llm_engine.eos_token_ids == {EOS_TOKEN_ID, 7}
    with pytest.raises(ValueError, match="generation_config must be one of auto, vllm, got 'model'"):
        LLM(model=str(path), generation_config="model")


def test_bad_prompts_raise_clear_errors(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, SamplingParams())
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate({"prompt_token_ids": [10**6]}, SamplingParams())
    with pytest.raises(TypeError):
        llm.generate(["fine", 123], SamplingParams())
    # the engine is still usable afterwards
    assert not llm.llm_engine.has_unfinished()
    assert llm.generate("ok", SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids


def test_prompt_logprobs_through_chunks_and_prefix_cache(model_dir):
    llm = LLM(model=str(model_dir), dtype="float32", block_size=8, max_num_batched_tokens=16)
    ids = list(range(30, 70))  # 40 tokens: three chunks of 16
    # cache the prompt's blocks first: a prompt-logprobs request must not skip them
    llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1))
    stats = llm.llm_engine.stats
    hits_before, chunks_before = stats.prefix_hit_tokens, stats.prefill_chunks
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    assert stats.prefix_hit_tokens == hits_before           # it recomputed the cached blocks ...
    assert stats.prefill_chunks - chunks_before == 2        # ... in chunks of 16 (two before the last)
    # the blocks were cached all along: a plain request of the same prompt hits them
    llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1))
    assert stats.prefix_hit_tokens - hits_before >= 32
    expected = torch.log_softmax(llm.llm_engine.prompt_logits([ids])[0], dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert entry[ids[pos]].logprob == pytest.approx(expected[pos - 1, ids[pos]].item(), abs=1e-4)
        top = torch.topk(expected[pos - 1], 3).indices.tolist()
        assert [t for t, lp in entry.items() if lp.rank is not None] == top


def test_logit_bias_steers_greedy_decoding(llm):
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0].token_ids
    forced = 77 if 77 not in free else 78
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                              logit_bias={forced: 100.0}))[0].outputs[0].token_ids
    assert out == [forced] * 6
    banned = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                 logit_bias={free[0]: -100.0}))[0].outputs[0].token_ids
    assert banned[0] != free[0]
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 500.0})


def test_a_device_backend_runs_its_host_work_on_its_own_threads(model_dir, monkeypatch):
    """A backend's ``host_threads`` sets torch's CPU threads once the engine is built, unless OMP_NUM_THREADS is set."""
    from cvllm.backends.cpu import CpuBackend

    threads = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(CpuBackend, "host_threads", 1, raising=False)
        torch.set_num_threads(2)
        LLM(model=str(model_dir), dtype="float32", num_kv_blocks=4)
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        torch.set_num_threads(2)
        LLM(model=str(model_dir), dtype="float32", num_kv_blocks=4)
        assert torch.get_num_threads() == 2, "OMP_NUM_THREADS, when set, is the user's choice"
    finally:
        torch.set_num_threads(threads)


def test_shutdown_context_manager_and_del_free_the_model(model_dir):
    """No reference outlives the LLM: the model (its weights), KV cache and graphs go when it is shut down, when
    its ``with`` block ends, and when it is deleted and garbage-collected (the GPU test measures the memory)."""
    import gc
    import weakref

    def model_ref(llm: LLM) -> weakref.ref:
        llm.generate("warm", SamplingParams(max_tokens=2, ignore_eos=True))
        return weakref.ref(llm.llm_engine.runner.model)

    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=8)
    ref = model_ref(llm)
    llm.shutdown()
    assert ref() is None
    llm.shutdown()   # twice is fine
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("again", SamplingParams(max_tokens=2))

    with LLM(model=str(model_dir), dtype="float32", num_kv_blocks=8) as llm:
        ref = model_ref(llm)
    assert ref() is None

    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=8)
    ref = model_ref(llm)
    del llm
    gc.collect()
    assert ref() is None


def test_a_kv_cache_full_of_nan_changes_nothing(model_dir):
    """The KV cache is allocated without a fill: slots no sequence wrote (the rest of a last block, padded
    block-table entries pointing at block 0) must never reach an output, whatever they hold."""
    prompts = [{"prompt_token_ids": list(range(5 + n, 5 + n + length))} for n, length in enumerate((3, 11, 27, 6))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)

    def run(fill: float) -> list:
        llm = LLM(model=str(model_dir), dtype="float32", block_size=8, max_num_batched_tokens=16, num_kv_blocks=32)
        for layer in llm.llm_engine.runner.attention_layers:
            layer.k_cache.fill_(fill)
            layer.v_cache.fill_(fill)
        return [(out.outputs[0].token_ids, out.outputs[0].cumulative_logprob) for out in llm.generate(prompts, params)]

    with_nan, with_zeros = run(float("nan")), run(0.0)
    assert with_nan == with_zeros
    assert all(logprob == logprob for _, logprob in with_nan)   # no NaN
