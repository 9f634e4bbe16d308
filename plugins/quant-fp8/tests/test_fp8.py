"""FP8 weight checkpoints (transformers' "fp8" with 128x128 scale blocks or one scale per tensor, llm-compressor's
compressed-tensors per channel / tensor / block): cvllm computes exactly what a float checkpoint of the dequantized
weights computes (float32, tokens and logprobs bit for bit), on one rank and over two; the plane and row forms a
CUDA layer takes equal the dense one (Triton's interpreter here); bad configs are refused by name.
``--isq fp8``: test_isq_fp8.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from fp8_checkpoints import PROMPTS, WIDE, needs_gpu, quantize_blocks, run, write_fp8
from safetensors.torch import load_file

from cvllm import LLM
from cvllm.checkpoint.base import CheckpointError
from cvllm.layers.linear import ReplicatedLinear
from cvllm.testing.checkpoints import cvllm_greedy, make_checkpoint
from cvllm_fp8.config import FP8Config
from cvllm_fp8.linear_method import FP8LinearMethod, _planes, dequantize, quantize_rows


@pytest.mark.parametrize("scheme, static", [("fp8-block", False), ("fp8-tensor", True), ("ct-channel", False),
                                            ("ct-tensor", True), ("ct-block", False)])
def test_checkpoint_computes_its_dequantized_weights(tmp_path, scheme, static):
    make_checkpoint(tmp_path / "base", "llama", **WIDE)
    write_fp8(tmp_path / "base", tmp_path / "fp8", scheme, static)
    ours, kinds = run(tmp_path / "fp8")
    assert kinds == {"FP8LinearMethod"}
    theirs, _ = run(tmp_path / "fp8-float")
    assert ours == theirs


def test_partial_scale_blocks(tmp_path):
    """The default tiny model's 64-wide projections sit inside one 128x128 block: ceil-sized scale tensors."""
    make_checkpoint(tmp_path / "base", "llama")
    write_fp8(tmp_path / "base", tmp_path / "fp8", "fp8-block")
    assert run(tmp_path / "fp8")[0] == run(tmp_path / "fp8-float")[0]


@pytest.mark.parametrize("scheme", ["fp8-block", "fp8-tensor"])
def test_two_ranks_match_one(tmp_path, scheme):
    make_checkpoint(tmp_path / "base", "llama", **WIDE)
    write_fp8(tmp_path / "base", tmp_path / "fp8", scheme)
    options = dict(dtype="float32", num_kv_blocks=32)
    one = cvllm_greedy(tmp_path / "fp8", PROMPTS, 8, **options)
    assert cvllm_greedy(tmp_path / "fp8", PROMPTS, 8, tensor_parallel_size=2, **options) == one


def test_plane_form_equals_the_dense_form():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors through Triton's interpreter; with a GPU the end-to-end gpu test covers this path")
    pytest.importorskip("cvllm_cuda")
    from cvllm.testing.requirements import import_or_skip

    import_or_skip("triton")
    config = FP8Config((128, 128), False, "weight_scale_inv", False)
    gen = torch.Generator().manual_seed(0)
    q, scale = quantize_blocks(torch.randn(40, 256, generator=gen), 128, 128)
    layers = []
    for form in ("dense", "planes"):
        layer = ReplicatedLinear(256, 40, bias=True, quant_method=FP8LinearMethod(config, "test"))
        layer.weight.weight_loader(layer.weight, q)
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scale)
        layer.bias.data.copy_(torch.linspace(-1, 1, 40))
        if form == "planes":   # what process_weights_after_loading does on a CUDA device
            layer.quant_weight = _planes(layer._parameters.pop("weight").data,
                                         layer._parameters.pop("weight_scale_inv").data, 128, "test")
            layer.weight = torch.empty(0)
            layer.fp8_compute = "planes"
        layers.append(layer)
    for rows in (1, 3, 20):
        x = torch.randn(rows, 256, generator=gen)
        want = layers[0](x)   # float32 sums in another order: relative to the outputs' size
        torch.testing.assert_close(layers[1](x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("rows", [1, 5])
def test_row_scaled_form_matches_the_dense_layer(rows):
    """Per-row scales on an FP8 GPU (the "rows" form, cvllm_cuda.kernels.fp8_linear): one row of x through the
    GEMV (W8A16: the dense layer's numbers), more through torch._scaled_mm with x rounded to e4m3 per row (W8A8:
    within e4m3's rounding). Triton's interpreter and torch's CPU _scaled_mm here."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors through Triton's interpreter; with a GPU the end-to-end gpu test covers this path")
    pytest.importorskip("cvllm_cuda")
    gen = torch.Generator().manual_seed(1)
    w, scale = quantize_rows(torch.randn(48, 256, generator=gen))
    layers = []
    for form in ("dense", "rows"):
        layer = ReplicatedLinear(256, 48, bias=True, quant_method=FP8LinearMethod(None, "test"))
        layer.weight.data.copy_(w)
        layer.weight_scale.copy_(scale)
        layer.bias.data.copy_(torch.linspace(-1, 1, 48))
        if form == "rows":   # what process_weights_after_loading does on a GPU with FP8 tensor cores
            layer.fp8_row_scale = layer._buffers.pop("weight_scale").reshape(-1)
            layer.weight = layer._parameters.pop("weight").data
            layer.fp8_compute = "rows"
        layers.append(layer)
    x = torch.randn(rows, 256, generator=gen).to(torch.bfloat16)
    want, got = layers[0](x.float()), layers[1](x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 48)
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert err < (1e-2 if rows == 1 else 6e-2), err   # bf16 output; e4m3 activations (3 mantissa bits)


def test_activation_rows_round_to_e4m3_with_a_scale_per_row():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors through Triton's interpreter")
    pytest.importorskip("cvllm_cuda")
    from cvllm_cuda.kernels.fp8_linear import quantize_rows as quantize_activations

    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(2)) * torch.tensor([[1.0], [1e-3], [0.0]])
    q, scales = quantize_activations(x)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (3, 1)
    torch.testing.assert_close(scales[:2, 0], x[:2].abs().amax(1) / 448)
    assert q[:2].float().abs().amax(1).tolist() == [448.0, 448.0] and not q[2].float().any()
    # each value within half an e4m3 step (2**-4 relative) of x / scale (the interpreter rounds carries its own way)
    assert ((q[:2].float() * scales[:2] - x[:2]).abs() <= x[:2].abs() / 8 + 1e-6 * scales[:2]).all()


def test_planes_need_whole_scale_blocks():
    pytest.importorskip("cvllm_cuda")
    weight = torch.zeros(8, 200, dtype=torch.float8_e4m3fn)
    assert _planes(weight, torch.ones(8, 2), 128, "test") is None    # 128 + a partial 72: dense
    assert _planes(weight[:, :64], torch.ones(8, 1), 128, "test").layout.scale_group == 64   # one block


@pytest.mark.parametrize("change, message", [
    ({"fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"weight_block_size": [128]}, "weight_block_size"),
    ({"activation_scheme": "weird"}, "activation_scheme"),
])
def test_bad_configs_are_refused(tmp_path, change, message):
    make_checkpoint(tmp_path / "base", "llama")
    write_fp8(tmp_path / "base", tmp_path / "fp8", "fp8-block")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"].update(change)
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        LLM(str(tmp_path / "fp8"), dtype="float32", num_kv_blocks=32)


def test_compressed_tensors_int_schemes_are_refused(tmp_path):
    make_checkpoint(tmp_path / "base", "llama")
    write_fp8(tmp_path / "base", tmp_path / "fp8", "ct-channel")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(type="int", num_bits=4)
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="only FP8 weights"):
        LLM(str(tmp_path / "fp8"), dtype="float32", num_kv_blocks=32)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_row_form_on_cuda_against_the_dense_weights(rows):
    """Compiled: the GEMV (W8A16, float32 x: the dense numbers) and torch._scaled_mm (W8A8: within e4m3's
    rounding of the activations, ~3% relative on random data)."""
    from cvllm_cuda.kernels.fp8_linear import fp8_linear, usable

    gen = torch.Generator().manual_seed(rows)
    w, scale = quantize_rows(torch.randn(512, 1024, generator=gen))
    w, scale = w.cuda(), scale.reshape(-1).cuda()
    assert usable(w)
    bias = torch.linspace(-1, 1, 512, device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, 1024, generator=gen).to("cuda", dtype)
        want = x.float() @ dequantize(w, scale[:, None]).T + bias
        got = fp8_linear(x, w, scale, bias)
        assert got.dtype == dtype and got.shape == (rows, 512)
        err = ((got.float() - want).norm() / want.norm()).item()
        assert err < ((1e-5 if dtype == torch.float32 else 5e-3) if rows == 1 else 5e-2), (dtype, err)


@pytest.mark.parametrize("scheme", ["fp8-block", "ct-channel"])
def test_moe_checkpoint_experts_dequantized_at_load(tmp_path, scheme):
    """An FP8 MoE checkpoint (Qwen3-MoE's FP8 releases): the dense projections FP8 layers, the experts held FP8 by
    the quantizer's MoE method (cvllm_fp8/moe.py) and, on CPU, dequantized after loading: the float checkpoint's
    tokens and logprobs, bit for bit in float32, on one rank and (per-channel scales) two, expert parallel."""
    make_checkpoint(tmp_path / "base", "qwen3_moe", norm_topk_prob=True)
    write_fp8(tmp_path / "base", tmp_path / "fp8", scheme)
    state = load_file(tmp_path / "fp8" / "model.safetensors")
    assert state["model.layers.0.mlp.experts.3.down_proj.weight"].dtype == torch.float8_e4m3fn
    ours, kinds = run(tmp_path / "fp8")
    assert kinds == {"FP8LinearMethod", "UnquantizedLinearMethod"}   # the router stays float, as in the releases
    assert ours == run(tmp_path / "fp8-float")[0]
    llm = LLM(str(tmp_path / "fp8"), dtype="float32", num_kv_blocks=32)
    try:
        from cvllm.layers.fused_moe import FusedMoE

        assert {type(m.quant_method).__name__ for m in llm.llm_engine.runner.model.modules()
                if isinstance(m, FusedMoE)} == {"FP8ExpertsMethod"}
    finally:
        llm.shutdown()
    if scheme == "ct-channel":   # (128-column blocks would not split over two ranks at this toy size)
        two = cvllm_greedy(tmp_path / "fp8", PROMPTS, 8, dtype="float32", num_kv_blocks=32, tensor_parallel_size=2,
                           enable_expert_parallel=True)
        assert two == [tokens for tokens, _ in ours]


@pytest.mark.parametrize("scheme", ["block", "channel"])
def test_moe_experts_as_fp8_planes_compute_the_dequantized_experts(scheme):
    """The CUDA form of FP8 experts (a byte a weight in stacked FP8 planes, the fused-MoE planes kernel; here in
    Triton's interpreter) against core's grouped float experts on the dequantized weights."""
    pytest.importorskip("cvllm_cuda")
    from cvllm.layers.fp8_experts import dequantize_fp8
    from cvllm.layers.fused_moe import FusedMoE
    from cvllm.layers.fused_moe_methods import grouped_experts
    from cvllm_cuda.kernels.fused_moe_planes import fused_moe_planes
    from cvllm_fp8.moe import FP8ExpertsMethod

    experts, hidden, inter = 3, 128, 128
    config = FP8Config((128, 128) if scheme == "block" else None, False, "weight_scale_inv", False)
    method = FP8ExpertsMethod(config, "model.layers.0.mlp.experts")
    layer = FusedMoE(experts, 2, hidden, inter, method=method)
    gen = torch.Generator().manual_seed(5)
    dense = {"w1": [], "w3": [], "w2": []}
    for e in range(experts):
        for shard, (out, inp) in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter))):
            w = torch.randn(out, inp, generator=gen) * 0.05
            q, scale = quantize_blocks(w, 128, 128) if scheme == "block" else quantize_rows(w)
            layer.weight_loader(layer.w13_weight, q, shard, e)
            method.load_expert_part(layer, "weight_scale_inv", scale, shard, e)
            dense[shard].append(dequantize_fp8(q, scale))
    gate, up, down = method.expert_planes(layer)[:3]
    w13 = torch.stack([torch.cat([g, u]) for g, u in zip(dense["w1"], dense["w3"])])
    w2 = torch.stack(dense["w2"])
    x = torch.randn(4, hidden, generator=gen)
    weights = torch.rand(4, 2, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(4)])
    ours = fused_moe_planes(x, [gate, up], down, weights, ids, layer.act_fn)
    theirs = grouped_experts(x, w13, w2, layer.act_fn, weights, ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
