"""llama.cpp's ``deepseek2`` GGUF files against transformers on the same tiny weights: V2 (softmax routing,
group-limited) and V3 (sigmoid routing with its correction bias), attention written both ways llama.cpp's
converter has written it (``attn_kv_b`` whole, or split per head into ``attn_k_b`` / ``attn_v_b`` with the
``*_length_mla`` keys). The file is written here as the converter writes it (names and layouts spelled out, not
taken from gguf's TensorNameMap); float32, so cvllm's logits must match transformers' to fp32 rounding."""

from __future__ import annotations

import os

import gguf
import pytest
import torch

from cvllm import LLM
from cvllm.testing import hf_logits
from cvllm.testing.checkpoints import TOKENIZER_VOCAB_SIZE, randomize_norms_and_biases, tiny_config
from cvllm_gguf.testing import add_common_hyperparameters, write_file

LAYER_TENSORS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
GLOBAL_TENSORS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"}


def tiny_model(arch: str):
    import transformers

    config = tiny_config(arch)
    torch.manual_seed(0)
    model = getattr(transformers, type(config).__name__.replace("Config", "ForCausalLM"))(config).float().eval()
    randomize_norms_and_biases(model, seed=0)
    return model


def converter_tensors(model, split_kv_b: bool) -> dict[str, torch.Tensor]:
    """GGUF name -> tensor, as convert_hf_to_gguf's DeepseekV2Model writes them."""
    c = model.config
    out = {}
    for name, value in model.state_dict().items():
        if name in GLOBAL_TENSORS:
            out[GLOBAL_TENSORS[name]] = value
            continue
        _, _, block, rest = name.split(".", 3)
        prefix = f"blk.{block}."
        if rest == "mlp.experts.gate_up_proj":   # transformers 5's fused experts: stacked gate and up
            gate, up = value.chunk(2, dim=1)
            out[prefix + "ffn_gate_exps.weight"], out[prefix + "ffn_up_exps.weight"] = gate, up
        elif rest == "mlp.experts.down_proj":
            out[prefix + "ffn_down_exps.weight"] = value
        elif rest == "mlp.gate.e_score_correction_bias":
            out[prefix + "exp_probs_b.bias"] = value
        elif rest == "self_attn.kv_b_proj.weight" and split_kv_b:
            kv_b = value.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
            k_b, v_b = kv_b.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
            out[prefix + "attn_k_b.weight"] = k_b.transpose(1, 2).contiguous()
            out[prefix + "attn_v_b.weight"] = v_b.contiguous()
        else:
            module, _, suffix = rest.rpartition(".")
            out[f"{prefix}{LAYER_TENSORS[module]}.{suffix}"] = value
    return out


def write_gguf(path, model, split_kv_b: bool, q8_0: bool = False) -> None:
    c = model.config
    writer = gguf.GGUFWriter(path, "deepseek2")
    add_common_hyperparameters(writer, c)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(c.qk_rope_head_dim)
    writer.add_vocab_size(c.vocab_size)
    if c.q_lora_rank is not None:
        writer.add_q_lora_rank(c.q_lora_rank)
    writer.add_kv_lora_rank(c.kv_lora_rank)
    if split_kv_b:   # llama.cpp's MLA files: the cached widths, and the heads' own in *_mla
        writer.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
        writer.add_value_length(c.kv_lora_rank)
        writer.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
        writer.add_value_length_mla(c.v_head_dim)
    else:
        writer.add_key_length(c.qk_nope_head_dim + c.qk_rope_head_dim)
        writer.add_value_length(c.v_head_dim)
    writer.add_leading_dense_block_count(c.first_k_dense_replace)
    writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    writer.add_expert_count(c.n_routed_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_shared_count(c.n_shared_experts)
    writer.add_expert_weights_scale(c.routed_scaling_factor)
    v3 = c.model_type == "deepseek_v3"
    if v3:
        writer.add_expert_weights_norm(c.norm_topk_prob)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    writer.add_expert_group_count(c.n_group)
    writer.add_expert_group_used_count(c.topk_group)
    for name, value in converter_tensors(model, split_kv_b).items():
        array = value.detach().float().numpy()
        # q8_0: the 2-D linears whose rows are whole 32-blocks (the converter's choice: norms and router stay F32)
        if q8_0 and array.ndim == 2 and array.shape[1] % 32 == 0 and "norm" not in name and "gate_inp" not in name \
                and name not in ("token_embd.weight", "output.weight"):
            writer.add_tensor(name, gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array)
    write_file(writer)


@pytest.mark.parametrize("arch, split_kv_b", [("deepseek_v2", False), ("deepseek_v2", True), ("deepseek_v3", True),
                                              ("deepseek_v3", False)])
def test_gguf_logits_match_transformers(tmp_path, arch, split_kv_b):
    model = tiny_model(arch)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model, split_kv_b)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32)
    expected = "DeepseekV3ForCausalLM" if arch == "deepseek_v3" else "DeepseekV2ForCausalLM"
    assert type(llm.llm_engine.runner.model).__name__ == expected
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, TOKENIZER_VOCAB_SIZE, (n,), generator=generator).tolist() for n in (9, 30)]
    for got, prompt in zip(llm.llm_engine.prompt_logits(prompts), prompts):
        want = hf_logits(model, prompt)
        diff = (got.float().cpu() - want).abs().max().item()
        assert diff < 2e-5 * want.abs().max().item(), f"max |diff| {diff:.2e} of {want.abs().max():.1f}"


def test_a_q8_0_file_computes_from_its_blocks(tmp_path):
    """Q8_0 projections (kv_b_proj among them: the absorption reads it back through its compute form), experts
    dequantized at load: the logits of transformers on the Q8_0-rounded weights."""
    model = tiny_model("deepseek_v3")
    path = tmp_path / "q8.gguf"
    write_gguf(path, model, split_kv_b=False, q8_0=True)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32)
    attn = llm.llm_engine.runner.model.model.layers[1].self_attn
    assert attn.kv_b_proj.quant_method is not None and attn.o_proj.quant_method is not None
    q8 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():   # the same rounding in transformers' copy: the converter quantized exactly these
        for name, param in model.named_parameters():
            if param.dim() == 2 and param.shape[1] % 32 == 0 and "norm" not in name and not name.endswith(
                    "mlp.gate.weight") and name not in ("model.embed_tokens.weight", "lm_head.weight"):
                rounded = gguf.quants.dequantize(gguf.quants.quantize(param.numpy(), q8), q8)
                param.copy_(torch.from_numpy(rounded).view(param.shape))
    prompt = list(range(3, 40))
    got, want = llm.llm_engine.prompt_logits([prompt])[0].float().cpu(), hf_logits(model, prompt)
    diff = (got - want).abs().max().item()
    assert diff < 2e-5 * want.abs().max().item(), f"max |diff| {diff:.2e} of {want.abs().max():.1f}"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors through Triton's interpreter")
def test_kv_b_proj_in_low_bit_planes_is_absorbed_through_its_forward(tmp_path, monkeypatch):
    """As on CUDA: every Q8_0 projection in low-bit planes (no float weight kept), kv_b_proj included, so the
    absorption reads W back through the layer's own forward (MLA's after_weights_loaded): the same logits."""
    pytest.importorskip("cvllm_cuda")
    from cvllm_gguf import linear_method

    model = tiny_model("deepseek_v3")
    path = tmp_path / "q8.gguf"
    write_gguf(path, model, split_kv_b=False, q8_0=True)
    prompt = list(range(3, 40))
    want = LLM(str(path), dtype="float32", num_kv_blocks=32).llm_engine.prompt_logits([prompt])[0].float().cpu()
    monkeypatch.setattr(linear_method, "plane_kernels_usable", lambda device: True)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32)
    attn = llm.llm_engine.runner.model.model.layers[1].self_attn
    assert attn.kv_b_proj.gguf_compute == "planes" and attn.kv_b_proj.weight.numel() == 0
    got = llm.llm_engine.prompt_logits([prompt])[0].float().cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
