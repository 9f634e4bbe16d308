"""GGUFLinearMethod inside core's linear layers: raw-row loading (fused shards, tensor-parallel
splits), the exact fp32 path, and the fast CPU path."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cvllm import distributed
from cvllm.engine.model_runner import materialize
from cvllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from cvllm_gguf.dequant import dequantize
from cvllm_gguf.linear_method import GGUFLinearMethod
from cvllm_gguf.quant_types import GGMLType

K_QUANTS = {GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K}


def width(qtype: GGMLType) -> int:
    return 512 if qtype in K_QUANTS else 96


def load(layer: nn.Module, rows: torch.Tensor, shard=None) -> None:
    loader = layer.qweight.weight_loader
    loader(layer.qweight, rows) if shard is None else loader(layer.qweight, rows, shard)


@pytest.mark.parametrize("qtype", list(GGMLType), ids=lambda t: t.name)
def test_exact_mode_is_fp32_linear_on_the_reference_weight(qtype, make_rows, one_torch_thread):
    k = width(qtype)
    layer = ReplicatedLinear(k, 48, bias=True, quant_method=GGUFLinearMethod(qtype, mode="exact"))
    rows = make_rows(qtype, 48, k, seed=1)
    load(layer, rows)
    layer.bias.data.copy_(torch.randn(48))
    layer.quant_method.process_weights_after_loading(layer)
    assert torch.equal(layer.qweight, rows)  # the blocks are kept as the file stores them
    x = torch.randn(3, 5, k)
    expected = F.linear(x, dequantize(rows, qtype, (48, k)), layer.bias)
    assert torch.equal(layer(x), expected)


@pytest.mark.parametrize("qtype", list(GGMLType), ids=lambda t: t.name)
def test_fast_mode_agrees_with_exact_within_bf16_tolerance(qtype, make_rows, one_torch_thread):
    k = width(qtype)
    rows = make_rows(qtype, 64, k, seed=2)
    layers = {}
    for mode in ("fast", "exact"):
        layers[mode] = ReplicatedLinear(k, 64, quant_method=GGUFLinearMethod(qtype, mode=mode))
        load(layers[mode], rows)
        layers[mode].quant_method.process_weights_after_loading(layers[mode])
    expected_form = "int4pack" if qtype in (GGMLType.Q4_0, GGMLType.Q4_1) else "bf16"
    assert layers["fast"].gguf_compute == expected_form
    x = torch.randn(7, k)
    fast, exact = layers["fast"](x), layers["exact"](x)
    assert fast.dtype == torch.float32  # returned in the activations' dtype
    torch.testing.assert_close(fast, exact, rtol=2e-2, atol=2e-2 * exact.abs().mean().item())
    assert not torch.equal(fast, exact)  # really computed in bf16


def test_bf16_activations_come_back_in_bf16(make_rows):
    layer = ReplicatedLinear(64, 32, quant_method=GGUFLinearMethod("Q4_1"))
    load(layer, make_rows(GGMLType.Q4_1, 32, 64))
    out = layer(torch.randn(2, 64, dtype=torch.bfloat16))  # prepared lazily on first use
    assert out.dtype == torch.bfloat16 and layer.gguf_compute == "int4pack"


def test_q4_with_rows_the_int4_op_cannot_pack_fall_back_to_bf16(make_rows):
    layer = ReplicatedLinear(64, 40, quant_method=GGUFLinearMethod("Q4_0"))
    rows = make_rows(GGMLType.Q4_0, 40, 64)
    load(layer, rows)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.gguf_compute == "bf16"
    assert torch.equal(layer.weight, dequantize(rows, "Q4_0", (40, 64)).bfloat16())


@pytest.mark.parametrize("qtype", [GGMLType.Q4_1, GGMLType.Q6_K], ids=lambda t: t.name)
def test_merged_gate_up_shards_load_as_byte_rows(qtype, make_rows):
    k = width(qtype)
    layer = MergedColumnParallelLinear(k, [32, 48], quant_method=GGUFLinearMethod(qtype, mode="exact"))
    gate, up = make_rows(qtype, 32, k, seed=3), make_rows(qtype, 48, k, seed=4)
    load(layer, up, 1)  # shards arrive in any order
    load(layer, gate, 0)
    assert torch.equal(layer.qweight, torch.cat([gate, up]))
    x = torch.randn(2, k)
    expected = F.linear(x, torch.cat([dequantize(gate, qtype, (32, k)), dequantize(up, qtype, (48, k))]))
    assert torch.equal(layer(x), expected)


def test_qkv_shards_load_as_byte_rows(make_rows):
    head_dim, heads, kv_heads, hidden = 16, 4, 2, 64
    layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, quant_method=GGUFLinearMethod("Q8_0", "exact"))
    q, k, v = (make_rows(GGMLType.Q8_0, n * head_dim, hidden, seed=s)
               for s, n in enumerate([heads, kv_heads, kv_heads]))
    for shard, rows in (("v", v), ("q", q), ("k", k)):
        load(layer, rows, shard)
    assert torch.equal(layer.qweight, torch.cat([q, k, v]))


def test_tensor_parallel_rank_takes_its_rows_and_its_input_blocks(monkeypatch, make_rows):
    monkeypatch.setattr(distributed, "_tp_size", 2)
    monkeypatch.setattr(distributed, "_tp_rank", 1)
    full = make_rows(GGMLType.Q4_K, 64, 512, seed=5)  # 2 blocks of 144 bytes per row
    column = MergedColumnParallelLinear(512, [32, 32], quant_method=GGUFLinearMethod("Q4_K", "exact"))
    load(column, full[:32], 0)
    load(column, full[32:], 1)
    assert torch.equal(column.qweight, torch.cat([full[16:32], full[48:64]]))
    row = RowParallelLinear(512, 64, quant_method=GGUFLinearMethod("Q4_K", "exact"))
    assert row.qweight.shape == (64, 144)  # 256 of the 512 input features: one block per row
    load(row, full)
    assert torch.equal(row.qweight, full[:, 144:])
    x = torch.randn(3, 256)
    expected = F.linear(x, dequantize(full, "Q4_K", (64, 512))[:, 256:])
    assert torch.equal(row.quant_method.apply(row, x, None), expected)


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = MergedColumnParallelLinear(64, [32, 32], quant_method=GGUFLinearMethod("Q5_0", "exact"))
        self.down = RowParallelLinear(64, 64, bias=True, quant_method=GGUFLinearMethod("F16", "exact"))


def test_loaders_survive_a_meta_build_and_materialize(make_rows):
    with torch.device("meta"):
        model = TwoLayers()
    materialize(model, torch.device("cpu"))
    assert {name for name, _ in model.named_parameters()} == {"up.qweight", "down.qweight", "down.bias"}
    gate, up = make_rows(GGMLType.Q5_0, 32, 64, seed=6), make_rows(GGMLType.Q5_0, 32, 64, seed=7)
    load(model.up, gate, 0)
    load(model.up, up, 1)
    down = torch.randn(64, 64).half()
    load(model.down, down)  # F16 rows may come as a float16 tensor
    model.down.bias.weight_loader(model.down.bias, torch.ones(64))
    x = torch.randn(2, 64)
    hidden = F.linear(x, dequantize(torch.cat([gate, up]), "Q5_0", (64, 64)))
    assert torch.equal(model.down(model.up(x)), F.linear(hidden, down.float(), torch.ones(64)))


def test_reloading_bytes_prepares_the_compute_form_again(make_rows):
    layer = ReplicatedLinear(64, 32, quant_method=GGUFLinearMethod("Q8_0", "exact"))
    first, second = make_rows(GGMLType.Q8_0, 32, 64, seed=8), make_rows(GGMLType.Q8_0, 32, 64, seed=9)
    load(layer, first)
    x = torch.randn(1, 64)
    layer(x)
    load(layer, second)
    assert torch.equal(layer(x), F.linear(x, dequantize(second, "Q8_0", (32, 64))))


def test_rows_of_another_type_or_length_are_a_clear_error(make_rows):
    layer = ReplicatedLinear(64, 32, quant_method=GGUFLinearMethod("Q4_1"))
    with pytest.raises(ValueError, match=r"Q4_1 rows of 64 elements are 40 bytes.*\(32, 36\).*36 bytes per row"):
        load(layer, make_rows(GGMLType.Q4_0, 32, 64))
    with pytest.raises(ValueError, match="expected raw Q4_1 bytes"):
        load(layer, torch.randn(32, 64))
    with pytest.raises(ValueError, match="shape"):
        load(layer, make_rows(GGMLType.Q4_1, 16, 64))


def test_rows_must_split_into_blocks_and_modes_are_checked():
    with pytest.raises(ValueError, match="rows of 576 elements do not split into Q4_K blocks of 256"):
        ReplicatedLinear(576, 32, quant_method=GGUFLinearMethod("Q4_K"))
    with pytest.raises(ValueError, match="'fast' or 'exact'"):
        GGUFLinearMethod("Q4_0", mode="turbo")
