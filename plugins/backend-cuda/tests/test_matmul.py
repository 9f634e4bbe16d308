"""The one-token GEMV (kernels/gemv.py) and the few-row skinny GEMM (kernels/skinny_gemm.py) against an fp64
matmul: in Triton's CPU interpreter on small shapes (fp32, fp16: the interpreter truncates where the GPU rounds
to bf16), and compiled on a GPU on the real model shapes in bf16, inside a CUDA graph, through the backend's
linear() dispatch, and chained under programmatic dependent launch."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")  # a skip locally, an error under CI=true

from cvllm_cuda.kernels.gemv import MatmulTile, gemv, gemv_config  # noqa: E402
from cvllm_cuda.kernels.linear import linear  # noqa: E402
from cvllm_cuda.kernels.skinny_gemm import skinny_gemm  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                               reason="needs a CUDA device and compiled (not interpreted) Triton")


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


def assert_rounds_the_exact_product(out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor,
                                    weight: torch.Tensor) -> None:
    """Within one rounding of the output dtype of the fp64 result, plus the fp32 accumulation's own error
    (bounded by K * 2^-24 * sum |w| |x|, far below a 16-bit ulp)."""
    assert out.shape == ref.shape and out.dtype == x.dtype
    scale = F.linear(x.double().abs(), weight.double().abs())
    eps = torch.finfo(out.dtype).eps
    bound = eps * ref.abs() + weight.shape[1] * 2.0 ** -24 * scale + torch.finfo(out.dtype).tiny
    err = (out.double() - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.3g}x the bound"


def make(generator: torch.Generator, n: int, k: int, dtype: torch.dtype, bias: bool, rows: int = 1):
    weight = torch.randn(n, k, generator=generator).to(DEVICE, dtype) * k ** -0.5
    x = torch.randn(rows, k, generator=generator).to(DEVICE, dtype)
    b = torch.randn(n, generator=generator).to(DEVICE, dtype) if bias else None
    return x, weight, b


SMALL = MatmulTile(block_n=16, block_k=32, num_warps=2, num_stages=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,bias", [(64, 128, False), (40, 100, True), (3, 32, False)])
def test_gemv_matches_an_fp64_matmul(generator, dtype, n, k, bias):
    x, weight, b = make(generator, n, k, dtype, bias)
    out = gemv(x, weight, b, config=SMALL)
    assert_rounds_the_exact_product(out, reference(x, weight, b), x, weight)


def test_gemv_takes_any_one_row_shape_and_strided_rows(generator):
    """x as [K], [1, 1, K] and a column slice; the weight as the row slice of a wider fused matrix."""
    wide = torch.randn(48, 96, generator=generator).to(DEVICE)
    weight = wide[8:40, :64]  # rows of stride 96
    x_wide = torch.randn(1, 80, generator=generator).to(DEVICE)
    x = x_wide[:, 8:72]
    for shaped in (x, x.reshape(64), x.reshape(1, 1, 64)):
        out = gemv(shaped, weight, config=SMALL)
        assert out.shape == (*shaped.shape[:-1], 32)
        assert_rounds_the_exact_product(out.reshape(1, 32), reference(x, weight, None), x, weight)


@pytest.mark.skipif(DEVICE != "cpu", reason="about CPU tensors; the GPU dispatch has its own test below")
def test_linear_leaves_cpu_tensors_to_torch(generator, monkeypatch):
    """A layer large enough for the Triton kernels, one token and a few, on the CPU: F.linear, not the kernels
    (which Triton's interpreter would happily run, with other numbers and a thousand times slower)."""
    import cvllm_cuda.kernels.linear as module

    def fail(*args):
        raise AssertionError("a Triton matmul for CPU tensors")

    monkeypatch.setattr(module, "gemv", fail)
    monkeypatch.setattr(module, "skinny_gemm", fail)
    monkeypatch.setattr(module, "skinny_config", lambda num_rows, weight: MatmulTile(64, 64, 4, 1))
    weight = torch.randn(1024, 64, generator=generator).to(torch.float16)
    for rows in (1, 8):
        x = torch.randn(rows, 64, generator=generator).to(torch.float16)
        assert torch.equal(linear(x, weight, None), F.linear(x, weight))


SKINNY_SMALL = MatmulTile(block_n=16, block_k=32, num_warps=4, num_stages=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,rows,bias", [(64, 128, 5, False), (40, 100, 17, True), (32, 64, 2, False)])
def test_skinny_gemm_matches_an_fp64_matmul(generator, dtype, n, k, rows, bias):
    x, weight, b = make(generator, n, k, dtype, bias, rows)
    out = skinny_gemm(x, weight, b, SKINNY_SMALL)
    assert_rounds_the_exact_product(out, reference(x, weight, b), x, weight)


@pytest.mark.parametrize("split_k", [2, 3, 8])
def test_skinny_gemm_split_k_sums_every_slice_once(generator, split_k):
    """K = 100 in steps of 32 is 4 steps: 2 slices of 2, 3 slices of 2 + 2 + 0 (an empty one), 8 of 1 (4 empty)."""
    x, weight, b = make(generator, 40, 100, torch.float32, True, 17)
    tile = MatmulTile(block_n=16, block_k=32, num_warps=4, num_stages=1, split_k=split_k)
    out = skinny_gemm(x, weight, b, tile)
    assert_rounds_the_exact_product(out, reference(x, weight, b), x, weight)
    assert torch.equal(skinny_gemm(x, weight, b, tile), out)  # a fixed summation order


def test_skinny_gemm_takes_leading_dims_and_strided_rows(generator):
    wide = torch.randn(3, 4, 80, generator=generator).to(DEVICE)
    x = wide[..., 8:72]                                # [3, 4, 64] with a row stride of 80
    weight = torch.randn(48, 64, generator=generator).to(DEVICE)
    out = skinny_gemm(x, weight, None, SKINNY_SMALL)
    assert out.shape == (3, 4, 48)
    flat = x.reshape(12, 64)
    assert_rounds_the_exact_product(out.reshape(12, 48), reference(flat, weight, None), flat, weight)


def test_gemv_config_reads_the_tuned_table_of_the_gpu_it_runs_on(monkeypatch):
    import cvllm_cuda.kernels.gemv as module
    from cvllm_cuda.kernels import gpu
    from cvllm_cuda.kernels.tuned_matmul import TUNED_GEMV

    (n, k, dtype), tile = next(iter(TUNED_GEMV["NVIDIA H200"].items()))
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(gpu, "device_name", lambda index: "NVIDIA H200")
    assert gemv_config(n, k, getattr(torch, dtype), cuda) == MatmulTile(*tile)
    assert gemv_config(n + 1, k, getattr(torch, dtype), cuda) == module.DEFAULT_CONFIG
    assert gemv_config(n, k, getattr(torch, dtype), torch.device("cpu")) == module.DEFAULT_CONFIG
    monkeypatch.setattr(gpu, "device_name", lambda index: "another GPU")
    assert gemv_config(n, k, getattr(torch, dtype), cuda) == module.DEFAULT_CONFIG


# -- compiled, on the GPU --------------------------------------------------------------------------------

# (out, in) features of Llama-3-8B (qkv, o, gate_up, down, lm_head), Qwen3-0.6B (qkv, gate_up) and shapes
# that fit no tile evenly
MODEL_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (4096, 1024),
                (6144, 1024), (1030, 4100), (5003, 2048)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n,k", MODEL_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_on_the_gpu(generator, n, k, dtype, bias):
    if bias and n > 30000:
        pytest.skip("bias is covered on the smaller shapes")
    x, weight, b = make(generator, n, k, dtype, bias)
    ref = reference(x, weight, b)
    out = gemv(x, weight, b)
    assert_rounds_the_exact_product(out, ref, x, weight)
    # at least as close to the exact product as cuBLAS is (which may reduce split-K partials in 16 bits)
    error, cublas_error = ((t.double() - ref).abs().mean().item() for t in (out, F.linear(x, weight, b)))
    assert error <= 1.05 * cublas_error, (error, cublas_error)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("config", [MatmulTile(4, 1024, 4, 1), MatmulTile(8, 256, 2, 3), MatmulTile(32, 128, 8, 2)])
def test_gemv_tiles_on_the_gpu(generator, config):
    for n, k in [(6144, 4096), (1030, 4100)]:
        x, weight, _ = make(generator, n, k, torch.bfloat16, False)
        assert_rounds_the_exact_product(gemv(x, weight, config=config), reference(x, weight, None), x, weight)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kernel,rows,bias", [("gemv", 1, True), ("skinny", 24, False)])
def test_in_a_cuda_graph_the_kernels_read_their_input_at_replay(generator, kernel, rows, bias):
    x, weight, b = make(generator, 4096, 4096, torch.bfloat16, bias, rows)
    tile = MatmulTile(64, 128, 4, 4)
    run = (lambda t: gemv(t, weight, b)) if kernel == "gemv" else (lambda t: skinny_gemm(t, weight, b, tile))
    static_x = x.clone()
    run(static_x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run(static_x)
    for _ in range(3):
        fresh = torch.randn(x.shape, generator=generator).to(DEVICE, x.dtype)
        static_x.copy_(fresh)
        graph.replay()
        assert_rounds_the_exact_product(static_out, reference(fresh, weight, b), fresh, weight)


@pytest.mark.gpu
@needs_gpu
def test_linear_dispatches_one_token_of_a_large_16_bit_layer_to_the_gemv(generator, monkeypatch):
    import cvllm_cuda.kernels.linear as module

    calls = []
    monkeypatch.setattr(module, "gemv", lambda *args: calls.append(args) or F.linear(*args))
    x, weight, _ = make(generator, 4096, 1024, torch.bfloat16, False)
    linear(x, weight, None)
    linear(x.reshape(1, 1, 1024), weight, None)
    assert len(calls) == 2
    linear(torch.cat([x, x]), weight, None)                     # two tokens: cuBLAS
    linear(x.float(), weight.float(), None)                     # fp32: cuBLAS
    linear(x, weight[:512], None)                               # < MIN_OUT_FEATURES: cuBLAS
    assert len(calls) == 2



@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [2, 16, 33, 64])
# (64, 256) tiles fit 3 stages at 64 rows, not 4 (256 KB of shared memory)
@pytest.mark.parametrize("config", [MatmulTile(64, 128, 4, 4), MatmulTile(32, 256, 4, 3),
                                    MatmulTile(128, 64, 8, 5), MatmulTile(64, 128, 4, 4, split_k=2),
                                    MatmulTile(64, 256, 4, 3, split_k=4)])
def test_skinny_gemm_on_the_gpu(generator, rows, config):
    for n, k, bias in [(6144, 4096, False), (4096, 14336, False), (1030, 4100, True)]:
        x, weight, b = make(generator, n, k, torch.bfloat16, bias, rows)
        ref = reference(x, weight, b)
        out = skinny_gemm(x, weight, b, config)
        assert_rounds_the_exact_product(out, ref, x, weight)
        error, cublas_error = ((t.double() - ref).abs().mean().item() for t in (out, F.linear(x, weight, b)))
        assert error <= 1.05 * cublas_error, (n, k, error, cublas_error)


@pytest.mark.gpu
@needs_gpu
def test_linear_takes_the_skinny_gemm_only_for_tuned_row_tiles_and_shapes(generator, monkeypatch):
    import cvllm_cuda.kernels.linear as module

    calls = []
    monkeypatch.setattr(module, "skinny_gemm", lambda x, w, b, config: calls.append((x.shape[0], config))
                        or F.linear(x, w, b))
    entry = {(16, 4096, 1024, "bfloat16"): MatmulTile(64, 128, 4, 4)}
    monkeypatch.setitem(module.SKINNY_TILES, torch.cuda.get_device_name(), entry)
    x, weight, _ = make(generator, 4096, 1024, torch.bfloat16, False, 16)
    linear(x, weight, None)       # 16 rows: tuned
    linear(x[:9], weight, None)   # 9 rows: the 16-row tile too
    assert calls == [(16, MatmulTile(64, 128, 4, 4)), (9, MatmulTile(64, 128, 4, 4))]
    linear(x[:3], weight, None)   # a 16-row tile as well (the smallest)
    assert len(calls) == 3
    linear(torch.cat([x, x]), weight, None)        # 32 rows: no entry, cuBLAS
    linear(x[:, :512], weight[:, :512].contiguous(), None)   # another shape: cuBLAS
    assert len(calls) == 3


@pytest.mark.gpu
@needs_gpu
def test_a_chain_of_dependent_kernels_in_a_graph_is_the_same_with_and_without_pdl(generator, monkeypatch):
    """Programmatic dependent launch lets each kernel start before the previous one ends: a kernel that read
    its input before the wait would see stale numbers. 60 norm -> GEMV -> SiLU -> GEMV links, each reading
    the last one's output, replayed as a CUDA graph, must give the bits of the same chain launched plainly."""
    from cvllm_cuda.kernels import pdl
    from cvllm_cuda.kernels.activation import silu_and_mul
    from cvllm_cuda.kernels.rms_norm import fused_add_rms_norm

    hidden, inter = 1024, 2048
    up = [torch.randn(2 * inter, hidden, generator=generator).to(DEVICE, torch.bfloat16) * hidden ** -0.5
          for _ in range(3)]
    down = [torch.randn(hidden, inter, generator=generator).to(DEVICE, torch.bfloat16) * inter ** -0.5
            for _ in range(3)]
    norm_weight = torch.rand(hidden, generator=generator).to(DEVICE, torch.bfloat16) + 0.5
    x0 = torch.randn(1, hidden, generator=generator).to(DEVICE, torch.bfloat16)

    def chain(x):
        residual = torch.zeros_like(x)
        for i in range(60):
            h, residual = fused_add_rms_norm(x, residual, norm_weight, 1e-5)
            x = gemv(silu_and_mul(gemv(h, up[i % 3])), down[i % 3])
        return x + residual

    def run(use_pdl: bool) -> torch.Tensor:
        monkeypatch.setenv("CVLLM_PDL", "1" if use_pdl else "0")
        pdl._enabled.cache_clear()
        static_x = x0.clone()
        chain(static_x)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(static_x)
        results = []
        for _ in range(3):
            graph.replay()
            results.append(out.clone())
        return torch.stack(results)

    try:
        with_pdl, without = run(True), run(False)
    finally:
        monkeypatch.delenv("CVLLM_PDL", raising=False)
        pdl._enabled.cache_clear()
    assert pdl.options(x0.device)["USE_PDL"] == (torch.cuda.get_device_capability()[0] >= 9)
    assert torch.isfinite(without).all() and torch.equal(with_pdl, without)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("n,k,bias", [(64, 128, False), (40, 100, True)])
def test_gemv_first_weight_tile_read_before_the_wait_changes_no_bit(generator, monkeypatch, fp8, n, k, bias):
    """CVLLM_GEMV_EARLY_WEIGHTS (quant_tiles.EARLY_WEIGHTS): the first K step's weights read before the PDL wait,
    in bounds or masked, bf16 or FP8 rows with their scales: the same bits as without."""
    from cvllm_cuda.kernels import quant_tiles
    x, weight, b = make(generator, n, k, torch.float32, bias)
    scale = None
    if fp8:
        scale = weight.abs().amax(dim=1).float() / 448
        weight = (weight / scale[:, None]).to(torch.float8_e4m3fn)
    outs = []
    for early in (False, True):
        monkeypatch.setattr(quant_tiles, "EARLY_WEIGHTS", early)
        outs.append(gemv(x, weight, b, config=SMALL, scale=scale))
    assert torch.equal(outs[0], outs[1])


def test_tune_matmul_write_replaces_only_the_swept_entries():
    """bench/tune_matmul.py --write: the swept GPU's swept keys change; other GPUs' entries, a table not swept and
    the file's other tables (the low-bit GEMV's) stay (it once wrote a file without TUNED_QUANT_GEMV)."""
    import importlib.util
    from pathlib import Path

    import cvllm_cuda.kernels.tuned_matmul as committed

    path = Path(__file__).parents[3] / "bench" / "tune_matmul.py"
    spec = importlib.util.spec_from_file_location("tune_matmul_under_test", path)
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    assert tune.module_text("any GPU", (None, None), (None, None), "") == Path(committed.__file__).read_text()
    key = (4096, 4096, "float8_e4m3fn")
    written: dict = {}
    exec(tune.module_text("Some GPU", ({key: (2, 1024, 1, 3)}, {key}), (None, None), "a sweep"), written)
    assert written["TUNED_GEMV"] == {**committed.TUNED_GEMV, "Some GPU": {key: (2, 1024, 1, 3)}}
    assert written["TUNED_SKINNY"] == committed.TUNED_SKINNY
    assert written["TUNED_QUANT_GEMV"] == committed.TUNED_QUANT_GEMV
