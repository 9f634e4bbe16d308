"""Shared setup of the CUDA backend's kernel tests: random paged batches, the CPU oracle, error bounds.

Without a GPU the Triton kernels run in Triton's CPU interpreter. Triton reads TRITON_INTERPRET when a
kernel is decorated, i.e. when cvllm_cuda.kernels is first imported, so it is set here, before any
test module of this directory imports the kernels.
"""

from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))   # the tests' helper modules (sm90.py), under --import-mode=importlib

from cvllm.backends.cpu import paged_attention_reference  # noqa: E402

# (||out - ref|| / ||ref||, max |out - ref|) per input dtype; the reference runs in fp32
TOLERANCES = {torch.float32: (1e-5, 1e-4), torch.float16: (5e-3, 2e-2), torch.bfloat16: (1e-2, 5e-2)}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    # triton 3.6's interpreter converts 1-element arrays to ints the way numpy deprecated: hundreds per test
    config.addinivalue_line("filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning")


@dataclass(slots=True)
class AttentionCase:
    q: torch.Tensor               # [T, H, D]
    k_cache: torch.Tensor         # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor        # [B] int32
    block_tables: torch.Tensor    # [B, max_blocks + 1] int32, padded with 0
    query_lens: list[int]
    max_query_len: int
    scale: float

    def args(self) -> tuple:
        """The positional arguments of paged_attention up to max_query_len and scale."""
        return (self.q, self.k_cache, self.v_cache, self.query_start_loc, self.seq_lens, self.block_tables,
                self.max_query_len, self.scale)


@pytest.fixture
def generator(request: pytest.FixtureRequest) -> torch.Generator:
    """Seeded from the test's id: fresh inputs for every case, the same ones when a failure is rerun."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def make_attention_case(generator: torch.Generator) -> Callable[..., AttentionCase]:
    def make(query_lens: list[int], context_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
             block_size: int, dtype: torch.dtype, device: str | torch.device) -> AttentionCase:
        seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
        blocks_per_seq = [-(-s // block_size) for s in seq_lens]
        # physical blocks in shuffled order, with spare ones: tables must be followed, not assumed
        num_blocks = sum(blocks_per_seq) + 3
        order = torch.randperm(num_blocks, generator=generator).tolist()
        tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
        for i, n in enumerate(blocks_per_seq):
            tables[i, :n] = torch.tensor(order[:n])
            order = order[n:]
        cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)

        def randn(*shape: int) -> torch.Tensor:  # every slot random: reading a wrong one shows in the result
            return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)

        starts = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
        return AttentionCase(
            q=randn(sum(query_lens), num_heads, head_dim), k_cache=randn(*cache_shape), v_cache=randn(*cache_shape),
            query_start_loc=starts.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=tables.to(device), query_lens=list(query_lens), max_query_len=max(query_lens),
            scale=head_dim ** -0.5)

    return make


def reference_attention(case: AttentionCase, sliding_window: int | None, soft_cap: float | None) -> torch.Tensor:
    """The CPU backend's oracle, one sequence at a time, in fp32: ``[T, H, D]``."""
    k_cache, v_cache = case.k_cache.float(), case.v_cache.float()
    block_size = k_cache.shape[1]
    out, start = [], 0
    for i, (n, seq_len) in enumerate(zip(case.query_lens, case.seq_lens.tolist())):
        table = case.block_tables[i:i + 1, :-(-seq_len // block_size)].long()
        positions = torch.arange(seq_len - n, seq_len, device=k_cache.device)[None]
        o = paged_attention_reference(case.q[None, start:start + n].float(), k_cache, v_cache, table, positions,
                                      case.seq_lens[i:i + 1], case.scale, sliding_window, soft_cap)
        out.append(o[0])
        start += n
    return torch.cat(out)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Every element written (the output was poisoned with NaN) and within the dtype's error bounds."""
    assert out.shape == ref.shape
    assert torch.isfinite(out).all(), f"{(~torch.isfinite(out)).sum().item()} outputs unwritten or not finite"
    diff = out.float() - ref
    rel = (diff.norm() / ref.norm()).item()
    max_abs = diff.abs().max().item()
    rel_tol, abs_tol = TOLERANCES[dtype]
    assert rel < rel_tol and max_abs < abs_tol, f"relative {rel:.3g} (< {rel_tol}), max abs {max_abs:.3g} (< {abs_tol})"


@pytest.fixture
def assert_matches_reference() -> Callable[..., None]:
    """``assert_matches_reference(out, case, sliding_window=None, soft_cap=None)``."""
    def check(out: torch.Tensor, case: AttentionCase, sliding_window: int | None = None,
              soft_cap: float | None = None) -> None:
        assert_close(out, reference_attention(case, sliding_window, soft_cap), case.q.dtype)

    return check


@pytest.fixture
def check_attention(assert_matches_reference) -> Callable[..., torch.Tensor]:
    """Run paged_attention into a NaN-poisoned output and compare it with the oracle."""
    def check(case: AttentionCase, sliding_window: int | None = None, soft_cap: float | None = None,
              **kwargs) -> torch.Tensor:
        from cvllm_cuda.kernels import paged_attention

        out = torch.full_like(case.q, float("nan"))
        result = paged_attention(*case.args(), sliding_window, soft_cap, out, **kwargs)
        assert result is out
        assert_matches_reference(out, case, sliding_window, soft_cap)
        return out

    return check


@pytest.fixture
def check_rotary_write_kv() -> Callable[..., None]:
    """``check(positions, q, k, v, rope, head_dim, cache [2, blocks, block_size, Hkv, D], slots)``: the fused launch
    against rotary then write_kv, bit for bit: the rotated q, and both caches (slot -1 stores nothing)."""
    def check(positions, q, k, v, rope, head_dim: int, cache: torch.Tensor, slots: torch.Tensor) -> None:
        from cvllm_cuda.kernels.kv_cache import write_kv
        from cvllm_cuda.kernels.rotary import rotary, rotary_write_kv

        tokens, num_kv_heads = q.shape[0], cache.shape[3]
        ref_k_cache, ref_v_cache = cache[0].clone(), cache[1].clone()
        ref_q, ref_k = rotary(positions, q, k, rope.cos_sin_for(positions, q), head_dim)
        write_kv(ref_k.view(tokens, num_kv_heads, head_dim), v.view(tokens, num_kv_heads, head_dim), ref_k_cache,
                 ref_v_cache, slots)
        k_cache, v_cache = cache[0].clone(), cache[1].clone()
        out_q = rotary_write_kv(positions, q, k, v, rope.cos_sin, head_dim, k_cache, v_cache, slots)
        assert torch.equal(out_q, ref_q)
        assert torch.equal(k_cache, ref_k_cache) and torch.equal(v_cache, ref_v_cache)

    return check
