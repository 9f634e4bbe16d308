"""The fused RMSNorm / rotary / SiLU kernels against cvllm's torch layers, and the layers' dispatch to a
backend's fused kernels: in Triton's CPU interpreter without a GPU (conftest.py sets TRITON_INTERPRET=1).

The interpreter truncates where the GPU rounds when it converts fp32 to bf16, so these run fp32 and
fp16; bf16 is covered by the GPU tests. Bounds are in units in the last place (ulp) of the dtype.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from cvllm.testing.numerics import assert_ulp_close
from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")  # a skip locally, an error under CI=true

from cvllm.backends.cpu import CpuBackend  # noqa: E402
from cvllm.forward_context import ForwardContext, forward_context  # noqa: E402
from cvllm.layers import RMSNorm, SiluAndMul, get_rope  # noqa: E402
from cvllm_cuda.kernels.activation import silu_and_mul  # noqa: E402
from cvllm_cuda.kernels.rms_norm import fused_add_rms_norm  # noqa: E402
from cvllm_cuda.kernels.rotary import rotary, rotary_write_kv  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
DTYPES = [torch.float32, torch.float16]
FUSED = {"fused_add_rms_norm": fused_add_rms_norm, "rotary": rotary, "rotary_write_kv": rotary_write_kv,
         "silu_and_mul": silu_and_mul}
# Largest differences from torch's ops. fp32: the order of RMSNorm's sum of squares, and (interpreted)
# numpy's exp against torch's; 3-4 ulp seen. fp16: a 1-ulp flip of an fp32 intermediate changes the
# rounded value now and then (2 ulp after the product that follows), so mismatches must also be rare.
MAX_ULP = {torch.float32: 8, torch.float16: 2}
MAX_MISMATCH_FRACTION = {torch.float32: 0.5, torch.float16: 1e-3}


def randn(generator: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=generator) * scale).to(device=DEVICE, dtype=dtype)


def make_norm(generator: torch.Generator, hidden: int, dtype: torch.dtype, weight_dtype=None) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-5)
    norm.weight.data = randn(generator, hidden, dtype=weight_dtype or dtype)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 100, 5120])
def test_add_rms_norm_on_strided_rows(generator, dtype, hidden):
    norm = make_norm(generator, hidden, dtype)
    # x and residual as column slices of wider tensors: row strides that are not the hidden size
    x = randn(generator, 5, hidden + 7, dtype=dtype, scale=3.0)[:, 3:hidden + 3]
    residual = randn(generator, 5, hidden + 1, dtype=dtype)[:, :hidden]
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    ref_out, ref_residual = norm(x, residual)  # outside a forward context: the torch code
    assert torch.equal(new_residual, ref_residual), "x + residual must be exactly torch's sum"
    assert_ulp_close(out, ref_out, MAX_ULP[dtype], MAX_MISMATCH_FRACTION[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs were written"
    assert out.is_contiguous() and new_residual.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_without_residual_per_head_of_a_qkv_slice(generator, dtype):
    """Qwen3's q_norm: [T, H, D] heads read in place from the q columns of a fused qkv output."""
    tokens, heads, head_dim = 6, 5, 48
    qkv = randn(generator, tokens, (heads + 4) * head_dim, dtype=dtype, scale=2.0)
    q = qkv[:, :heads * head_dim].reshape(tokens, heads, head_dim)  # a strided view: row stride 9 * 48
    norm = make_norm(generator, head_dim, dtype)
    out = fused_add_rms_norm(q, None, norm.weight, norm.eps)
    assert_ulp_close(out, norm(q), MAX_ULP[dtype], MAX_MISMATCH_FRACTION[dtype])


def test_rms_norm_weight_dtype_promotes_like_torch(generator):
    """An fp32 weight over fp16 activations: torch's ``weight * normed`` is fp32, and so is the kernel's."""
    norm = make_norm(generator, 96, torch.float16, weight_dtype=torch.float32)
    x, residual = randn(generator, 3, 96, dtype=torch.float16), randn(generator, 3, 96, dtype=torch.float16)
    out, new_residual = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    ref_out, ref_residual = norm(x, residual)
    assert out.dtype == ref_out.dtype == torch.float32 and new_residual.dtype == torch.float16
    assert torch.equal(new_residual, ref_residual)
    assert_ulp_close(out, ref_out, MAX_ULP[torch.float32], MAX_MISMATCH_FRACTION[torch.float32])


ROPES = {  # (head_dim, rope parameters): full rotary, partial rotary, half of a head dim not a power of two
    "full_64": (64, {"rope_type": "default", "rope_theta": 10000.0}),
    "partial_64": (64, {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "llama3_80": (80, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "partial_96": (96, {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope_case", sorted(ROPES))
def test_rotary_of_strided_q_and_k_is_bit_exact(generator, dtype, rope_case):
    head_dim, params = ROPES[rope_case]
    rope = get_rope(head_dim, 512, params)
    tokens, num_heads, num_kv_heads = 7, 6, 2
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(generator, tokens, q_size + 2 * kv_size, dtype=dtype, scale=4.0)
    q, k = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size]  # views with the fused row stride
    positions = torch.randint(0, 512, (tokens,), generator=generator).to(DEVICE)
    ref_q, ref_k = rope(positions, q, k)  # side by side in one buffer: rotated as one [T, q + k] tensor
    out_q, out_k = rotary(positions, q, k, rope.cos_sin, head_dim)
    # same products and sums, rounded in the same places: the same bits
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    out_qk, none = rotary(positions, qkv[:, :q_size + kv_size], None, rope.cos_sin, head_dim)
    assert none is None and torch.equal(out_qk, torch.cat([ref_q, ref_k], dim=-1))
    apart_q, apart_k = rope(positions, q.clone(), k.clone())  # separate tensors: rotated one by one
    assert torch.equal(apart_q, ref_q) and torch.equal(apart_k, ref_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_interleaved_rotary_is_bit_exact(generator, dtype):
    """GPT-J pairs (DeepSeek's 64 rope dimensions): the kernel's and RotaryEmbedding(interleaved)'s torch ops."""
    rope = get_rope(64, 512, {"rope_type": "default", "rope_theta": 10000.0}, interleaved=True)
    q = randn(generator, 5, 8 * 64, dtype=dtype, scale=4.0)
    k = randn(generator, 5, 64, dtype=dtype, scale=4.0)
    positions = torch.randint(0, 512, (5,), generator=generator).to(DEVICE)
    cos_sin = rope.cos_sin_for(positions, q)
    ref_q, ref_k = rope._rotate_pairs(q, cos_sin[positions]), rope._rotate_pairs(k, cos_sin[positions])
    out_q, out_k = rotary(positions, q, k, cos_sin, 64, interleaved=True)
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope_case", sorted(ROPES))
def test_rotary_write_kv_is_rotary_then_write_kv(generator, check_rotary_write_kv, dtype, rope_case):
    """One launch: q rotated, the rotated k and v stored at their slots (slot -1 stores nothing), the rest of the
    cache untouched; the same bits as the two kernels."""
    head_dim, params = ROPES[rope_case]
    rope = get_rope(head_dim, 512, params)
    tokens, num_heads, num_kv_heads, block_size, num_blocks = 6, 6, 2, 4, 5
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(generator, tokens, q_size + 2 * kv_size, dtype=dtype, scale=4.0)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    positions = torch.randint(0, 512, (tokens,), generator=generator).to(DEVICE)
    slots = torch.tensor([3, 17, -1, 0, 9, -1], device=DEVICE)
    cache = randn(generator, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    check_rotary_write_kv(positions, q, k, v, rope, head_dim, cache, slots)


@pytest.mark.parametrize("dtype", DTYPES)
def test_interleaved_rotary_write_kv_is_interleaved_rotary_then_write_kv(generator, dtype):
    """GLM4's partial GPT-J-pair rotary through the fused launch: the same bits as the interleaved rotary kernel
    (bit-exact to RotaryEmbedding(interleaved) above), then write_kv."""
    from cvllm_cuda.kernels.kv_cache import write_kv

    rope = get_rope(64, 512, {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                    interleaved=True)
    tokens, num_heads, num_kv_heads, block_size, num_blocks = 6, 4, 2, 4, 5
    q, k, v = randn(generator, tokens, (num_heads + 2 * num_kv_heads) * 64, dtype=dtype, scale=4.0).split(
        [num_heads * 64, num_kv_heads * 64, num_kv_heads * 64], dim=-1)
    positions = torch.randint(0, 512, (tokens,), generator=generator).to(DEVICE)
    slots = torch.tensor([3, 17, -1, 0, 9, -1], device=DEVICE)
    cache = randn(generator, 2, num_blocks, block_size, num_kv_heads, 64, dtype=dtype)
    cos_sin = rope.cos_sin_for(positions, q)
    ref_q, ref_k = rotary(positions, q, k, cos_sin, 64, interleaved=True)
    ref_cache = cache.clone()
    write_kv(ref_k.view(tokens, num_kv_heads, 64), v.reshape(tokens, num_kv_heads, 64), ref_cache[0], ref_cache[1],
             slots)
    out_q = rotary_write_kv(positions, q, k, v, cos_sin, 64, cache[0], cache[1], slots, interleaved=True)
    assert torch.equal(out_q, ref_q) and torch.equal(cache, ref_cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope_case", ["full_64", "llama3_80"])
def test_rotary_write_kv_with_qk_norm_is_norm_then_rotary(generator, dtype, rope_case):
    """Qwen3's per-head q_norm / k_norm inside the rotary launch: RMSNorm's torch code on each head, then the rotary
    kernel and write_kv; fp16 equal up to the order of the sum of squares (a last-bit flip, rarely)."""
    from cvllm_cuda.kernels.kv_cache import write_kv

    head_dim, params = ROPES[rope_case]
    rope = get_rope(head_dim, 512, params)
    tokens, num_heads, num_kv_heads, block_size, num_blocks = 6, 6, 2, 4, 5
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = randn(generator, tokens, q_size + 2 * kv_size, dtype=dtype, scale=4.0).split(
        [q_size, kv_size, kv_size], dim=-1)
    q_norm, k_norm = make_norm(generator, head_dim, dtype), make_norm(generator, head_dim, dtype)
    positions = torch.randint(0, 512, (tokens,), generator=generator).to(DEVICE)
    slots = torch.tensor([3, 17, -1, 0, 9, -1], device=DEVICE)
    cache = randn(generator, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    normed_q = q_norm(q.reshape(tokens, num_heads, head_dim)).reshape(tokens, q_size)
    normed_k = k_norm(k.reshape(tokens, num_kv_heads, head_dim)).reshape(tokens, kv_size)
    cos_sin = rope.cos_sin_for(positions, q)   # the table on q's device, in its dtype
    ref_q, ref_k = rotary(positions, normed_q, normed_k, cos_sin, head_dim)
    ref_cache = cache.clone()
    write_kv(ref_k.view(tokens, num_kv_heads, head_dim), v.reshape(tokens, num_kv_heads, head_dim), ref_cache[0],
             ref_cache[1], slots)
    out_q = rotary_write_kv(positions, q, k, v, cos_sin, head_dim, cache[0], cache[1], slots,
                            qk_norm=(q_norm.weight, k_norm.weight, q_norm.eps))
    if dtype == torch.float16:
        assert_ulp_close(out_q, ref_q, MAX_ULP[dtype], MAX_MISMATCH_FRACTION[dtype])
        assert_ulp_close(cache, ref_cache, MAX_ULP[dtype], MAX_MISMATCH_FRACTION[dtype])
    else:   # fp32: torch's rsqrt an ulp off here and there; the rotation's differences then count many ulps
        torch.testing.assert_close(out_q, ref_q, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache, ref_cache, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # exp(100) = inf, as meant
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(9, 2 * 300), (2, 3, 2 * 1100)])
def test_silu_and_mul(generator, dtype, shape):
    x = randn(generator, *shape, dtype=dtype, scale=6.0)
    x[0, ..., :4] = torch.tensor([0.0, -100.0, 100.0, 1e-30])  # exp under- and overflow, zero, subnormal
    assert_ulp_close(silu_and_mul(x), SiluAndMul()(x), MAX_ULP[dtype], MAX_MISMATCH_FRACTION[dtype])


def _context(backend) -> ForwardContext:
    """A forward context of one token: only its backend matters to the layers tested here."""
    one = torch.ones(1, dtype=torch.int32)
    return ForwardContext(backend=backend, query_start_loc=torch.tensor([0, 1], dtype=torch.int32), seq_lens=one,
                          slot_mapping=torch.zeros(1, dtype=torch.long), block_tables=one[None],
                          query_start_loc_cpu=[0, 1], query_lens_cpu=[1], seq_lens_cpu=[1], max_query_len=1,
                          max_seq_len=1, is_decode_only=True)


def test_layers_use_the_backends_fused_kernels_inside_a_forward_pass(generator):
    calls = []

    def recording(name):
        def call(*args):
            calls.append(name)
            return FUSED[name](*args)
        return call

    backend = SimpleNamespace(**{name: recording(name) for name in FUSED})
    norm, act = make_norm(generator, 64, torch.float16), SiluAndMul()
    rope = get_rope(32, 128, {"rope_type": "default", "rope_theta": 10000.0})
    x, residual = randn(generator, 3, 64, dtype=torch.float16), randn(generator, 3, 64, dtype=torch.float16)
    positions = torch.tensor([5, 0, 127], device=DEVICE)
    q, k = x[:, :64], x[:, :32]

    with forward_context(_context(backend)):
        fused = (norm(x), *norm(x, residual), *rope(positions, q, k), act(x))
    assert calls == ["fused_add_rms_norm", "fused_add_rms_norm", "rotary", "silu_and_mul"]
    torch_path = (norm(x), *norm(x, residual), *rope(positions, q, k), act(x))
    assert len(calls) == 4, "outside a forward pass the layers must run their torch code"
    expected = (fused_add_rms_norm(x, None, norm.weight, norm.eps), *fused_add_rms_norm(x, residual, norm.weight,
                norm.eps), *rotary(positions, q, k, rope.cos_sin, 32), silu_and_mul(x))
    for got, want, ref in zip(fused, expected, torch_path):
        assert torch.equal(got, want)
        assert_ulp_close(got, ref, MAX_ULP[torch.float16], 0.05)  # 0.05: these tensors hold ~100 elements


def test_backends_without_fused_kernels_keep_the_torch_code(generator):
    norm, act = make_norm(generator, 64, torch.float32), SiluAndMul()
    x = randn(generator, 3, 64, dtype=torch.float32)
    expected = (norm(x), act(x))
    with forward_context(_context(CpuBackend())):
        got = (norm(x), act(x))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_rms_norm_subclass_with_its_own_norm_is_not_fused(generator):
    class OffsetRMSNorm(RMSNorm):  # Gemma-style (1 + weight) scale: not what the fused kernel computes
        def _norm(self, x):
            return (1 + self.weight) * torch.nn.functional.rms_norm(x, self.weight.shape, eps=self.eps)

    norm = OffsetRMSNorm(64)
    norm.weight.data = randn(generator, 64, dtype=torch.float32)
    x = randn(generator, 2, 64, dtype=torch.float32)
    with forward_context(_context(SimpleNamespace(**FUSED))):
        got = norm(x)
    assert torch.equal(got, norm._norm(x))


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU backend's tensors need the interpreter; see the GPU tests")
def test_tiny_llama_with_fused_kernels_matches_the_torch_ops(tmp_path):
    """The whole model on the CPU backend, its torch ops swapped for the interpreted fused kernels: fp32
    logits within 2e-6 of their scale (the sum-of-squares order in RMSNorm) and the same greedy tokens."""
    from cvllm import LLM, SamplingParams
    from cvllm.testing import make_checkpoint

    make_checkpoint(tmp_path, "llama", head_dim=32, hidden_size=96, num_attention_heads=3, num_key_value_heads=1,
                    intermediate_size=160)
    llm = LLM(model=str(tmp_path), backend="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=16,
              enable_prefix_caching=False)
    engine = llm.llm_engine
    prompts = [[5, 77, 300, 12, 9, 41, 250, 3, 18, 66, 101, 7, 500, 2, 33, 90, 17, 44, 8], [11, 4, 200]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run() -> tuple[list[torch.Tensor], list[list[int]]]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return engine.prompt_logits(prompts), [list(out.outputs[0].token_ids) for out in outputs]

    torch_logits, torch_tokens = run()
    calls = dict.fromkeys(FUSED, 0)
    for name, kernel in FUSED.items():
        def counted(*args, name=name, kernel=kernel):
            calls[name] += 1
            return kernel(*args)
        setattr(engine.backend, name, counted)
    fused_logits, fused_tokens = run()
    # per forward pass: 2 norms a layer and the final one, 1 rotary + KV write and 1 activation a layer
    assert calls["rotary"] == 0, "the attention layer rotates the keys on their way into the cache"
    assert calls["silu_and_mul"] and calls["fused_add_rms_norm"] == 5 * calls["rotary_write_kv"] // 2, calls
    assert fused_tokens == torch_tokens
    for fused, ref in zip(fused_logits, torch_logits):
        diff = (fused - ref).abs().max().item()
        assert diff <= 2e-6 * ref.abs().max().item(), f"max |diff| {diff:.3g}"
