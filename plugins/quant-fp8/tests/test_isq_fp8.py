"""``--isq fp8``: an unquantized checkpoint's linear layers (MoE experts too) rounded to e4m3 with a scale an output
row as they load, computing what a float checkpoint of the rounded weights computes (float32, bit for bit; two
ranks the same tokens); the LM head stays float unless CVLLM_ISQ_LM_HEAD=fp8; on CUDA the row form under graphs."""

from __future__ import annotations

import pytest
import torch
from fp8_checkpoints import PROMPTS, WIDE, needs_gpu, rounded_copy, run
from safetensors.torch import load_file

from cvllm import LLM, SamplingParams
from cvllm.testing.checkpoints import cvllm_greedy, make_checkpoint
from cvllm_fp8.head import LM_HEAD_ENV, FP8HeadMethod
from cvllm_fp8.linear_method import FP8LinearMethod, dequantize, quantize_rows


def test_isq_fp8_computes_the_row_quantized_model(tmp_path):
    make_checkpoint(tmp_path / "base", "llama")
    rounded_copy(tmp_path / "base", tmp_path / "rows")
    ours, kinds = run(tmp_path / "base", isq="fp8")
    assert kinds == {"FP8LinearMethod"}
    assert ours == run(tmp_path / "rows")[0]
    two = cvllm_greedy(tmp_path / "base", PROMPTS, 8, dtype="float32", num_kv_blocks=32, isq="fp8",
                       tensor_parallel_size=2)
    assert two == [tokens for tokens, _ in ours]


@pytest.mark.parametrize("head", [None, "float", "fp8"])
def test_isq_fp8_lm_head_stays_float_unless_asked(tmp_path, monkeypatch, head):
    """CVLLM_ISQ_LM_HEAD=fp8: an untied head's rows rounded to e4m3 as the layers' are, its logits those of the
    rounded weights; unset or "float" (vLLM's choice for FP8) it is the checkpoint's; a tied head stays the
    embedding's float table."""
    if head is not None:
        monkeypatch.setenv(LM_HEAD_ENV, head)
    make_checkpoint(tmp_path / "base", "llama", tie_word_embeddings=False)
    head_w = load_file(tmp_path / "base" / "model.safetensors")["lm_head.weight"]
    rounded_copy(tmp_path / "base", tmp_path / "rounded", also=("lm_head.weight",) if head == "fp8" else ())
    llm = LLM(str(tmp_path / "base"), dtype="float32", num_kv_blocks=32, isq="fp8")
    try:
        lm_head = llm.llm_engine.runner.model.lm_head
        if head == "fp8":
            assert isinstance(lm_head.quant_method, FP8HeadMethod) and lm_head.fp8_compute == "dense"
            assert torch.equal(lm_head.weight, dequantize(*quantize_rows(head_w)))
            assert not torch.equal(lm_head.weight, head_w)
        else:
            assert lm_head.quant_method is None and torch.equal(lm_head.weight, head_w)
    finally:
        llm.shutdown()
    assert run(tmp_path / "base", isq="fp8")[0] == run(tmp_path / "rounded")[0]
    if head != "fp8":
        return
    make_checkpoint(tmp_path / "tied", "llama", tie_word_embeddings=True)
    tied = LLM(str(tmp_path / "tied"), dtype="float32", num_kv_blocks=32, isq="fp8")
    try:
        model = tied.llm_engine.runner.model
        assert model.lm_head.quant_method is None and model.model.embed_tokens.quant_method is None
    finally:
        tied.shutdown()


@pytest.mark.parametrize("method", [FP8LinearMethod(None, "model.layers.0.mlp.down_proj"), FP8HeadMethod("lm_head")])
def test_isq_fp8_takes_float_weights_only(method):
    """The layers' loader and the head's share one check: an integer or already-FP8 tensor is an error naming the
    layer, not rounded again."""
    weights = torch.randn(4, 8)
    assert method.float_weights(weights.to(torch.bfloat16)).dtype == torch.bfloat16
    for dtype in (torch.int8, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match=f"'{method.layer_name}' expects float weights, the checkpoint has "
                                             f"{dtype}"):
            method.float_weights(weights.to(dtype))


def test_isq_fp8_lm_head_choice_is_checked_before_loading(tmp_path, monkeypatch):
    make_checkpoint(tmp_path / "base", "llama")
    monkeypatch.setenv(LM_HEAD_ENV, "q6k")   # a GGUF type: --isq q4k's choice, not fp8's
    with pytest.raises(ValueError, match="with --isq fp8 the LM head is 'float' .* or 'fp8'"):
        LLM(str(tmp_path / "base"), dtype="float32", num_kv_blocks=32, isq="fp8")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("head", [None, "fp8"])
def test_isq_fp8_on_cuda_takes_the_row_form(tmp_path, monkeypatch, head):
    """End to end under CUDA graphs: every projection of an ``--isq fp8`` model in the row form (e4m3 weights as
    they are, no float copy), the LM head too with CVLLM_ISQ_LM_HEAD=fp8, its tokens close to the CPU's (prefill's
    W8A8 rounds the activations: reported, not required equal)."""
    if head is not None:
        monkeypatch.setenv(LM_HEAD_ENV, head)
    make_checkpoint(tmp_path / "base", "llama", **WIDE)
    options = dict(dtype="float32", num_kv_blocks=32, isq="fp8")
    cuda = LLM(str(tmp_path / "base"), backend="cuda", max_num_seqs=4, **options)
    try:
        forms = {m.fp8_compute for m in cuda.llm_engine.runner.model.modules() if hasattr(m, "fp8_compute")}
        assert forms == {"rows"}
        down = cuda.llm_engine.runner.model.model.layers[0].mlp.down_proj
        assert down.weight.dtype == torch.float8_e4m3fn and down.weight.is_cuda
        lm_head = cuda.llm_engine.runner.model.lm_head
        if head == "fp8":
            assert lm_head.weight.dtype == torch.float8_e4m3fn and lm_head.fp8_row_scale.shape == (512,)
        else:
            assert lm_head.quant_method is None and lm_head.weight.dtype == torch.float32
        theirs = cvllm_greedy(tmp_path / "base", PROMPTS, 8, backend="cpu", **options)
        outs = cuda.generate([{"prompt_token_ids": p} for p in PROMPTS],
                             SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        ours = [list(o.outputs[0].token_ids) for o in outs]
        assert all(len(t) == 8 for t in ours)
        same = sum(a == b for o, t in zip(ours, theirs) for a, b in zip(o, t))
        print(f"isq fp8 on CUDA, {head or 'float'} head: {same}/{8 * len(PROMPTS)} greedy tokens equal to the CPU's")
    finally:
        cuda.shutdown()


def test_isq_fp8_quantizes_moe_experts_too(tmp_path):
    """``--isq fp8`` on an unquantized MoE checkpoint: the experts get one scale per output row after loading, as
    the dense layers do while loading: what a float checkpoint of the rounded weights computes."""
    from cvllm.layers.fused_moe import FusedMoE

    make_checkpoint(tmp_path / "base", "qwen3_moe", norm_topk_prob=True)
    rounded_copy(tmp_path / "base", tmp_path / "rounded")
    ours, _ = run(tmp_path / "base", isq="fp8")
    assert ours == run(tmp_path / "rounded")[0]
    llm = LLM(str(tmp_path / "base"), dtype="float32", num_kv_blocks=32, isq="fp8")
    try:
        assert {type(m.quant_method).__name__ for m in llm.llm_engine.runner.model.modules()
                if isinstance(m, FusedMoE)} == {"FP8ExpertsMethod"}
    finally:
        llm.shutdown()
