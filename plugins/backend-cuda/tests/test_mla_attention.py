"""The MLA kernel (kernels/mla_attention.py) against a direct float32 computation: varlen prefill with cached
context, decode with and without key splits, heads not a multiple of the head block, shuffled pages. Triton's
interpreter without a GPU (float32); compiled in bf16 too with one."""

from __future__ import annotations

import pytest
import torch

from cvllm_cuda.kernels.mla_attention import mla_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q, cache, latent, query_start_loc, seq_lens, block_tables, scale):
    """Per sequence: its keys gathered from the pages, causal softmax over q . [latent ‖ rope], sum of latents."""
    out = torch.zeros(q.shape[0], q.shape[1], latent)
    block_size = cache.shape[1]
    flat = cache.float().cpu().reshape(-1, cache.shape[-1])
    for s in range(len(seq_lens)):
        start, end, n = int(query_start_loc[s]), int(query_start_loc[s + 1]), int(seq_lens[s])
        slots = torch.tensor([int(block_tables[s, j // block_size]) * block_size + j % block_size for j in range(n)])
        keys = flat[slots]                                                   # [n, latent + rope]
        scores = torch.einsum("thd,nd->thn", q[start:end].float().cpu(), keys) * scale
        positions = torch.arange(n - (end - start), n)
        scores = scores.masked_fill(torch.arange(n)[None, None, :] > positions[:, None, None], float("-inf"))
        out[start:end] = torch.einsum("thn,nc->thc", scores.softmax(-1), keys[:, :latent])
    return out


def batch(q_lens, seq_lens, heads, latent, rope, block_size=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    pages = torch.randperm(sum(blocks_per_seq) + 3, generator=gen)           # shuffled, a few unused
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for s, count in enumerate(blocks_per_seq):
        tables[s, :count] = pages[used:used + count]
        used += count
    cache = torch.randn(len(pages), block_size, 1, latent + rope, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), heads, latent + rope, generator=gen).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    move = lambda t: t.to(DEVICE)   # noqa: E731
    return move(q), move(cache), move(qsl), move(torch.tensor(seq_lens, dtype=torch.int32)), move(tables)


@pytest.mark.parametrize("q_lens, seq_lens, splits", [
    ([5, 1, 17], [5, 30, 40], 1),        # a whole prompt, a decode, a chunk after 23 cached tokens
    ([1, 1, 1], [7, 64, 33], 1),         # decode only
    ([1, 1], [70, 9], 4),                # decode split over the keys (a slice may be empty)
])
@pytest.mark.parametrize("heads", [4, 20])   # below one head block; one and a part
def test_mla_attention_matches_the_direct_computation(q_lens, seq_lens, splits, heads):
    latent, rope, scale = 32, 16, 0.17
    q, cache, qsl, lens, tables = batch(q_lens, seq_lens, heads, latent, rope)
    got = mla_attention(q, cache, latent, qsl, lens, tables, max(q_lens), scale, num_splits=splits)
    want = reference(q, cache, latent, qsl, lens, tables, scale)
    assert got.shape == (sum(q_lens), heads, latent)
    torch.testing.assert_close(got.float().cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("max_q", [1, 37])
def test_mla_attention_deepseek_v3_shape_in_bf16(max_q):
    """128 heads of 512 + 64, bf16, compiled."""
    q_lens = [1, 1, 1] if max_q == 1 else [37, 1, 12]
    q, cache, qsl, lens, tables = batch(q_lens, [300, 1000, 77], 128, 512, 64, dtype=torch.bfloat16)
    got = mla_attention(q, cache, 512, qsl, lens, tables, max_q, 576 ** -0.5)
    want = reference(q, cache, 512, qsl, lens, tables, 576 ** -0.5)
    err = ((got.float().cpu() - want).norm() / want.norm()).item()
    assert err < 1e-2, err


def test_mla_attention_reads_an_fp8_cache_with_its_scales():
    """e4m3 latents times their K scale in the scores and V scale in the output (split over the keys too)."""
    latent, rope = 32, 16
    q, cache, qsl, lens, tables = batch([3, 1], [20, 50], 4, latent, rope, seed=2)
    k_scale, v_scale = torch.tensor([0.05]), torch.tensor([0.07])
    stored = (cache.cpu() / 3).to(torch.float8_e4m3fn)            # values as an FP8 cache holds them
    for splits in (1, 2):
        got = mla_attention(q, stored.to(DEVICE), latent, qsl, lens, tables, 3, 0.2, num_splits=splits,
                            kv_scales=(k_scale.to(DEVICE), v_scale.to(DEVICE)))
        # the reference: scores from k_scale * stored, outputs from v_scale * stored
        scores_side = reference(q, stored.float() * k_scale, latent, qsl, lens, tables, 0.2)
        # outputs are v_scale / k_scale times the k-scaled latents' weighted sum, with the same weights
        torch.testing.assert_close(got.float().cpu(), scores_side * (v_scale / k_scale), rtol=1e-5, atol=1e-5)
