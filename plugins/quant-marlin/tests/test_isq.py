"""``--isq gptq``: an unquantized checkpoint quantized by round-to-nearest while it loads computes exactly what a
float checkpoint of the round-to-nearest weights computes (float32, bit for bit), on one rank and over two; the
blocks the loader keeps round-trip; a layer on CUDA takes the plane form (checked here through the Triton
interpreter)."""

from __future__ import annotations

import os

import pytest
import torch
from marlin_reference import write_float
from safetensors.torch import load_file

from cvllm.layers.linear import ReplicatedLinear
from cvllm.testing.checkpoints import cvllm_greedy, greedy_logprobs, make_checkpoint
from cvllm_marlin.isq import GROUP_SIZES, RTNLinearMethod, _planes, decode_blocks, encode_blocks
from cvllm_marlin.rtn import quantize_rtn

PROMPTS = [[1, 5, 9, 23, 7, 11, 3, 4, 99, 100, 17, 2, 8], [4, 8, 15, 16, 23, 42]]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rtn_checkpoint(tmp_path, **overrides):
    """(the float checkpoint, a float checkpoint of its round-to-nearest weights)."""
    base = tmp_path / "base"
    make_checkpoint(base, "llama", **overrides)
    state = load_file(base / "model.safetensors")
    for name, tensor in state.items():
        if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
            group = next(g for g in GROUP_SIZES if tensor.shape[1] % g == 0)
            state[name] = quantize_rtn(tensor, 4, group, sym=True).dequantized()
    write_float(base, tmp_path / "rtn", state)
    return base, tmp_path / "rtn"


def run(path, **options):
    return greedy_logprobs(path, PROMPTS, 8, dtype="float32", num_kv_blocks=32, **options)


@pytest.mark.parametrize("name", ["gptq", "marlin"])
def test_isq_gptq_computes_the_round_to_nearest_model(tmp_path, name):
    base, rtn = rtn_checkpoint(tmp_path)
    ours, kinds = run(base, isq=name)
    assert kinds == {"RTNLinearMethod"}
    theirs, _ = run(rtn)
    assert ours == theirs


def test_two_ranks_match_one(tmp_path):
    # each rank's inputs of o_proj and down_proj whole groups of 128, as in real models: the same quantization
    base, _ = rtn_checkpoint(tmp_path, hidden_size=256, intermediate_size=512)
    one = cvllm_greedy(base, PROMPTS, 8, dtype="float32", num_kv_blocks=32, isq="gptq")
    assert cvllm_greedy(base, PROMPTS, 8, dtype="float32", num_kv_blocks=32, isq="gptq", tensor_parallel_size=2) == one


def test_blocks_round_trip():
    weight = torch.randn(6, 256, generator=torch.Generator().manual_seed(1))
    codes, scales, zeros = decode_blocks(encode_blocks(weight, 128), 128)
    rtn = quantize_rtn(weight, 4, 128)
    assert torch.equal(codes, rtn.q) and torch.equal(scales, rtn.scales) and torch.equal(zeros, rtn.zeros)


def test_plane_form_equals_the_dense_form():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors through Triton's interpreter; with a GPU the end-to-end gpu test covers this path")
    pytest.importorskip("cvllm_cuda")
    from cvllm.testing.requirements import import_or_skip

    import_or_skip("triton")
    weight = torch.randn(24, 256, generator=torch.Generator().manual_seed(2)) * 0.1
    layers = []
    for form in ("dense", "planes"):
        layer = ReplicatedLinear(256, 24, bias=True, quant_method=RTNLinearMethod("test"))
        layer.weight.weight_loader(layer.weight, weight)
        layer.bias.data.copy_(torch.linspace(-1, 1, 24))
        if form == "planes":   # what process_weights_after_loading does on a CUDA device
            blocks = layer._parameters.pop("weight")
            layer.quant_weight = _planes(*decode_blocks(blocks.data, 128), 128)
            layer.weight = torch.empty(0)
            layer.rtn_compute = "planes"
        layers.append(layer)
    for rows in (1, 3, 20):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        want = layers[0](x)   # float32 sums in another order: relative to the outputs' size
        torch.testing.assert_close(layers[1](x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
