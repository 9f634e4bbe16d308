"""The Triton kernels compiled for a CUDA GPU against the oracle, on real model shapes: head dims 64-256,
GQA ratios 1/4/8, many sequences, decode contexts up to 32k through split-KV, and CUDA-graph replay."""

from __future__ import annotations

import os

import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")  # a skip locally, an error under CI=true

from cvllm_cuda.kernels import default_num_splits, paged_attention, write_kv  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                       reason="needs a CUDA device and compiled (not interpreted) Triton"),
]

DTYPES = [torch.bfloat16, torch.float32]
HEADS = [(8, 8), (16, 4), (32, 4)]  # GQA ratios 1, 4, 8


def random_mixed_batch(generator: torch.Generator, num_seqs: int, max_query_len: int,
                       max_context: int) -> tuple[list[int], list[int]]:
    """About half decodes, the rest prefill chunks (some fresh, some after cached context)."""
    query_lens, context_lens = [], []
    for _ in range(num_seqs):
        decode = torch.rand((), generator=generator) < 0.5
        query_lens.append(1 if decode else int(torch.randint(2, max_query_len + 1, (), generator=generator)))
        fresh = not decode and torch.rand((), generator=generator) < 0.3
        context_lens.append(0 if fresh else int(torch.randint(0, max_context + 1, (), generator=generator)))
    return query_lens, context_lens


@pytest.mark.parametrize("num_kv_heads", [1, 8])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                               (torch.float32, torch.float32)])
def test_write_kv(generator, num_kv_heads, head_dim, dtype, cache_dtype):
    num_tokens, num_blocks, block_size = 1000, 100, 16
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to("cuda", dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to("cuda", dtype)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens].cuda()
    slots[::7] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to("cuda", cache_dtype)
    v_cache = torch.randn(shape, generator=generator).to("cuda", cache_dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    k_expected.view(-1, num_kv_heads, head_dim).index_copy_(0, slots[keep], k[keep].to(cache_dtype))
    v_expected.view(-1, num_kv_heads, head_dim).index_copy_(0, slots[keep], v[keep].to(cache_dtype))
    write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_mixed_batch(generator, make_attention_case, check_attention, dtype, head_dim, num_heads, num_kv_heads):
    query_lens, context_lens = random_mixed_batch(generator, num_seqs=24, max_query_len=300, max_context=3000)
    case = make_attention_case(query_lens, context_lens, num_heads, num_kv_heads, head_dim, 16, dtype, "cuda")
    check_attention(case)


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (256, None), (None, 30.0), (100, 50.0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_sizes_window_soft_cap(generator, make_attention_case, check_attention, block_size, sliding_window,
                                     soft_cap, dtype):
    query_lens, context_lens = random_mixed_batch(generator, num_seqs=12, max_query_len=200, max_context=1000)
    case = make_attention_case(query_lens, context_lens, 16, 4, 128, block_size, dtype, "cuda")
    check_attention(case, sliding_window, soft_cap)


def test_long_prefill_chunks(make_attention_case, check_attention):
    """A 2048-token chunk after 6000 cached tokens and a 1500-token fresh prompt, with a 1024 window."""
    case = make_attention_case([2048, 1, 1500], [6000, 300, 0], 32, 8, 128, 16, torch.bfloat16, "cuda")
    check_attention(case)
    check_attention(case, sliding_window=1024)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("num_splits", [None, 1])
def test_long_decodes_split_kv(make_attention_case, check_attention, dtype, head_dim, num_heads, num_kv_heads,
                               num_splits):
    contexts = [32767, 16000, 0, 4095, 100]
    case = make_attention_case([1] * len(contexts), contexts, num_heads, num_kv_heads, head_dim, 16, dtype, "cuda")
    if num_splits is None:  # the default must split here: 5 x Hkv programs are far fewer than the SMs
        assert default_num_splits(len(contexts), num_kv_heads, 1, case.q.device) > 1
    check_attention(case, num_splits=num_splits)


@pytest.mark.parametrize("context", [0, 1023, 4095, 20000])
@pytest.mark.parametrize("sliding_window", [None, 512])
def test_batch_one_decode_on_the_sparse_tile(make_attention_case, check_attention, context, sliding_window):
    """One Llama-3-8B-shaped decode: 8 KV heads x 16 slices, no more programs than SMs, so the launch takes
    the sparse-decode tile (tuned_configs.TUNED_SPARSE_DECODE) where this GPU has one."""
    from cvllm_cuda.kernels.paged_attention import is_sparse_decode

    case = make_attention_case([1], [context], 32, 8, 128, 16, torch.bfloat16, "cuda")
    assert is_sparse_decode(1, 8, default_num_splits(1, 8, 1, case.q.device), case.q.device)
    check_attention(case, sliding_window)


@pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (4096, 30.0)])
def test_many_decodes(generator, make_attention_case, check_attention, sliding_window, soft_cap):
    contexts = torch.randint(0, 4096, (256,), generator=generator).tolist()
    case = make_attention_case([1] * 256, contexts, 32, 8, 128, 16, torch.bfloat16, "cuda")
    check_attention(case, sliding_window, soft_cap)


def test_half(generator, make_attention_case, check_attention):
    query_lens, context_lens = random_mixed_batch(generator, num_seqs=8, max_query_len=100, max_context=500)
    check_attention(make_attention_case(query_lens, context_lens, 16, 4, 128, 16, torch.float16, "cuda"))


@pytest.mark.parametrize("num_seqs", [3, 64])
def test_cuda_graph_replay_with_new_context_lengths(generator, make_attention_case, assert_matches_reference,
                                                    num_seqs):
    """Capture a decode step at short contexts and replay it at long ones: the grid and the split count
    are fixed at capture, the key ranges come from device tensors, and no call syncs with the host."""
    contexts = torch.randint(1000, 20000, (num_seqs,), generator=generator).tolist()
    case = make_attention_case([1] * num_seqs, contexts, 32, 8, 128, 16, torch.bfloat16, "cuda")
    final_seq_lens, final_q = case.seq_lens.clone(), case.q.clone()
    case.seq_lens.fill_(1)  # the state at capture: one key per sequence
    case.q.normal_(generator=None)
    out = torch.full_like(case.q, float("nan"))

    def step() -> None:
        paged_attention(*case.args(), None, 30.0, out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.set_sync_debug_mode("error")  # any implicit device-to-host read raises
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    case.seq_lens.copy_(final_seq_lens)
    case.q.copy_(final_q)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_matches_reference(out, case, soft_cap=30.0)


def compiled_variants(kernel) -> int:
    """How many compiled variants of a Triton kernel exist (Triton keeps one cache per device)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton version keeps its compiled kernels elsewhere")
    return sum(len(entry[0]) for entry in caches.values())


def test_new_batch_shapes_compile_nothing(generator, make_attention_case, check_attention):
    """Eager steps change batch size, block-table width, token count and query lengths every step: once a
    decode and a prefill batch have run, no new shape may compile another variant (each costs ~0.5 s of a
    serving step) -- checked on the attention and RMSNorm kernels, whose launches take such integers."""
    from cvllm_cuda.kernels.paged_attention import _attention_kernel
    from cvllm_cuda.kernels.rms_norm import _add_rms_norm_kernel, fused_add_rms_norm

    def attention(query_lens, contexts):
        check_attention(make_attention_case(query_lens, contexts, 32, 8, 128, 16, torch.bfloat16, "cuda"))

    def norm(rows):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        fused_add_rms_norm(x, torch.randn_like(x), torch.ones(4096, device="cuda", dtype=torch.bfloat16), 1e-5)

    # decodes of >= 17 sequences fill the SMs without split-KV (NUM_SPLITS, a constexpr, stays 1); mixed
    # batches never split
    attention([1] * 17, list(range(5, 600, 35)))    # a decode batch
    attention([1, 20, 1], [5, 0, 99])               # a mixed batch (query tiles of 16 tokens)
    norm(3)
    before = compiled_variants(_attention_kernel), compiled_variants(_add_rms_norm_kernel)
    for seqs in (17, 32, 33, 64, 100):
        attention([1] * seqs, torch.randint(1, 2000, (seqs,), generator=generator).tolist())
    for seqs in (1, 2, 5, 16, 17, 32, 33):
        attention([48] + [1] * (seqs - 1), [1024] + torch.randint(0, 700, (seqs - 1,), generator=generator).tolist())
    for rows in (1, 16, 17, 32, 100, 8192):
        norm(rows)
    assert (compiled_variants(_attention_kernel), compiled_variants(_add_rms_norm_kernel)) == before
