"""The stream-K GEMM (kernels/stream_k_gemm.py) against an fp64 matmul: in Triton's CPU interpreter on small
shapes with program counts that cut tiles at every kind of place, and compiled on a GPU on the Llama-3-8B
projections at decode-batch row counts in bf16, inside a CUDA graph, and through linear()'s dispatch."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from cvllm_cuda.kernels import stream_k_gemm as module  # noqa: E402
from cvllm_cuda.kernels.linear import linear  # noqa: E402
from cvllm_cuda.kernels.stream_k_gemm import StreamKTile, stream_k_gemm  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                               reason="needs a CUDA device and compiled (not interpreted) Triton")
SMALL = StreamKTile(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)


def make(generator, rows: int, n: int, k: int, dtype: torch.dtype, bias: bool):
    weight = torch.randn(n, k, generator=generator).to(DEVICE, dtype) * k ** -0.5
    x = torch.randn(rows, k, generator=generator).to(DEVICE, dtype)
    b = torch.randn(n, generator=generator).to(DEVICE, dtype) if bias else None
    return x, weight, b


def assert_close_to_fp64(out, x, weight, bias) -> None:
    """Within one rounding of the output dtype of the fp64 product plus fp32 accumulation's error bound."""
    ref = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    scale = F.linear(x.double().abs(), weight.double().abs())
    bound = torch.finfo(out.dtype).eps * ref.abs() + weight.shape[1] * 2.0 ** -24 * scale + 1e-30
    worst = ((out.double() - ref).abs() / bound).max().item()
    assert out.shape == ref.shape and worst <= 1.0, f"error {worst:.3g}x the bound"


@pytest.mark.parametrize("rows,n,k,programs", [
    (40, 96, 128, 4),     # 3 x 3 tiles of 4 K steps, 36 steps on 4 programs: 9 each, every tile shared
    (33, 80, 100, 5),     # ragged rows, features and K (the last K step masked)
    (7, 128, 256, 7),     # one row tile; 8 steps a tile over 7 programs
    (50, 96, 64, 24),     # two steps a tile: some programs hold one step of a tile
    (64, 64, 64, 1),      # one program: every tile its own
    (20, 40, 96, 1000),   # more programs asked than steps: one step each
])
def test_stream_k_matches_an_fp64_matmul(generator, rows, n, k, programs):
    x, weight, bias = make(generator, rows, n, k, torch.float32, bias=rows % 2 == 1)
    assert_close_to_fp64(stream_k_gemm(x, weight, bias, SMALL, programs), x, weight, bias)


def test_stream_k_sums_in_one_order_and_leaves_its_counts_at_zero(generator):
    """Partials of a shared tile are summed in program order, so repeated launches give the same bits; each
    tile's last arrival resets its count, so the next launch (a graph replay) starts from zero."""
    x, weight, _ = make(generator, 37, 80, 100, torch.float32, bias=False)
    outs = [stream_k_gemm(x, weight, None, SMALL, programs=7) for _ in range(3)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    assert int(module._counts[x.device].abs().sum()) == 0


def test_stream_k_takes_leading_dims_and_strided_rows(generator):
    x, weight, _ = make(generator, 12, 64, 96, torch.float32, bias=False)
    wide = torch.randn(12, 128, generator=generator).to(DEVICE)
    strided = wide[:, 16:112]
    out = stream_k_gemm(strided.reshape(3, 4, 96), weight, None, SMALL, programs=5)
    assert out.shape == (3, 4, 64)
    assert_close_to_fp64(out.reshape(12, 64), strided, weight, None)


LLAMA = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [72, 136, 200, 256])
@pytest.mark.parametrize("tile", [StreamKTile(128, 128, 64, 8, 4), StreamKTile(256, 128, 64, 8, 3),
                                  StreamKTile(64, 128, 64, 4, 4)])
def test_stream_k_on_the_gpu(generator, rows, tile):
    for n, k in LLAMA:
        x, weight, _ = make(generator, rows, n, k, torch.bfloat16, bias=False)
        out = stream_k_gemm(x, weight, None, tile)
        assert_close_to_fp64(out, x, weight, None)
        ref = F.linear(x.double(), weight.double())
        error, cublas_error = ((t.double() - ref).abs().mean().item() for t in (out, F.linear(x, weight)))
        assert error <= 1.05 * cublas_error, (n, k, error, cublas_error)


@pytest.mark.gpu
@needs_gpu
def test_stream_k_in_a_cuda_graph_reads_its_input_at_replay(generator):
    x, weight, bias = make(generator, 200, 6144, 4096, torch.bfloat16, bias=True)
    tile = StreamKTile(128, 128, 64, 8, 4)
    static_x = x.clone()
    stream_k_gemm(static_x, weight, bias, tile)   # compiles (and makes the count buffer) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = stream_k_gemm(static_x, weight, bias, tile)
    for _ in range(3):
        fresh = torch.randn(x.shape, generator=generator).to(DEVICE, x.dtype)
        static_x.copy_(fresh)
        graph.replay()
        assert_close_to_fp64(static_out, fresh, weight, bias)


@pytest.mark.gpu
@needs_gpu
def test_linear_takes_stream_k_only_for_tuned_buckets_and_shapes(generator, monkeypatch):
    import cvllm_cuda.kernels.linear as dispatch

    calls = []
    monkeypatch.setattr(dispatch, "stream_k_gemm", lambda x, w, b, tile: calls.append((x.shape[0], tile))
                        or F.linear(x, w, b))
    tile = StreamKTile(128, 128, 64, 8, 4)
    monkeypatch.setitem(dispatch.STREAM_K_TILES, torch.cuda.get_device_name(), {(256, 4096, 4096, "bfloat16"): tile})
    x, weight, _ = make(generator, 256, 4096, 4096, torch.bfloat16, bias=False)
    linear(x, weight, None)         # 256 rows: the 256 bucket
    linear(x[:193], weight, None)   # 193 rows: the same bucket
    assert calls == [(256, tile), (193, tile)]
    linear(x[:192], weight, None)   # the 192 bucket: no entry, cuBLAS
    linear(torch.cat([x, x]), weight, None)   # 512 rows: cuBLAS
    monkeypatch.setenv("CVLLM_STREAM_K", "0")
    dispatch._stream_k_enabled.cache_clear()
    linear(x, weight, None)         # switched off: cuBLAS
    dispatch._stream_k_enabled.cache_clear()
    assert len(calls) == 2
