"""Core layers (norm, activations, parallel linears, embeddings) and loading weights into them."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from cvllm.checkpoint.base import CheckpointError
from cvllm.engine.model_runner import materialize
from cvllm.layers import (
    GeluAndMul,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
)
from cvllm.weight_loading import load_weights_by_name

HIDDEN, HEAD_DIM, HEADS, KV_HEADS, INTER, VOCAB = 32, 8, 4, 2, 48, 64
PACKED = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# -- RMSNorm and activations ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_llama_rmsnorm(dtype):
    ours, theirs = RMSNorm(HIDDEN, eps=1e-5).to(dtype), LlamaRMSNorm(HIDDEN, eps=1e-5).to(dtype)
    weight = randn(HIDDEN, seed=1, dtype=dtype)
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    x = randn(7, HIDDEN, seed=2, dtype=dtype) * 3
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
    assert ours(x).dtype == dtype


def test_rmsnorm_with_residual_adds_then_normalises():
    ours, theirs = RMSNorm(HIDDEN, eps=1e-6), LlamaRMSNorm(HIDDEN, eps=1e-6)
    weight = randn(HIDDEN, seed=3)
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    x, residual = randn(5, HIDDEN, seed=4), randn(5, HIDDEN, seed=5)
    normed, new_residual = ours(x, residual)
    torch.testing.assert_close(new_residual, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(normed, theirs(x + residual), rtol=1e-6, atol=1e-6)
    assert (normed - theirs(x)).abs().max() > 1e-2  # the residual mattered


def test_silu_and_mul():
    x = randn(6, 2 * INTER, seed=6)
    gate, up = x[:, :INTER], x[:, INTER:]
    expected = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(SiluAndMul()(x), expected, rtol=1e-6, atol=1e-6)


def test_gelu_and_mul_tanh():
    x = randn(6, 2 * INTER, seed=7)
    gate, up = x[:, :INTER], x[:, INTER:]
    expected = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3))) * up
    torch.testing.assert_close(GeluAndMul("tanh")(x), expected, rtol=1e-5, atol=1e-6)


# -- fused linears --------------------------------------------------------------------------------

def test_qkv_loader_puts_each_shard_in_place():
    layer = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=True)
    shards = {
        "q": (randn(HEADS * HEAD_DIM, HIDDEN, seed=10), randn(HEADS * HEAD_DIM, seed=11)),
        "k": (randn(KV_HEADS * HEAD_DIM, HIDDEN, seed=12), randn(KV_HEADS * HEAD_DIM, seed=13)),
        "v": (randn(KV_HEADS * HEAD_DIM, HIDDEN, seed=14), randn(KV_HEADS * HEAD_DIM, seed=15)),
    }
    for shard_id in ("v", "q", "k"):  # order must not matter
        weight, bias = shards[shard_id]
        layer.weight.weight_loader(layer.weight, weight, shard_id)
        layer.bias.weight_loader(layer.bias, bias, shard_id)
    x = randn(9, HIDDEN, seed=16)
    q, k, v = layer(x).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    for got, shard_id in ((q, "q"), (k, "k"), (v, "v")):
        torch.testing.assert_close(got, F.linear(x, *shards[shard_id]), rtol=1e-5, atol=1e-5)


def test_qkv_loader_rejects_a_wrong_shard_shape():
    layer = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS)
    with pytest.raises(ValueError, match=r"k_proj: checkpoint shape \(32, 32\) != model shape \(16, 32\)"):
        layer.weight_loader(layer.weight, torch.zeros(HEADS * HEAD_DIM, HIDDEN), "k")


def test_merged_column_loader_puts_each_shard_in_place():
    sizes = [24, 40]  # unequal, so a wrong offset shows
    layer = MergedColumnParallelLinear(HIDDEN, sizes, bias=True)
    parts = [(randn(n, HIDDEN, seed=20 + i), randn(n, seed=30 + i)) for i, n in enumerate(sizes)]
    for shard_id in (1, 0):
        layer.weight.weight_loader(layer.weight, parts[shard_id][0], shard_id)
        layer.bias.weight_loader(layer.bias, parts[shard_id][1], shard_id)
    x = randn(4, HIDDEN, seed=17)
    first, second = layer(x).split(sizes, dim=-1)
    torch.testing.assert_close(first, F.linear(x, *parts[0]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second, F.linear(x, *parts[1]), rtol=1e-5, atol=1e-5)


def test_row_parallel_linear_with_bias():
    layer = RowParallelLinear(INTER, HIDDEN, bias=True)
    weight, bias = randn(HIDDEN, INTER, seed=40), randn(HIDDEN, seed=41)
    layer.weight.weight_loader(layer.weight, weight)
    layer.bias.weight_loader(layer.bias, bias)
    x = randn(3, INTER, seed=42)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="bias: checkpoint shape"):
        layer.bias.weight_loader(layer.bias, torch.zeros(HIDDEN + 1))


# -- embeddings -----------------------------------------------------------------------------------

def test_embedding_and_tied_lm_head():
    embed, head = VocabParallelEmbedding(VOCAB, HIDDEN), ParallelLMHead(VOCAB, HIDDEN)
    head.tie_to(embed)
    table = randn(VOCAB, HIDDEN, seed=50)
    embed.weight.weight_loader(embed.weight, table)
    assert head.weight is embed.weight
    ids = torch.tensor([0, 5, 63, 5])
    torch.testing.assert_close(embed(ids), table[ids], rtol=0, atol=0)
    hidden = randn(4, HIDDEN, seed=51)
    torch.testing.assert_close(head(hidden), hidden @ table.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"embedding: checkpoint shape \(65, 32\)"):
        embed.weight.weight_loader(embed.weight, torch.zeros(VOCAB + 1, HIDDEN))


def test_lm_head_with_bias():
    head = ParallelLMHead(VOCAB, HIDDEN, bias=True)
    weight, bias = randn(VOCAB, HIDDEN, seed=52), randn(VOCAB, seed=53)
    head.weight.weight_loader(head.weight, weight)
    head.bias.weight_loader(head.bias, bias)
    hidden = randn(2, HIDDEN, seed=54)
    torch.testing.assert_close(head.compute_logits(hidden), F.linear(hidden, weight, bias), rtol=1e-5, atol=1e-5)


# -- a tiny model: materialize and load_weights_by_name -------------------------------------------

class TinyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS)
        self.self_attn.o_proj = RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, bias=True)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = MergedColumnParallelLinear(HIDDEN, [INTER, INTER])
        self.input_layernorm = RMSNorm(HIDDEN)


class TinyModel(nn.Module):
    def __init__(self, tie: bool = True):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(VOCAB, HIDDEN)
        self.model.layers = nn.ModuleList([TinyBlock()])
        self.lm_head = ParallelLMHead(VOCAB, HIDDEN)
        if tie:
            self.lm_head.tie_to(self.model.embed_tokens)


def hf_weights(seed: int = 100) -> dict[str, torch.Tensor]:
    prefix = "model.layers.0."
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        prefix + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
        prefix + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        prefix + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        prefix + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        prefix + "self_attn.o_proj.bias": (HIDDEN,),
        prefix + "mlp.gate_proj.weight": (INTER, HIDDEN),
        prefix + "mlp.up_proj.weight": (INTER, HIDDEN),
        prefix + "input_layernorm.weight": (HIDDEN,),
        prefix + "self_attn.rotary_emb.inv_freq": (HEAD_DIM // 2,),  # old checkpoints carry it; skipped
    }
    return {name: randn(*shape, seed=seed + i) for i, (name, shape) in enumerate(shapes.items())}


def meta_built(tie: bool = True) -> TinyModel:
    with torch.device("meta"):
        model = TinyModel(tie)
    materialize(model, torch.device("cpu"))
    return model


def test_materialize_keeps_ties_and_weight_loaders():
    model = meta_built()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.device.type == "cpu"
    params = dict(model.named_parameters())
    assert "lm_head.weight" not in params  # one tensor, listed once
    qkv = model.model.layers[0].self_attn.qkv_proj
    # the loader survives and is still bound to its own layer (QKV's sharded loader, not the base one)
    assert qkv.weight.weight_loader.__self__ is qkv
    assert qkv.weight.weight_loader.__func__ is QKVParallelLinear.weight_loader
    o_proj = model.model.layers[0].self_attn.o_proj
    assert o_proj.bias.weight_loader.__func__ is RowParallelLinear.weight_loader
    assert model.model.embed_tokens.weight.weight_loader.__self__ is model.model.embed_tokens
    assert not hasattr(model.model.layers[0].input_layernorm.weight, "weight_loader")


def test_load_weights_by_name_into_a_materialized_model():
    model = meta_built()
    weights = hf_weights()
    loaded = load_weights_by_name(model, weights.items(), PACKED)
    assert loaded == set(dict(model.named_parameters()))
    layer = model.model.layers[0]
    x = randn(3, HIDDEN, seed=7)
    p = "model.layers.0."
    q, k, v = layer.self_attn.qkv_proj(x).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
    for got, name in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")):
        torch.testing.assert_close(got, x @ weights[f"{p}self_attn.{name}.weight"].T, rtol=1e-5, atol=1e-5)
    gate, up = layer.mlp.gate_up_proj(x).split([INTER, INTER], -1)
    torch.testing.assert_close(gate, x @ weights[f"{p}mlp.gate_proj.weight"].T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(up, x @ weights[f"{p}mlp.up_proj.weight"].T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.lm_head.compute_logits(x), x @ weights["model.embed_tokens.weight"].T,
                               rtol=1e-5, atol=1e-5)


def test_shape_mismatch_names_the_checkpoint_tensor_and_the_parameter():
    model = meta_built()
    weights = hf_weights()
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(HEADS * HEAD_DIM, HIDDEN)
    with pytest.raises(CheckpointError) as info:
        load_weights_by_name(model, weights.items(), PACKED)
    message = str(info.value)
    assert "'model.layers.0.self_attn.k_proj.weight'" in message
    assert "'model.layers.0.self_attn.qkv_proj.weight'" in message
    assert "(32, 32)" in message and "(16, 32)" in message


def test_shape_mismatch_on_a_plain_parameter():
    model = meta_built()
    weights = hf_weights()
    weights["model.layers.0.input_layernorm.weight"] = torch.ones(HIDDEN * 2)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.input_layernorm\.weight'.*\(64,\) != model shape "
                                              r"\(32,\)"):
        load_weights_by_name(model, weights.items(), PACKED)


@pytest.mark.parametrize("dropped, fused", [
    ("model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.qkv_proj.weight"),
    ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"),
])
def test_fused_parameter_missing_a_shard_is_not_loaded(dropped, fused):
    model = meta_built()
    weights = hf_weights()
    del weights[dropped]
    loaded = load_weights_by_name(model, weights.items(), PACKED)
    assert fused not in loaded
    assert loaded == set(dict(model.named_parameters())) - {fused}


def test_unknown_checkpoint_tensor_is_ignored_with_a_warning(caplog):
    model = meta_built()
    weights = {**hf_weights(), "model.layers.0.extra.weight": torch.zeros(3)}
    with caplog.at_level(logging.WARNING, logger="cvllm.weight_loading"):
        loaded = load_weights_by_name(model, weights.items(), PACKED)
    assert loaded == set(dict(model.named_parameters()))
    assert "model.layers.0.extra.weight" in caplog.text

