"""Gemma's two rounding details, in bfloat16 and float16 where they show, against transformers' own modules: the
(1 + w) RMSNorm scaled in fp32 and rounded once, and the embedding scale rounded to the activations' dtype first.
Each test also shows the near miss it rules out differs (the fp32 oracle tests cannot see these)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cvllm_gemma.layers import GemmaRMSNorm, GemmaScaledEmbedding, rounded_to, soft_cap

HIDDEN = 3072  # gemma-7b's: sqrt(3072) = 55.43, 55.5 in bfloat16
DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_as_transformers(dtype: torch.dtype) -> None:
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as Oracle

    generator = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(32, HIDDEN, generator=generator)).to(dtype)
    residual = torch.randn(32, HIDDEN, generator=generator).to(dtype)
    weight = (0.5 * torch.randn(HIDDEN, generator=generator)).to(dtype)
    oracle, ours = Oracle(HIDDEN, 1e-6).to(dtype), GemmaRMSNorm(HIDDEN, 1e-6).to(dtype)
    oracle.weight.data.copy_(weight)
    ours.weight.data.copy_(weight)
    assert torch.equal(ours(x), oracle(x))
    normed, summed = ours(x, residual)   # the residual added in the activations' dtype, as the oracle's layer adds it
    assert torch.equal(summed, x + residual) and torch.equal(normed, oracle(x + residual))
    # Llama's order (normalised, rounded, then scaled in the dtype) is not it
    assert not torch.equal(F.rms_norm(x, (HIDDEN,), eps=1e-6) * (1 + weight), oracle(x))


def test_rms_norm_is_handed_only_to_its_own_fused_kernel() -> None:
    # backends' fused_add_rms_norm computes x * w: a (1 + w) norm goes to fused_add_rms_norm_plus_one (and not into
    # the rotary kernel's plain q/k norm); a subclass that changes the norm again without naming a kernel runs torch
    assert GemmaRMSNorm._fusable and GemmaRMSNorm._fused_kernel == "fused_add_rms_norm_plus_one"

    class Shifted(GemmaRMSNorm):
        def _norm(self, x: torch.Tensor) -> torch.Tensor:
            return super()._norm(x) + 1

    assert not Shifted._fusable


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_scale_rounded_as_transformers(dtype: torch.dtype) -> None:
    from transformers.models.gemma.modeling_gemma import GemmaTextScaledWordEmbedding as Oracle

    vocab, generator = 64, torch.Generator().manual_seed(1)
    weight = torch.randn(vocab, HIDDEN, generator=generator).to(dtype)
    oracle = Oracle(vocab, HIDDEN, 0, embed_scale=HIDDEN**0.5)
    oracle.embed_scale.fill_(HIDDEN**0.5)   # a non-persistent buffer: transformers' init fills it, then casts it
    oracle = oracle.to(dtype)
    oracle.weight.data.copy_(weight)
    ours = GemmaScaledEmbedding(vocab, HIDDEN).to(dtype)
    ours.weight.data.copy_(weight)
    ids = torch.arange(vocab)
    assert torch.equal(ours(ids), oracle(ids))
    assert not torch.equal(weight * HIDDEN**0.5, oracle(ids))   # the unrounded factor is not it
    if dtype == torch.bfloat16:
        assert rounded_to(HIDDEN**0.5, dtype) == 55.5


def test_soft_cap() -> None:
    x = torch.linspace(-40, 40, 81)
    assert torch.equal(soft_cap(x, 30.0), torch.tanh(x / 30.0) * 30.0)
    assert soft_cap(x, 30.0).abs().max() < 30.0
    assert soft_cap(x, None) is x
