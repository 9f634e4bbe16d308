"""The int8 activations that an RMSNorm, silu * up or the attention's split-KV combination makes beside its output
for the low-bit GEMV it feeds (kernels/int8_activations.py): the quantizer kernel's bits, handed to that layer's
weights and taken by its GEMV only for the memory they were made from, and the model's layers linked where their
outputs go straight on. In Triton's interpreter without a GPU, compiled with one (a tiny GGUF model's logits with
and without them: plugins/quant-gguf/tests/test_gguf_cuda.py)."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from types import SimpleNamespace

import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")  # a skip locally, an error under CI=true

from test_quant_matmul import DEVICE, LAYOUTS, random_weight  # noqa: E402

from cvllm_cuda.kernels import int8_activations, quant_gemv_int8  # noqa: E402
from cvllm_cuda.kernels.activation import gelu_and_mul, silu_and_mul  # noqa: E402
from cvllm_cuda.kernels.int8_activations import quantize_activations  # noqa: E402
from cvllm_cuda.kernels.quant_matmul import quant_matmul  # noqa: E402
from cvllm_cuda.kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_plus_one  # noqa: E402

# the interpreter computes both sides of tl.where: 1 / d of an all-zero block (masked lanes too) warns
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")


@pytest.fixture(autouse=True)
def producers_on(monkeypatch):
    monkeypatch.delenv(int8_activations.PRODUCERS_ENV, raising=False)   # on by default


INT8_LAYOUTS = {bits: name for name, bits in (("q2_k", 2), ("q4_k", 4), ("q8_0", 8))}


def int8_layer(low_bits: int, n: int, k: int, real: bool = False) -> SimpleNamespace:
    """A stand-in for a linear layer whose compute form is a low-bit plane weight on int8 activations (``real``: a
    random weight of that layout, K a multiple of 256; else only what the producers read: layout and K)."""
    layout = dataclasses.replace(LAYOUTS[INT8_LAYOUTS[low_bits]], int8_activations=True)
    assert layout.low_bits == low_bits and quant_gemv_int8.applies(layout, k)
    weight = random_weight(layout, n, k, DEVICE, seed=low_bits) if real else SimpleNamespace(layout=layout,
                                                                                            in_features=k, handed=None)
    return SimpleNamespace(quant_weight=weight)


def taken(layer, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The int8 form a producer handed to ``layer`` for x, as the layer's GEMV takes it (once)."""
    return quant_gemv_int8.taken(x, layer.quant_weight)


def assert_same_form(got: tuple[torch.Tensor, ...] | None, want: tuple[torch.Tensor, ...]) -> None:
    assert got is not None
    for g, w in zip(got, want, strict=True):   # packs, scales, word sums, block sums: the same bits
        assert g.dtype == w.dtype and torch.equal(g, w)


def randn(seed: int, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale
    return x.to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("low_bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("hidden", [576, 1024])   # 576: a row of 1024 lanes, its last 14 blocks masked
@pytest.mark.parametrize("rows", [1, 3])
def test_norm_makes_the_quantizers_bits(low_bits, dtype, hidden, rows):
    layer = int8_layer(low_bits, 8, hidden)
    x, residual = randn(1, rows, hidden, dtype=dtype), randn(2, rows, hidden, dtype=dtype, scale=4.0)
    x[0, :32], residual[0, :32] = 0, 0   # an all-zero block: scale 0
    weight = randn(3, hidden, dtype=dtype)
    out, summed = fused_add_rms_norm(x, residual, weight, 1e-5, feeds=layer)
    plain, plain_summed = fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(out, plain) and torch.equal(summed, plain_summed)   # the outputs themselves unchanged
    assert_same_form(taken(layer, out), quantize_activations(out, low_bits))
    gemma = fused_add_rms_norm_plus_one(x, None, weight, 1e-5, feeds=layer)
    assert_same_form(taken(layer, gemma), quantize_activations(gemma, low_bits))


@pytest.mark.parametrize("low_bits", [4, 8])
@pytest.mark.parametrize("shape", [(1, 2 * 1056), (3, 2 * 256)])   # 1056: a second program of 32 inputs
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_activations_make_the_quantizers_bits(low_bits, shape, activation):
    layer = int8_layer(low_bits, 8, shape[-1] // 2)
    x = randn(4, *shape, dtype=torch.float16, scale=3.0)
    act = silu_and_mul if activation == "silu" else functools.partial(gelu_and_mul, approximate="tanh")
    out = act(x, feeds=layer)
    assert torch.equal(out, act(x))
    assert_same_form(taken(layer, out), quantize_activations(out, low_bits))


@pytest.mark.parametrize("head_dim", [64, 96])   # 96: 128 lanes, the last block masked
@pytest.mark.parametrize("low_bits", [4, 8])
def test_attention_combining_its_splits_makes_the_quantizers_bits(make_attention_case, head_dim, low_bits):
    from cvllm_cuda.kernels.paged_attention import paged_attention
    case = make_attention_case(query_lens=[1, 1, 1], context_lens=[70, 0, 33], num_heads=8, num_kv_heads=2,
                               head_dim=head_dim, block_size=16, dtype=torch.float16, device=DEVICE)
    layer = int8_layer(low_bits, 8, 8 * head_dim)
    plain = paged_attention(*case.args(), None, None, num_splits=4)
    out = paged_attention(*case.args(), None, None, num_splits=4, feeds=layer)
    assert torch.equal(out, plain)
    flat = out.reshape(3, 8 * head_dim)   # as the output projection takes it
    assert_same_form(taken(layer, flat), quantize_activations(flat, low_bits))
    one_split = paged_attention(*case.args(), None, None, num_splits=1, feeds=layer)
    assert taken(layer, one_split.reshape(3, -1)) is None   # no combining kernel: the GEMV rounds it itself


def test_a_form_left_unused_never_passes_for_another_tensor():
    """A producer's output whose GEMV never ran (a forward pass cut short) is held with its form until that weight's
    next GEMV: its memory cannot go to a later tensor, which would then match by address and take the form."""
    layer = int8_layer(4, 8, 256)
    out = silu_and_mul(randn(1, 1, 2 * 256, dtype=torch.float16), feeds=layer)
    held = weakref.ref(out)
    del out
    assert held() is not None   # still allocated: no later tensor can be given its address
    later = torch.empty(1, 256, dtype=torch.float16, device=DEVICE)
    assert taken(layer, later) is None and held() is None   # the next GEMV drops the form and lets the memory go


def test_no_form_where_the_layer_does_not_take_one(monkeypatch):
    x, weight = randn(5, 2, 256, dtype=torch.float32), randn(6, 256, dtype=torch.float32)
    float_layer = SimpleNamespace(quant_weight=SimpleNamespace(layout=LAYOUTS["gptq4_g128"], in_features=256,
                                                               handed=None))
    mixed = SimpleNamespace(quant_parts=[(0, int8_layer(4, 8, 256).quant_weight),
                                         (8, int8_layer(8, 8, 256).quant_weight)])   # parts of two widths
    handed = []
    hand_over = quant_gemv_int8.hand_over
    monkeypatch.setattr(quant_gemv_int8, "hand_over", lambda out, feeds, *a: handed.append(feeds) or
                        hand_over(out, feeds, *a))
    takes = int8_layer(4, 8, 256)
    for layer in (float_layer, mixed, torch.nn.Linear(256, 8), takes):
        fused_add_rms_norm(x[:2 if layer is not float_layer else 1], None, weight, 1e-5, feeds=layer)
    assert handed == [takes]   # only the layer whose GEMV takes int8 activations, every part the same width
    many = randn(7, quant_gemv_int8.MAX_ROWS + 1, 256, dtype=torch.float32)   # a batch past the GEMV's rows
    fused_add_rms_norm(many, None, weight, 1e-5, feeds=takes)
    monkeypatch.setenv(int8_activations.PRODUCERS_ENV, "0")   # switched off (on by default)
    fused_add_rms_norm(x, None, weight, 1e-5, feeds=takes)
    assert handed == [takes]


@pytest.mark.parametrize("low_bits", [4, 8])
def test_the_gemv_takes_the_producers_form_and_gives_the_same_bits(low_bits, monkeypatch):
    """In inference mode, as the engine runs: there a reshape records no base, and the GEMV still finds the form
    (by its weight and x's address; on 2026-12-05 the engine quantized every GEMV's input again)."""
    layer = int8_layer(low_bits, 40, 512, real=True)
    quantized = []
    quantize = quant_gemv_int8.quantize_activations
    monkeypatch.setattr(quant_gemv_int8, "quantize_activations", lambda *a: quantized.append(1) or quantize(*a))
    with torch.inference_mode():
        x, weight = randn(10, 1, 3, 512, dtype=torch.float16), randn(11, 512, dtype=torch.float16)
        out = fused_add_rms_norm(x, None, weight, 1e-5, feeds=layer)   # [1, 3, 512], as [B, T, K]
        flat = out.reshape(3, 512)
        assert flat._base is None   # (what broke the tensor-attribute lookup)
        got = quant_matmul(flat, layer.quant_weight)
        assert not quantized
        assert torch.equal(got, quant_matmul(out.clone().reshape(3, 512), layer.quant_weight))   # its own kernel
        assert len(quantized) == 1
        # taken once: the same tensor again (the layer's next call with no producer before it) is quantized
        out = fused_add_rms_norm(x, None, weight, 1e-5, feeds=layer)
        flat = out.reshape(3, 512)
        assert torch.equal(quant_matmul(flat, layer.quant_weight), got) and len(quantized) == 1
        assert torch.equal(quant_matmul(flat, layer.quant_weight), got) and len(quantized) == 2


def test_a_handed_form_is_taken_only_for_its_own_memory():
    layer = int8_layer(4, 40, 512)
    weight = randn(11, 512, dtype=torch.float16)
    with torch.inference_mode():
        def made():
            return fused_add_rms_norm(randn(10, 2, 2, 512, dtype=torch.float16), None, weight, 1e-5, feeds=layer)

        for whole in (lambda out: out, lambda out: out.reshape(-1, 512), lambda out: out.view(4, 1, 512)):
            assert taken(layer, whole(made())) is not None   # all of it, in its order
        for other in (lambda out: out[:1], lambda out: out[1:],    # part of it
                      lambda out: out.reshape(-1, 512).t(),        # not in its order
                      lambda out: out.clone(),                     # the same values elsewhere
                      lambda out: out.view(torch.int16)):          # another dtype
            assert taken(layer, other(made())) is None
            assert layer.quant_weight.handed is None   # dropped by the GEMV that did not take it
        out = made()
        assert taken(layer, out) is not None and taken(layer, out) is None   # once
        out = made()
        held, _, form = layer.quant_weight.handed
        layer.quant_weight.handed = (held, 8, form)
        assert taken(layer, out) is None   # another width's packing


def test_decoder_layers_link_their_producers_to_the_linear_layers_they_feed():
    from cvllm.config import model_config_from_dict
    from cvllm.layers.activation import SiluAndMul
    from cvllm.layers.layernorm import RMSNorm
    from cvllm_llama.llama import LlamaForCausalLM

    config = model_config_from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                     "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                                     "num_hidden_layers": 2, "vocab_size": 100, "rms_norm_eps": 1e-5,
                                     "max_position_embeddings": 128})
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        assert layer.input_layernorm.feeds is layer.self_attn.qkv_proj
        assert layer.post_attention_layernorm.feeds is layer.mlp.gate_up_proj
        assert layer.mlp.act_fn.feeds is layer.mlp.down_proj
        assert layer.self_attn.attn.feeds is layer.self_attn.o_proj
    assert model.model.norm.feeds is model.lm_head and RMSNorm.feeds is None and SiluAndMul.feeds is None
    # a link, not a submodule: the parameters and their names are the model's own
    names = [name for name, _ in model.named_parameters()]
    assert len(names) == len(set(names)) and not any(".feeds." in name for name in names)
    assert not any(name.endswith("feeds") for name, _ in model.named_modules())
