"""GPTQ and AWQ checkpoints of a tiny Llama, quantized by the tests' own RTN reference (marlin_reference.py): cvllm
must compute exactly what a float checkpoint of the dequantized weights computes. In float32 the dequantized
weights are bit-identical, so cvllm's logprobs on the quantized checkpoint equal those on the float one exactly,
and its greedy tokens equal transformers' on the dequantized weights (logprobs within 1e-4)."""

from __future__ import annotations

import pytest
import torch
from marlin_reference import tiny_pair, write_quantized

from cvllm import LLM, SamplingParams
from cvllm.checkpoint.base import CheckpointError
from cvllm.testing.checkpoints import hf_greedy, hf_logits, make_checkpoint

PROMPTS = [[1, 5, 9, 23, 7, 11, 3, 4, 99, 100, 17, 2, 8], [4, 8, 15, 16, 23, 42]]
MAX_TOKENS = 8


def run(path):
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        layer = llm.llm_engine.runner.model.model.layers[0]
        kinds = {type(m.quant_method).__name__ for m in (layer.self_attn.qkv_proj, layer.mlp.down_proj)}
    finally:
        llm.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [[entry[t].logprob for entry, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                for o in outputs]
    return tokens, logprobs, kinds


CASES = {
    "gptq-4bit-g32-sym": ("gptq", {"bits": 4, "group_size": 32, "sym": True}),
    "gptq-4bit-g32-asym-act-order": ("gptq", {"bits": 4, "group_size": 32, "sym": False, "desc_act": True}),
    "gptq-8bit-g64-asym": ("gptq", {"bits": 8, "group_size": 64, "sym": False}),
    "gptq-4bit-per-row-act-order": ("gptq", {"bits": 4, "group_size": -1, "sym": True, "desc_act": True}),
    "gptq_v2-4bit-g32-asym": ("gptq", {"bits": 4, "group_size": 32, "sym": False, "v1": False}),
    "awq-4bit-g32": ("awq", {"bits": 4, "group_size": 32}),
    "awq-4bit-per-row": ("awq", {"bits": 4, "group_size": -1}),
}


@pytest.mark.parametrize("case", CASES)
def test_quantized_checkpoint_computes_the_dequantized_model(tmp_path, case):
    fmt, options = CASES[case]
    model, quantized, floats = tiny_pair(tmp_path, fmt, **options)
    tokens, logprobs, kinds = run(quantized)
    assert kinds == {"GPTQLinearMethod" if fmt == "gptq" else "AWQLinearMethod"}
    float_tokens, float_logprobs, float_kinds = run(floats)
    assert float_kinds == {"UnquantizedLinearMethod"}
    assert tokens == float_tokens and logprobs == float_logprobs     # bit for bit
    assert tokens == hf_greedy(model, PROMPTS, MAX_TOKENS)
    for prompt, continuation, ours in zip(PROMPTS, tokens, logprobs):
        ids = prompt + continuation
        theirs = torch.log_softmax(hf_logits(model, ids), -1)[len(prompt) - 1:-1]
        assert ours == pytest.approx(theirs.gather(1, torch.tensor(continuation)[:, None]).flatten().tolist(),
                                     abs=1e-4)


def test_quantization_changed_the_weights(tmp_path):
    """The oracle is not vacuous: the dequantized weights differ from the float ones (4-bit RTN error)."""
    base = tmp_path / "base"
    model = make_checkpoint(base, "llama")
    state = write_quantized(base, tmp_path / "gptq", "gptq", bits=4, group_size=32)
    original = model.model.layers[0].self_attn.q_proj.weight
    deq = state["model.layers.0.self_attn.q_proj.weight"]
    assert 0 < (deq - original).abs().max() < 0.2 * original.abs().max()


def test_bfloat16_engine_dequantizes_to_bfloat16(tmp_path):
    _, quantized, _ = tiny_pair(tmp_path, "gptq", bits=4, group_size=32)
    llm = LLM(str(quantized), dtype="bfloat16", num_kv_blocks=32)
    try:
        layer = llm.llm_engine.runner.model.model.layers[0].mlp.down_proj
        assert layer.weight.dtype == torch.bfloat16 and layer.weight.shape == (64, 128)
        assert layer.qweight.numel() == 0     # released after dequantizing
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


def test_unsupported_config_fails_before_loading(tmp_path):
    base = tmp_path / "base"
    make_checkpoint(base, "llama")
    write_quantized(base, tmp_path / "awq", "awq", extra_config={"version": "gemv"})
    with pytest.raises(CheckpointError, match="version 'gemv' is not supported"):
        LLM(str(tmp_path / "awq"), dtype="float32", num_kv_blocks=32)


def test_layers_without_qweight_stay_float(tmp_path):
    """A module the checkpoint keeps in floating point (here every down_proj) loads unquantized beside the others."""
    base = tmp_path / "base"
    model = make_checkpoint(base, "llama")
    state = write_quantized(base, tmp_path / "gptq", "gptq", keep_float=("down_proj",))
    model.load_state_dict(state, strict=False)
    tokens, _, kinds = run(tmp_path / "gptq")
    assert kinds == {"GPTQLinearMethod", "UnquantizedLinearMethod"}
    assert tokens == hf_greedy(model, PROMPTS, MAX_TOKENS)


def test_fused_layer_of_quantized_and_float_parts_is_refused(tmp_path):
    base = tmp_path / "base"
    make_checkpoint(base, "llama")
    write_quantized(base, tmp_path / "gptq", "gptq", keep_float=("layers.1.self_attn.v_proj",))
    with pytest.raises(CheckpointError, match=r"layer 'model.layers.1.self_attn.qkv_proj' fuses quantized and "
                                              r"float weights .*v_proj float"):
        LLM(str(tmp_path / "gptq"), dtype="float32", num_kv_blocks=32)
