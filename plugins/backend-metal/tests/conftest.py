"""Shared setup of the metal backend's tests: the device the backend runs on, and random paged batches with the
contexts the model runner would build for them.

By default every test runs the backend's code on the CPU (CI has no Mac; docs/metal.md), set against the CPU
reference backend or transformers. On a Mac, ``CVLLM_METAL_TEST_DEVICE=mps`` runs the attention and model tests
with the backend on MPS instead (the references stay on the CPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from cvllm.forward_context import ForwardContext
from cvllm.testing.fixtures import one_torch_thread  # noqa: F401  (a fixture, found by its name here)
from cvllm.testing.requirements import unavailable
from cvllm_metal.device import ON_CPU_ENV, mps_available

os.environ.setdefault("HF_HUB_OFFLINE", "1")


TEST_DEVICE_ENV = "CVLLM_METAL_TEST_DEVICE"


@pytest.fixture
def metal_device(monkeypatch) -> torch.device:
    """Where the metal backend runs in this test: the CPU (CVLLM_METAL_ON_CPU=1 for the test: the backend is then
    available and, by its priority, chosen when no backend is named), or MPS when CVLLM_METAL_TEST_DEVICE=mps."""
    if os.environ.get(TEST_DEVICE_ENV, "cpu") == "mps":
        if not mps_available():
            unavailable(f"{TEST_DEVICE_ENV}=mps, but torch.backends.mps is not available here")
        monkeypatch.delenv(ON_CPU_ENV, raising=False)
        return torch.device("mps", 0)
    monkeypatch.setenv(ON_CPU_ENV, "1")
    return torch.device("cpu")


@dataclass(slots=True)
class PagedBatch:
    """One step's worth of paged attention inputs: every sequence's K/V already in shuffled blocks except the new
    tokens' slots, which hold NaN until write_kv fills them (as in a cache that was never zero-filled)."""
    k_cache: torch.Tensor        # [num_blocks, block_size, Hkv, D], NaN wherever no token was written
    v_cache: torch.Tensor
    new_k: torch.Tensor          # [T, Hkv, D] this step's keys and values, in the flat batch's order
    new_v: torch.Tensor
    q: torch.Tensor              # [T, H, D]
    block_tables: torch.Tensor   # [B, max_blocks] int32, padded with 0
    context_lens: list[int]
    query_lens: list[int]
    block_size: int

    def context(self, backend) -> ForwardContext:
        """The ForwardContext the model runner builds for this batch, on ``backend``'s device, prepared by it."""
        seq_lens = [c + n for c, n in zip(self.context_lens, self.query_lens)]
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        slots = [int(self.block_tables[b, pos // self.block_size]) * self.block_size + pos % self.block_size
                 for b, (c, n) in enumerate(zip(self.context_lens, self.query_lens)) for pos in range(c, c + n)]
        device = backend.device
        ctx = ForwardContext(
            backend=backend, query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=self.block_tables.to(device), query_start_loc_cpu=starts, query_lens_cpu=list(self.query_lens),
            seq_lens_cpu=seq_lens, max_query_len=max(self.query_lens), max_seq_len=max(seq_lens),
            is_decode_only=all(n == 1 for n in self.query_lens), block_size=self.block_size)
        backend.prepare(ctx)   # what the model runner does at the start of each forward pass
        return ctx

    def caches(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh copies of the caches on ``device`` (each backend writes into its own)."""
        return self.k_cache.to(device, copy=True), self.v_cache.to(device, copy=True)


def _paged_batch(context_lens: list[int], query_lens: list[int], heads: int, kv_heads: int, head_dim: int,
                block_size: int, seed: int, dtype: torch.dtype = torch.float32) -> PagedBatch:
    """Random sequences of ``context_lens[b]`` cached tokens plus ``query_lens[b]`` new ones, laid out over shuffled
    blocks (block 0 left to the tables' padding), with two spare blocks of garbage."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 3
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)
    tables = torch.zeros(len(seq_lens), max(needed), dtype=torch.int32)
    new_k, new_v = [], []
    for b, (c, n, nb) in enumerate(zip(context_lens, seq_lens, needed)):
        blocks = [order.pop() for _ in range(nb)]
        tables[b, :nb] = torch.tensor(blocks)
        k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        for t in range(c):   # the cached context; the new tokens' slots stay NaN
            k_cache[blocks[t // block_size], t % block_size] = k[t]
            v_cache[blocks[t // block_size], t % block_size] = v[t]
        new_k.append(k[c:])
        new_v.append(v[c:])
    q = (torch.randn(sum(query_lens), heads, head_dim, generator=gen) * 3).to(dtype)
    return PagedBatch(k_cache, v_cache, torch.cat(new_k), torch.cat(new_v), q, tables, list(context_lens),
                      list(query_lens), block_size)


@pytest.fixture
def paged_batch():
    """``paged_batch(context_lens, query_lens, heads, kv_heads, head_dim, block_size, seed, dtype=float32)``."""
    return _paged_batch
