"""In-situ quantization: blocks byte-equal to the gguf package's, greedy equal to transformers on the
dequantized weights, llama.cpp's fallbacks, and the errors."""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from safetensors import safe_open

from cvllm import LLM
from cvllm.checkpoint.base import Checkpoint, CheckpointError
from cvllm.engine.model_runner import attach_quantization
from cvllm.sampling_params import SamplingParams
from cvllm.server.cli import build_server_args
from cvllm.testing import greedy_margins, hf_greedy, hf_logits, make_checkpoint
from cvllm_gguf import isq
from cvllm_gguf.dequant import dequantize
from cvllm_gguf.isq import head_type, layer_type, parse_isq_type
from cvllm_gguf.quant_types import GGMLType
from cvllm_gguf.quantize import quantize

LEGACY = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")
NEW_TOKENS = 12
PROMPTS = [[5, 17, 99, 230, 41, 8], [300, 12, 77]]


def make_model(directory: Path, **overrides):
    # hidden 256 and intermediate 512: every linear's rows hold whole K-quant super-blocks
    return make_checkpoint(directory, "llama", **{"hidden_size": 256, "intermediate_size": 512, **overrides})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("isq-llama")
    return directory, make_model(directory)


def gguf_blocks(weight: torch.Tensor, qtype: GGMLType) -> np.ndarray:
    return gguf_quants.quantize(weight.detach().float().numpy(), GGMLQuantizationType(int(qtype)))


def quantized_head(model, requested: GGMLType) -> torch.Tensor:
    """The untied LM head's values after ``--isq requested``: llama.cpp's type for it (Q6_K; Q8_0 for Q8_0) by
    cvllm_gguf's quantizer (byte-equal to llama.cpp's in the kquants tests), dequantized."""
    w = model.lm_head.weight
    qtype = layer_type(head_type(requested), w.shape[1])
    return dequantize(quantize(w, qtype), qtype, tuple(w.shape))


def dequantized_reference(model, qtype: GGMLType):
    """The HF model with every linear weight replaced by dequantize(quantize(w)) (the gguf package's), the LM head
    by ``quantized_head``'s."""
    reference = copy.deepcopy(model)
    kind = GGMLQuantizationType(int(qtype))
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                blocks = gguf_quants.quantize(module.weight.numpy(), kind)
                module.weight.copy_(torch.from_numpy(gguf_quants.dequantize(blocks, kind)))
        reference.lm_head.weight.copy_(quantized_head(model, qtype))
    return reference


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def expected_rows(model, layer: int, fused: str) -> torch.Tensor:
    """The HF float rows our fused (or plain) layer holds, in its order."""
    block = model.model.layers[layer]
    parts = {"qkv_proj": [block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj],
             "o_proj": [block.self_attn.o_proj], "gate_up_proj": [block.mlp.gate_proj, block.mlp.up_proj],
             "down_proj": [block.mlp.down_proj]}[fused]
    return torch.cat([p.weight for p in parts])


@pytest.mark.parametrize("name", LEGACY)
def test_legacy_types_quantize_like_gguf_and_generate_like_transformers(checkpoint, name):
    directory, model = checkpoint
    qtype = parse_isq_type(name)
    llm = LLM(model=str(directory), dtype="float32", isq=name, num_kv_blocks=64)
    ours = llm.llm_engine.runner.model
    layers = {n: m for n, m in ours.named_modules() if hasattr(m, "set_quant_method")}
    assert len(layers) == 4 * model.config.num_hidden_layers
    for layer_name, layer in layers.items():
        index, fused = int(layer_name.split(".")[2]), layer_name.rpartition(".")[2]
        assert layer.qtype == qtype and layer.gguf_compute == "fp32"
        want = gguf_blocks(expected_rows(model, index, fused), qtype)
        np.testing.assert_array_equal(layer.qweight.numpy(), want, err_msg=layer_name)
    # the LM head in llama.cpp's type for it, the embedding float, exactly the checkpoint's
    assert ours.lm_head.qtype == (GGMLType.Q8_0 if qtype == GGMLType.Q8_0 else GGMLType.Q6_K)
    assert torch.equal(ours.lm_head.weight, quantized_head(model, qtype))
    torch.testing.assert_close(ours.model.embed_tokens.weight, model.model.embed_tokens.weight, rtol=0, atol=0)

    reference = dequantized_reference(model, qtype)
    for prompt, logits in zip(PROMPTS, llm.llm_engine.prompt_logits(PROMPTS)):
        assert (logits.float() - hf_logits(reference, prompt)).abs().max() < 1e-3
        # the quantization error is far above that: the comparison does tell the weights apart
        assert (logits.float() - hf_logits(model, prompt)).abs().max() > 0.1
    expected = hf_greedy(reference, PROMPTS, NEW_TOKENS)
    for prompt, output in zip(PROMPTS, expected):
        assert min(greedy_margins(reference, prompt, output)) > 1e-4, "oracle near a tie: pick other prompts"
    assert greedy(llm) == expected


def own_reference(model, qtype: GGMLType | Callable[[int], GGMLType], head: torch.Tensor | None = None):
    """As ``dequantized_reference``, with cvllm_gguf's quantize/dequantize (gguf's numpy has no K-quant
    quantizer; kquants' own tests hold those bytes to llama.cpp's); ``qtype`` may depend on in_features; the LM
    head ``head``'s values where given, else ``quantized_head``'s for the requested type."""
    type_for = qtype if callable(qtype) else lambda _: qtype
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                w, layer_qtype = module.weight, type_for(module.in_features)
                module.weight.copy_(dequantize(quantize(w, layer_qtype), layer_qtype, tuple(w.shape)))
        requested = type_for(model.config.hidden_size)
        reference.lm_head.weight.copy_(quantized_head(model, requested) if head is None else head)
    return reference


@pytest.mark.parametrize("name", ("q2k", "q3k", "q4k", "q5k", "q6k"))
def test_k_types_once_their_quantizer_exists(checkpoint, name):
    directory, model = checkpoint
    qtype = parse_isq_type(name)
    try:
        quantize(torch.zeros(1, 256), qtype)
    except NotImplementedError:
        pytest.skip(f"no {qtype.name} quantizer yet")
    llm = LLM(model=str(directory), dtype="float32", isq=name, num_kv_blocks=64)
    qkv = llm.llm_engine.runner.model.model.layers[1].self_attn.qkv_proj
    assert qkv.qtype == qtype
    torch.testing.assert_close(qkv.qweight, quantize(expected_rows(model, 1, "qkv_proj"), qtype), rtol=0, atol=0)
    reference = own_reference(model, qtype)
    for prompt, logits in zip(PROMPTS, llm.llm_engine.prompt_logits(PROMPTS)):
        assert (logits.float() - hf_logits(reference, prompt)).abs().max() < 1e-3
        assert (logits.float() - hf_logits(model, prompt)).abs().max() > 0.1
    assert greedy(llm) == hf_greedy(reference, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("head", [None, "q8_0", "float"])
def test_the_lm_head_in_llama_cpps_type_or_the_one_asked(tmp_path, monkeypatch, head):
    """An untied head is quantized as it loads to llama.cpp's type for a Q4_K model's output tensor (Q6_K) or the
    type CVLLM_ISQ_LM_HEAD names, its blocks the quantizer's, logits the dequantized model's; ``float`` keeps the
    checkpoint's head; a tied head stays float."""
    model = make_model(tmp_path, tie_word_embeddings=False)
    if head is not None:
        monkeypatch.setenv(isq.LM_HEAD_ENV, head)
    llm = LLM(model=str(tmp_path), dtype="float32", isq="q4k", num_kv_blocks=64)
    ours = llm.llm_engine.runner.model
    assert ours.model.embed_tokens.quant_method is None   # the embedding stays float
    w = model.lm_head.weight
    if head == "float":
        assert ours.lm_head.quant_method is None and torch.equal(ours.lm_head.weight, w)
        reference = own_reference(model, GGMLType.Q4_K, head=w)
    else:
        want = parse_isq_type(head) if head else GGMLType.Q6_K
        assert isinstance(ours.lm_head.quant_method, isq.ISQTableMethod) and ours.lm_head.qtype == want
        dequantized = dequantize(quantize(w, want), want, tuple(w.shape))
        # (float32 on the CPU: the exact path computes from the blocks dequantized once; CUDA keeps them as planes)
        assert ours.lm_head.gguf_compute == "dense" and torch.equal(ours.lm_head.weight, dequantized)
        reference = own_reference(model, GGMLType.Q4_K, head=dequantized)
    for prompt, logits in zip(PROMPTS, llm.llm_engine.prompt_logits(PROMPTS)):
        assert (logits.float() - hf_logits(reference, prompt)).abs().max() < 1e-3
    assert greedy(llm) == hf_greedy(reference, PROMPTS, NEW_TOKENS)
    # a head tied to the embedding is that table: it stays float
    tied_dir = tmp_path / "tied"
    make_model(tied_dir, tie_word_embeddings=True)
    tied = LLM(model=str(tied_dir), dtype="float32", isq="q4k", num_kv_blocks=64).llm_engine.runner.model
    assert tied.lm_head.quant_method is None and tied.model.embed_tokens.quant_method is None


def test_a_misspelt_lm_head_type_fails_before_loading(checkpoint, monkeypatch):
    monkeypatch.setenv(isq.LM_HEAD_ENV, "q6")
    with pytest.raises(ValueError, match="unknown in-situ quantization type 'q6'"):
        LLM(model=str(checkpoint[0]), dtype="float32", isq="q4k", num_kv_blocks=64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_lm_head_quantized_where_asked_computes_from_planes(tmp_path, monkeypatch):
    """On CUDA the quantized head keeps only its low-bit planes and gives the CPU's exact greedy tokens (float
    activations: CVLLM_QUANT_INT8_ACTIVATIONS=0, the CPU path's numbers)."""
    make_model(tmp_path, tie_word_embeddings=False)
    monkeypatch.setenv(isq.LM_HEAD_ENV, "q6k")
    monkeypatch.setenv("CVLLM_QUANT_INT8_ACTIVATIONS", "0")
    cuda = LLM(model=str(tmp_path), dtype="float32", isq="q4k", num_kv_blocks=64, backend="cuda", max_num_seqs=4)
    head = cuda.llm_engine.runner.model.lm_head
    assert head.gguf_compute == "planes" and head.weight.numel() == 0 and head.qweight.numel() == 0
    cpu = LLM(model=str(tmp_path), dtype="float32", isq="q4k", num_kv_blocks=64, backend="cpu")
    assert greedy(cuda) == greedy(cpu)


def test_a_type_without_a_quantizer_fails_before_loading(checkpoint, monkeypatch):
    def legacy_only(x, qtype):
        if qtype == GGMLType.Q6_K:
            raise NotImplementedError
        return quantize(x, qtype)

    monkeypatch.setattr(isq, "quantize", legacy_only)
    isq._check_implemented.cache_clear()
    try:
        with pytest.raises(NotImplementedError, match="in-situ quantization to Q6_K is not implemented yet"):
            LLM(model=str(checkpoint[0]), dtype="float32", isq="q6k", num_kv_blocks=64)
    finally:
        isq._check_implemented.cache_clear()


def test_bfloat16_uses_the_int4pack_path(checkpoint):
    directory, model = checkpoint
    llm = LLM(model=str(directory), dtype="bfloat16", isq="q4_0", num_kv_blocks=64)
    ours = llm.llm_engine.runner.model
    computes = {m.gguf_compute for m in ours.model.modules() if hasattr(m, "gguf_compute")}
    assert computes == {"int4pack"}
    assert ours.lm_head.gguf_compute == "dense"   # its Q6_K blocks dequantized once
    reference = dequantized_reference(model, GGMLType.Q4_0)
    # bf16 activations drift from the fp32 oracle; the first greedy tokens must still agree
    assert [o[:3] for o in greedy(llm)] == [o[:3] for o in hf_greedy(reference, PROMPTS, NEW_TOKENS)]


def test_rows_without_super_blocks_fall_back_like_llama_cpp(tmp_path, caplog):
    # intermediate 320: down_proj's rows do not split into 256-element super-blocks, the others do
    model = make_model(tmp_path, intermediate_size=320)
    with caplog.at_level(logging.INFO, logger="cvllm_gguf.isq"):
        llm = LLM(model=str(tmp_path), dtype="float32", isq="q4k", num_kv_blocks=64)
    layers = llm.llm_engine.runner.model.model.layers
    for index, block in enumerate(layers):
        assert block.self_attn.qkv_proj.qtype == block.mlp.gate_up_proj.qtype == GGMLType.Q4_K
        down = block.mlp.down_proj
        assert down.qtype == GGMLType.Q5_0
        np.testing.assert_array_equal(down.qweight.numpy(),
                                      gguf_blocks(model.model.layers[index].mlp.down_proj.weight, GGMLType.Q5_0))
    fallbacks = [r.getMessage() for r in caplog.records if "instead of Q4_K" in r.getMessage()]
    assert fallbacks == [f"isq: layer 'model.layers.{i}.mlp.down_proj' has 320 inputs, not a multiple of 256: "
                         f"Q5_0 instead of Q4_K" for i in range(len(layers))]
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("quantized ")]
    assert len(summary) == 1 and summary[0].startswith("quantized 9 linear layers to Q4_K (the LM head to Q6_K), ")
    assert "(2 fell back)" in summary[0]
    reference = own_reference(model, lambda in_features: GGMLType.Q5_0 if in_features == 320 else GGMLType.Q4_K)
    assert greedy(llm) == hf_greedy(reference, PROMPTS, NEW_TOKENS)


# The load as cvserve's engine core runs it: INFO logs on a stderr that is a pipe, not a terminal.
LOAD_WITH_LOGS = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
from cvllm import LLM
LLM(model=sys.argv[1], dtype="float32", isq="q8_0", num_kv_blocks=16, backend="cpu")
"""


def test_a_logged_load_has_one_line_per_phase_and_no_bars(checkpoint):
    directory, _ = checkpoint
    with safe_open(directory / "model.safetensors", "pt") as weights:
        tensors = len(list(weights.keys()))
    # bytes, not text=True: universal newlines would turn the carriage returns looked for into newlines
    result = subprocess.run([sys.executable, "-c", LOAD_WITH_LOGS, str(directory)], capture_output=True,
                            timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr
    assert "\r" not in stderr   # a progress bar's redraws would garble a log file
    lines = stderr.split("\n")

    def phase(prefix: str) -> str:
        [line] = [line for line in lines if line.startswith(prefix)]
        return line

    # 2 layers x (qkv, o, gate_up, down) and the LM head; the weights counted: the checkpoint's tensors, q/k/v each
    assert phase("INFO cvllm.engine.model_runner: loaded ").startswith(
        f"INFO cvllm.engine.model_runner: loaded {tensors} weights (")
    assert phase("INFO cvllm_gguf.isq: quantized ").startswith(
        "INFO cvllm_gguf.isq: quantized 9 linear layers to Q8_0 (the LM head to Q8_0), ")
    assert phase("INFO cvllm.engine.model_runner: prepared ").startswith(
        "INFO cvllm.engine.model_runner: prepared 9 quantized layers in ")


@pytest.mark.parametrize(("requested", "in_features", "chosen"), [
    (GGMLType.Q4_K, 512, GGMLType.Q4_K), (GGMLType.Q4_K, 96, GGMLType.Q5_0), (GGMLType.Q5_K, 96, GGMLType.Q5_1),
    (GGMLType.Q6_K, 96, GGMLType.Q8_0), (GGMLType.Q2_K, 96, GGMLType.Q4_0), (GGMLType.Q3_K, 96, GGMLType.Q4_0),
    (GGMLType.Q8_0, 96, GGMLType.Q8_0), (GGMLType.Q8_0, 100, None), (GGMLType.Q4_K, 100, None),
])
def test_layer_type(requested, in_features, chosen):
    assert layer_type(requested, in_features) == chosen


def test_both_spellings_and_unknown_types():
    assert parse_isq_type("q4k") == parse_isq_type("q4_k") == parse_isq_type("Q4_K") == GGMLType.Q4_K
    assert parse_isq_type("q8_0") == parse_isq_type("q80") == GGMLType.Q8_0
    for bad in ("q7", "f16", "iq2_xxs"):
        with pytest.raises(ValueError, match=rf"'{bad}'.*q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k"):
            parse_isq_type(bad)


def test_unknown_type_fails_the_engine(checkpoint):
    with pytest.raises(ValueError, match="unknown in-situ quantization type 'q9'"):
        LLM(model=str(checkpoint[0]), dtype="float32", isq="q9", num_kv_blocks=64)


def test_an_already_quantized_checkpoint_is_refused():
    gguf_file = Checkpoint(path=Path("tiny.gguf"), config=None, weight_iterator=iter, quant_method="gguf")
    with pytest.raises(CheckpointError, match=r"isq q4k: tiny.gguf is already quantized \(gguf\)"):
        attach_quantization(torch.nn.Module(), gguf_file, torch.float32, isq="q4k")


def test_cvserve_isq_flag_sets_the_engine_field(checkpoint):
    directory, _ = checkpoint
    assert build_server_args(["--w", str(directory), "--isq", "q8_0"]).engine.isq == "q8_0"
    assert build_server_args(["--w", str(directory)]).engine.isq is None
