"""The kernels of the Gemma / Phi / StableLM layers against cvllm's torch layers, and the layers' dispatch to them:
Gemma's (1 + weight) RMSNorm, LayerNorm with a bias and a residual add, StableLM's per-head LayerNorm, and GELU
(tanh and exact) times up. In Triton's CPU interpreter without a GPU (conftest.py sets TRITON_INTERPRET=1); fp32 and
fp16 (the interpreter truncates fp32 to bf16 where the GPU rounds: bf16 is the GPU tests' part,
test_family_kernels_gpu.py). Bounds are in units in the last place (ulp) of the dtype.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from cvllm.testing.numerics import ulp_distance
from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")  # a skip locally, an error under CI=true

from cvllm.backends.cpu import CpuBackend  # noqa: E402
from cvllm.forward_context import ForwardContext, forward_context  # noqa: E402
from cvllm.layers import GeluAndMul, LayerNorm, RMSNorm  # noqa: E402
from cvllm.layers.layernorm import GemmaRMSNorm, layer_norm_per_head  # noqa: E402
from cvllm_cuda.kernels.activation import gelu_and_mul  # noqa: E402
from cvllm_cuda.kernels.layer_norm import fused_add_layer_norm  # noqa: E402
from cvllm_cuda.kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_plus_one  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
DTYPES = [torch.float32, torch.float16]
FUSED = {"fused_add_rms_norm_plus_one": fused_add_rms_norm_plus_one, "fused_add_layer_norm": fused_add_layer_norm,
         "gelu_and_mul": gelu_and_mul}
MAX_ULP = {torch.float32: 8, torch.float16: 2}
MAX_MISMATCH_FRACTION = {torch.float32: 0.5, torch.float16: 2e-3}


def assert_close(out: torch.Tensor, ref: torch.Tensor, max_ulp: int | None = None) -> None:
    """fp16: within ``MAX_ULP`` and rarely apart. fp32: within 1e-5 relative (torch's CPU layer norm computes
    ``x * rstd - mean * rstd`` and takes an approximate rsqrt: a 1-ulp rstd then counts several ulp)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, ref.dtype, out.shape, ref.shape)
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        return
    ulps = ulp_distance(out, ref)
    mismatches = (ulps > 0).float().mean().item()
    limit = MAX_ULP[out.dtype] if max_ulp is None else max_ulp
    assert ulps.max().item() <= limit, f"{ulps.max().item()} ulp apart (<= {limit}); {mismatches:.2%} differ"
    assert mismatches <= MAX_MISMATCH_FRACTION[out.dtype], f"{mismatches:.3%} of elements differ"


def assert_gelu_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """GELU's negative tail is ``x * (1 + tanh(u)) / 2`` (or erf) with 1 + tanh(u) cancelling: there the last bit of
    tanh/erf (torch's CPU ones are 1-ulp approximations) moves the result by ~1e-7 * |x * up| whatever the dtype.
    So: close within an absolute 1e-5 (inputs of scale 3) or 2 units of the dtype's rounding, and in fp16 the same
    value for all but a few elements (the tails)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, ref.dtype, out.shape, ref.shape)
    rtol = {torch.float32: 1e-6, torch.float16: 2e-3}[out.dtype]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=1e-5)
    if out.dtype == torch.float16:
        assert (out != ref).float().mean().item() <= 0.05


def randn(generator: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0,
          shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(shape, generator=generator) * scale + shift).to(device=DEVICE, dtype=dtype)


def strided_pair(generator, rows: int, hidden: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x and residual as column slices of wider tensors: row strides that are not the hidden size."""
    x = randn(generator, rows, hidden + 7, dtype=dtype, scale=3.0, shift=0.5)[:, 3:hidden + 3]
    return x, randn(generator, rows, hidden + 1, dtype=dtype)[:, :hidden]


# ---- Gemma's (1 + weight) RMSNorm ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [640, 100, 2304])
def test_rms_norm_plus_one_with_residual(generator, dtype, hidden):
    norm = GemmaRMSNorm(hidden, eps=1e-6)
    norm.weight.data = randn(generator, hidden, dtype=dtype, scale=0.5)   # offsets from 1, as checkpoints hold
    x, residual = strided_pair(generator, 5, hidden, dtype)
    before = (x.clone(), residual.clone())
    out, new_residual = fused_add_rms_norm_plus_one(x, residual, norm.weight, norm.eps)
    ref_out, ref_residual = norm(x, residual)   # outside a forward context: the torch code
    assert torch.equal(new_residual, ref_residual), "x + residual must be exactly torch's sum"
    assert_close(out, ref_out)
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1]), "inputs were written"
    assert out.is_contiguous() and new_residual.is_contiguous()


def test_rms_norm_plus_one_per_head_with_an_fp32_weight(generator):
    """Gemma 3's q_norm over [T, H, D] heads of a qkv slice; an fp32 weight over fp16 activations: the output is the
    activations' dtype (transformers' ``.type_as(x)``), not the promoted one plain RMSNorm gives."""
    tokens, heads, head_dim = 6, 4, 64
    qkv = randn(generator, tokens, (heads + 4) * head_dim, dtype=torch.float16, scale=2.0)
    q = qkv[:, :heads * head_dim].reshape(tokens, heads, head_dim)   # a strided view
    norm = GemmaRMSNorm(head_dim, eps=1e-6)
    norm.weight.data = randn(generator, head_dim, dtype=torch.float32, scale=0.5)
    out = fused_add_rms_norm_plus_one(q, None, norm.weight, norm.eps)
    assert out.dtype == torch.float16
    assert_close(out, norm(q))
    plain = fused_add_rms_norm(q, None, norm.weight, norm.eps)   # x * w, promoted: another function
    assert plain.dtype == torch.float32 and not torch.allclose(plain.half(), out, atol=1e-2)


# ---- LayerNorm (weight, bias) with the residual add; per head ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 100, 2560])
@pytest.mark.parametrize("bias", [True, False])
def test_add_layer_norm(generator, dtype, hidden, bias):
    norm = LayerNorm(hidden, eps=1e-5, bias=bias)
    norm.weight.data = randn(generator, hidden, dtype=dtype, shift=1.0)
    if bias:
        norm.bias.data = randn(generator, hidden, dtype=dtype, scale=0.1)
    x, residual = strided_pair(generator, 5, hidden, dtype)
    before = (x.clone(), residual.clone())
    out, new_residual = fused_add_layer_norm(x, residual, norm.weight, norm.bias, norm.eps)
    ref_out, ref_residual = norm(x, residual)
    assert torch.equal(new_residual, ref_residual), "x + residual must be exactly torch's sum"
    assert_close(out, ref_out)
    assert_close(fused_add_layer_norm(x, None, norm.weight, norm.bias, norm.eps), norm(x))
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1]), "inputs were written"
    assert out.is_contiguous() and new_residual.is_contiguous()


def test_layer_norm_of_a_constant_row_is_the_bias(generator):
    """Zero variance: (x - mean) is exactly 0, so the output is the bias (rstd = 1/sqrt(eps), finite)."""
    norm = LayerNorm(64)
    norm.weight.data, norm.bias.data = randn(generator, 64, dtype=torch.float32), randn(generator, 64,
                                                                                       dtype=torch.float32)
    x = torch.full((2, 64), 3.25, device=DEVICE)
    assert torch.equal(fused_add_layer_norm(x, None, norm.weight, norm.bias, norm.eps), norm.bias.expand(2, 64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_layer_norm_of_a_qkv_slice(generator, dtype):
    """StableLM's qk_layernorm: every head of q (a strided slice of the fused qkv output) with its own weight."""
    tokens, heads, head_dim = 7, 5, 64
    qkv = randn(generator, tokens, (heads + 2) * head_dim, dtype=dtype, scale=2.0, shift=0.3)
    q = qkv[:, :heads * head_dim]
    weight = randn(generator, heads, head_dim, dtype=dtype, shift=1.0)
    ref = layer_norm_per_head(q, weight, 1e-5)   # outside a forward context: the torch code
    out = fused_add_layer_norm(q.reshape(tokens, heads, head_dim), None, weight, None, 1e-5).reshape(q.shape)
    assert_close(out, ref)
    shared = fused_add_layer_norm(q.reshape(tokens, heads, head_dim), None, weight[0], None, 1e-5)
    assert not torch.allclose(shared.reshape(q.shape), ref, atol=1e-2), "each head must take its own weight"


# ---- GELU(gate) * up ----

@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # exp(2 * big) = inf, as meant
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("shape", [(9, 2 * 300), (2, 3, 2 * 1100)])
def test_gelu_and_mul(generator, dtype, approximate, shape):
    x = randn(generator, *shape, dtype=dtype, scale=3.0)
    x[0, ..., :5] = torch.tensor([0.0, -60.0, 60.0, 1e-30, -3.0])   # saturation both ways, zero, tiny
    assert_gelu_close(gelu_and_mul(x, approximate), GeluAndMul(approximate)(x))


def test_gelu_and_mul_of_a_strided_projection(generator):
    wide = randn(generator, 4, 2 * 96 + 5, dtype=torch.float32)
    x = wide[:, :2 * 96]   # rows with a stride longer than 2I
    assert_gelu_close(gelu_and_mul(x, "tanh"), GeluAndMul("tanh")(x))


# ---- the layers' dispatch ----

def _context(backend) -> ForwardContext:
    """A forward context of one token: only its backend matters to the layers tested here."""
    one = torch.ones(1, dtype=torch.int32)
    return ForwardContext(backend=backend, query_start_loc=torch.tensor([0, 1], dtype=torch.int32), seq_lens=one,
                          slot_mapping=torch.zeros(1, dtype=torch.long), block_tables=one[None],
                          query_start_loc_cpu=[0, 1], query_lens_cpu=[1], seq_lens_cpu=[1], max_query_len=1,
                          max_seq_len=1, is_decode_only=True)


def test_layers_use_the_backends_kernels_inside_a_forward_pass(generator):
    calls = []

    def recording(name):
        def call(*args):
            calls.append(name)
            return FUSED[name](*args)
        return call

    backend = SimpleNamespace(fused_add_rms_norm=None, **{name: recording(name) for name in FUSED})
    gemma_norm, layer_norm = GemmaRMSNorm(64), LayerNorm(64)
    gemma_norm.weight.data = randn(generator, 64, dtype=torch.float16, scale=0.5)
    layer_norm.weight.data = randn(generator, 64, dtype=torch.float16, shift=1.0)
    layer_norm.bias.data = randn(generator, 64, dtype=torch.float16, scale=0.1)
    head_weight, act = randn(generator, 2, 32, dtype=torch.float16, shift=1.0), GeluAndMul("tanh")
    x, residual = randn(generator, 3, 64, dtype=torch.float16), randn(generator, 3, 64, dtype=torch.float16)

    def run() -> tuple[torch.Tensor, ...]:
        return (gemma_norm(x), *gemma_norm(x, residual), layer_norm(x), *layer_norm(x, residual),
                layer_norm_per_head(x, head_weight, 1e-5), act(x))

    with forward_context(_context(backend)):
        fused = run()
    assert calls == ["fused_add_rms_norm_plus_one"] * 2 + ["fused_add_layer_norm"] * 3 + ["gelu_and_mul"]
    torch_path = run()
    assert len(calls) == 6, "outside a forward pass the layers must run their torch code"
    expected = (fused_add_rms_norm_plus_one(x, None, gemma_norm.weight, 1e-6),
                *fused_add_rms_norm_plus_one(x, residual, gemma_norm.weight, 1e-6),
                fused_add_layer_norm(x, None, layer_norm.weight, layer_norm.bias, 1e-5),
                *fused_add_layer_norm(x, residual, layer_norm.weight, layer_norm.bias, 1e-5),
                fused_add_layer_norm(x.reshape(3, 2, 32), None, head_weight, None, 1e-5).reshape(3, 64),
                gelu_and_mul(x, "tanh"))
    for got, want, ref in zip(fused, expected, torch_path, strict=True):
        assert torch.equal(got, want)
        torch.testing.assert_close(got, ref, rtol=2e-3, atol=1e-5)   # fp16: 2 units of its rounding


def test_gemma_norm_is_never_handed_to_the_plain_rms_norm_kernel(generator):
    """A backend with only the plain fused RMSNorm: the (1 + weight) norm keeps its torch code (it names its own
    kernel, which this backend lacks; attention fuses only plain RMSNorms into the rotary launch)."""
    norm = GemmaRMSNorm(64)
    norm.weight.data = randn(generator, 64, dtype=torch.float32, scale=0.5)
    x = randn(generator, 2, 64, dtype=torch.float32)
    with forward_context(_context(SimpleNamespace(fused_add_rms_norm=fused_add_rms_norm))):
        got = norm(x)
    assert torch.equal(got, norm._norm(x))
    assert GemmaRMSNorm._fused_kernel == "fused_add_rms_norm_plus_one" and RMSNorm._fused_kernel == "fused_add_rms_norm"


def test_subclasses_with_their_own_math_are_not_fused(generator):
    class ShiftedLayerNorm(LayerNorm):
        def forward(self, x, residual=None):
            return super().forward(x + 1.0, residual)

    class HalvedGemmaRMSNorm(GemmaRMSNorm):
        def _norm(self, x):
            return super()._norm(x) / 2

    shifted, halved = ShiftedLayerNorm(64, bias=False), HalvedGemmaRMSNorm(64)
    shifted.weight.data = halved.weight.data = randn(generator, 64, dtype=torch.float32)
    x = randn(generator, 2, 64, dtype=torch.float32)
    expected = (torch.nn.functional.layer_norm(x + 1.0, (64,), shifted.weight, None, 1e-5), halved._norm(x))
    with forward_context(_context(SimpleNamespace(**FUSED))):
        got = (shifted(x), halved(x))
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_backends_without_these_kernels_keep_the_torch_code(generator):
    norm, layer_norm, act = GemmaRMSNorm(64), LayerNorm(64), GeluAndMul()
    norm.weight.data, layer_norm.weight.data = randn(generator, 64, dtype=torch.float32), randn(
        generator, 64, dtype=torch.float32)
    layer_norm.bias.data = randn(generator, 64, dtype=torch.float32)
    x = randn(generator, 3, 64, dtype=torch.float32)
    expected = (norm(x), layer_norm(x), act(x))
    with forward_context(_context(CpuBackend())):
        got = (norm(x), layer_norm(x), act(x))
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
