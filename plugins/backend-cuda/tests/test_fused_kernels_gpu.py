"""The fused RMSNorm / rotary / SiLU kernels compiled for a CUDA GPU against cvllm's torch layers running
torch's CUDA ops, on real model shapes; inside a CUDA graph; and a tiny Llama end to end, fused vs torch ops.

Bounds are in units in the last place (ulp). Rotary rounds exactly where torch does: bit-exact in fp32,
and expected bit-exact in 16-bit too (asserted within 1 ulp). SiLU takes exp from libdevice, as torch's
CUDA kernel does. RMSNorm sums its squares in another order than torch (and takes an IEEE 1/sqrt): a few
fp32 ulp, now and then one 16-bit rounding flipped.
"""

from __future__ import annotations

import os

import pytest
import torch

from cvllm.testing import numerics
from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")  # a skip locally, an error under CI=true

from cvllm.layers import RMSNorm, SiluAndMul, get_rope  # noqa: E402
from cvllm_cuda.kernels.activation import silu_and_mul  # noqa: E402
from cvllm_cuda.kernels.rms_norm import fused_add_rms_norm  # noqa: E402
from cvllm_cuda.kernels.rotary import rotary, rotary_write_kv  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                       reason="needs a CUDA device and compiled (not interpreted) Triton"),
]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FUSED = {"fused_add_rms_norm": fused_add_rms_norm, "rotary": rotary, "rotary_write_kv": rotary_write_kv,
         "silu_and_mul": silu_and_mul}
RMS_MAX_ULP = {torch.float32: 8, torch.float16: 2, torch.bfloat16: 2}
SILU_MAX_ULP = {torch.float32: 2, torch.float16: 2, torch.bfloat16: 2}
MAX_MISMATCH_FRACTION_16 = 1e-3  # 16-bit dtypes: a flipped rounding must stay rare


def assert_ulp_close(out: torch.Tensor, ref: torch.Tensor, max_ulp: int) -> None:
    """fp32: within ``max_ulp``; 16-bit dtypes: also rarely apart at all."""
    fraction = 1.0 if out.dtype == torch.float32 else MAX_MISMATCH_FRACTION_16
    numerics.assert_ulp_close(out, ref, max_ulp, fraction)


def randn(generator: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=generator) * scale).to("cuda", dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 896, 2048, 3584, 4096, 5120, 8192])
@pytest.mark.parametrize("rows", [1, 7, 1000])
def test_add_rms_norm(generator, dtype, hidden, rows):
    norm = RMSNorm(hidden, eps=1e-6)
    norm.weight.data = randn(generator, hidden, dtype=dtype, scale=0.5) + 1
    x = randn(generator, rows, hidden + 64, dtype=dtype, scale=4.0)[:, 32:hidden + 32]  # strided rows
    residual = randn(generator, rows, hidden, dtype=dtype, scale=4.0)
    out, new_residual = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    ref_out, ref_residual = norm(x, residual)
    assert torch.equal(new_residual, ref_residual)
    assert_ulp_close(out, ref_out, RMS_MAX_ULP[dtype])
    assert_ulp_close(fused_add_rms_norm(x, None, norm.weight, norm.eps), norm(x), RMS_MAX_ULP[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head(generator, dtype):
    """Qwen3's q_norm/k_norm: [T, H, 128] heads of a fused qkv output, many small rows per program."""
    tokens, heads, head_dim = 300, 40, 128
    qkv = randn(generator, tokens, (heads + 16) * head_dim, dtype=dtype, scale=3.0)
    q = qkv[:, :heads * head_dim].reshape(tokens, heads, head_dim)
    norm = RMSNorm(head_dim, eps=1e-6)
    norm.weight.data = randn(generator, head_dim, dtype=dtype)
    assert_ulp_close(fused_add_rms_norm(q, None, norm.weight, norm.eps), norm(q), RMS_MAX_ULP[dtype])


ROPE_SHAPES = {  # (num_heads, num_kv_heads, head_dim, partial_rotary_factor)
    "llama3_8b": (32, 8, 128, 1.0),
    "qwen2_0.5b": (14, 2, 64, 1.0),
    "llama3_70b_tp1": (64, 8, 128, 1.0),
    "phi_partial": (32, 32, 80, 0.4),
    "head_256": (8, 4, 256, 1.0),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", sorted(ROPE_SHAPES))
@pytest.mark.parametrize("tokens", [1, 37, 2048])
def test_rotary(generator, dtype, shape, tokens):
    num_heads, num_kv_heads, head_dim, factor = ROPE_SHAPES[shape]
    rope = get_rope(head_dim, 8192, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 1024, "partial_rotary_factor": factor})
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(generator, tokens, q_size + 2 * kv_size, dtype=dtype, scale=4.0)
    q, k = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size]
    positions = torch.randint(0, 8192, (tokens,), generator=generator).cuda()
    ref_q, ref_k = rope(positions, q, k)
    out_q, out_k = rotary(positions, q, k, rope.cos_sin, head_dim)
    ref_qk = torch.cat([ref_q, ref_k], dim=-1)
    out_qk, _ = rotary(positions, qkv[:, :q_size + kv_size], None, rope.cos_sin, head_dim)
    for out, ref in ((out_q, ref_q), (out_k, ref_k), (out_qk, ref_qk)):
        if dtype == torch.float32:
            assert torch.equal(out, ref)
        else:
            assert_ulp_close(out, ref, 1)


@pytest.mark.parametrize("shape", sorted(ROPE_SHAPES))
@pytest.mark.parametrize("tokens", [1, 37, 2048])
def test_rotary_write_kv(generator, check_rotary_write_kv, shape, tokens):
    """bf16: the rotated q, and the cache after the fused launch, bit-equal to rotary then write_kv; padding
    slots (-1) store nothing."""
    num_heads, num_kv_heads, head_dim, factor = ROPE_SHAPES[shape]
    rope = get_rope(head_dim, 8192, {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": factor})
    q_size, kv_size, block_size = num_heads * head_dim, num_kv_heads * head_dim, 16
    qkv = randn(generator, tokens, q_size + 2 * kv_size, dtype=torch.bfloat16, scale=4.0)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    positions = torch.randint(0, 8192, (tokens,), generator=generator).cuda()
    num_blocks = tokens // block_size + 8
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:tokens].cuda()
    slots[::5] = -1
    cache = randn(generator, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16)
    check_rotary_write_kv(positions, q, k, v, rope, head_dim, cache, slots)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [300, 1376, 4864, 14336, 18944])
@pytest.mark.parametrize("tokens", [1, 5, 512])
def test_silu_and_mul(generator, dtype, intermediate, tokens):
    x = randn(generator, tokens, 2 * intermediate, dtype=dtype, scale=5.0)
    x[0, :4] = torch.tensor([0.0, -100.0, 100.0, 1e-30])
    assert_ulp_close(silu_and_mul(x), SiluAndMul()(x), SILU_MAX_ULP[dtype])


def test_fused_kernels_replay_in_a_cuda_graph(generator):
    """Captured once, replayed on new inputs copied into the captured buffers: the eager results."""
    dtype, tokens, hidden, head_dim = torch.bfloat16, 8, 4096, 128
    norm = RMSNorm(hidden, eps=1e-5)
    norm.weight.data = randn(generator, hidden, dtype=dtype)
    rope = get_rope(head_dim, 4096, {"rope_type": "default", "rope_theta": 500000.0})
    rope.cos_sin = rope.table.to("cuda", dtype)
    static = {"x": randn(generator, tokens, hidden, dtype=dtype),
              "residual": randn(generator, tokens, hidden, dtype=dtype),
              "qkv": randn(generator, tokens, 48 * head_dim, dtype=dtype),
              "gate_up": randn(generator, tokens, 2 * 14336, dtype=dtype),
              "positions": torch.zeros(tokens, dtype=torch.long, device="cuda")}

    def step() -> tuple[torch.Tensor, ...]:
        out, new_residual = fused_add_rms_norm(static["x"], static["residual"], norm.weight, norm.eps)
        q, k = rotary(static["positions"], static["qkv"][:, :32 * head_dim],
                      static["qkv"][:, 32 * head_dim:40 * head_dim], rope.cos_sin, head_dim)
        return out, new_residual, q, k, silu_and_mul(static["gate_up"])

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    for _ in range(2):
        for name, buffer in static.items():
            buffer.copy_(torch.randint(0, 4096, buffer.shape, generator=generator).cuda() if name == "positions"
                         else randn(generator, *buffer.shape, dtype=dtype))
        graph.replay()
        for got, want in zip(outputs, step()):
            assert torch.equal(got, want)


PROMPTS = [[5, 77, 300, 12, 9, 41, 250, 3, 18, 66, 101, 7, 500, 2, 33, 90, 17, 44, 8], [11, 4, 200]]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from cvllm.testing import make_checkpoint

    path = tmp_path_factory.mktemp("tiny_llama")
    make_checkpoint(path, "llama", head_dim=32, hidden_size=96, num_attention_heads=3, num_key_value_heads=1,
                    intermediate_size=160)
    return path


def make_llm(path, dtype: str, **options):
    from cvllm import LLM

    return LLM(model=str(path), backend="cuda", dtype=dtype, max_num_seqs=4, max_num_batched_tokens=16,
               num_kv_blocks=64, enable_prefix_caching=False, **options)


def greedy(llm, max_tokens: int = 8) -> list[list[int]]:
    from cvllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [list(out.outputs[0].token_ids) for out in outputs]


def set_kernels(backend, kernels: dict) -> dict[str, int]:
    """Set the backend's fused kernels (None: the torch ops); returns the count of calls to each."""
    calls = dict.fromkeys(kernels, 0)

    def counted(name, kernel):
        def call(*args, **kwargs):   # (RMSNorm passes feeds=: who takes its output, int8_activations.py)
            calls[name] += 1
            return kernel(*args, **kwargs)
        return call

    for name, kernel in kernels.items():
        setattr(backend, name, None if kernel is None else counted(name, kernel))
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_llama_fused_vs_torch_ops(tiny_llama, dtype):
    """One eager engine, its backend's fused kernels unset then set. fp32: logits within 5e-6 of their
    scale (RMSNorm's sum order) and the same greedy tokens; bf16: ||diff|| / ||ref|| < 1e-2."""
    llm = make_llm(tiny_llama, dtype, enforce_eager=True)
    engine = llm.llm_engine
    set_kernels(engine.backend, dict.fromkeys(FUSED))
    torch_logits, torch_tokens = engine.prompt_logits(PROMPTS), greedy(llm)
    calls = set_kernels(engine.backend, FUSED)
    fused_logits, fused_tokens = engine.prompt_logits(PROMPTS), greedy(llm)
    # the attention layer rotates q and k in rotary_write_kv: plain rotary is for models that rotate themselves
    assert calls.pop("rotary") == 0 and all(calls.values()), calls
    for fused, ref in zip(fused_logits, torch_logits):
        if dtype == "float32":
            diff = (fused - ref).abs().max().item()
            assert diff <= 5e-6 * ref.abs().max().item(), f"max |diff| {diff:.3g}"
        else:
            assert ((fused - ref).norm() / ref.norm()).item() < 1e-2
    if dtype == "float32":
        assert fused_tokens == torch_tokens


def test_decode_graphs_with_fused_kernels(tiny_llama, monkeypatch):
    """CUDA graphs captured with the fused kernels generate the eager torch-op engine's tokens (fp32)."""
    from cvllm_cuda.backend import CudaBackend

    eager = make_llm(tiny_llama, "float32", enforce_eager=True)
    set_kernels(eager.llm_engine.backend, dict.fromkeys(FUSED))
    want = greedy(eager, max_tokens=16)
    for name, kernel in FUSED.items():  # before the engine exists: its graphs are captured with them
        monkeypatch.setattr(CudaBackend, name, staticmethod(kernel), raising=False)
    llm = make_llm(tiny_llama, "float32")
    backend, runner = llm.llm_engine.backend, llm.llm_engine.runner
    assert all(getattr(backend, name) is not None for name in FUSED)
    assert greedy(llm, max_tokens=16) == want
    assert runner.decode_forward.replays > 0, "no decode step replayed a graph"
