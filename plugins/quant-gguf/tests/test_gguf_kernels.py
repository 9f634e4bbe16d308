"""The in-place block matmuls (cvllm_gguf.kernels) against ``dequantize`` then a float32 matmul: every type with a
kernel, the GEMV (few rows) and GEMM paths, shapes that fit no tile. Without a GPU they run in Triton's CPU
interpreter (conftest.py sets TRITON_INTERPRET=1); the ``gpu`` tests take larger shapes, and a tiny GGUF model on
CUDA, where there is one."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")  # a skip locally, an error under CI=true

from cvllm.layers.linear import ReplicatedLinear  # noqa: E402
from cvllm_gguf import kernels  # noqa: E402
from cvllm_gguf.dequant import dequantize  # noqa: E402
from cvllm_gguf.linear_method import GGUFLinearMethod  # noqa: E402
from cvllm_gguf.quant_types import GGMLType  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                               reason="needs a CUDA device (and TRITON_INTERPRET unset)")

SIMPLE_TYPES = [GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (||out - ref|| / ||ref||, max |out - ref| / max |ref|) per x dtype; the reference runs in float32. Relative to
# the output's size (weights' scales vary per test); 16-bit: the weight tile is rounded to x's dtype for tl.dot
# on the GEMM path, and the output to x's dtype on both.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (5e-3, 1e-2), torch.bfloat16: (1.5e-2, 3e-2)}

# (rows of x, out features, in features): GEMV (<= kernels.GEMV_MAX_ROWS rows) and GEMM; one block, K not a
# multiple of either kernel's K step (8 blocks, 4 or 2 blocks), N odd, N over one GEMM tile, T over one GEMM tile
SHAPES = [(1, 5, 32), (3, 13, 96), (8, 67, 288), (9, 13, 96), (20, 7, 160), (70, 67, 288)]


def random_x(t: int, k: int, dtype: torch.dtype, seed: int, device=DEVICE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, k, generator=g).to(device=device, dtype=dtype)


def reference(x: torch.Tensor, rows: torch.Tensor, qtype: GGMLType, n: int, k: int) -> torch.Tensor:
    return x.float() @ dequantize(rows, qtype, (n, k)).T


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), f"{(~torch.isfinite(out)).sum().item()} outputs unwritten or not finite"
    diff = out.float() - ref
    rel = (diff.norm() / ref.norm()).item()
    max_rel = (diff.abs().max() / ref.abs().max()).item()
    rel_tol, max_tol = TOLERANCES[dtype]
    assert rel < rel_tol and max_rel < max_tol, f"relative {rel:.3g} (< {rel_tol}), max {max_rel:.3g} (< {max_tol})"


def test_registry_holds_the_simple_types():
    assert set(SIMPLE_TYPES) <= set(kernels.kernel_types())
    assert all(kernels.has_kernel(t) for t in SIMPLE_TYPES)
    assert not kernels.has_kernel(GGMLType.F16)
    with pytest.raises(NotImplementedError, match="no GGUF matmul kernel for F16"):
        kernels.gguf_matmul(torch.zeros(1, 32), torch.zeros(1, 64, dtype=torch.uint8), GGMLType.F16, 1, 32)


@pytest.mark.parametrize("t,n,k", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("qtype", SIMPLE_TYPES, ids=lambda t: t.name)
def test_matmul_equals_dequantize_then_matmul(qtype, dtype, t, n, k, make_rows):
    rows = make_rows(qtype, n, k, seed=t + n).to(DEVICE)
    x = random_x(t, k, dtype, seed=k)
    out = torch.full((t, n), float("nan"), dtype=dtype, device=DEVICE)  # every element must be written
    assert kernels.gguf_matmul(x, rows, qtype, n, k, out=out) is out
    assert_close(out, reference(x, rows, qtype, n, k), dtype)


@pytest.mark.parametrize("path", ["gemv", "gemm"])
@pytest.mark.parametrize("qtype", SIMPLE_TYPES, ids=lambda t: t.name)
def test_every_element_decodes_exactly(qtype, path, make_raw):
    """One-hot rows of x pick single weights, so the float32 output is the kernel's dequantized weight itself:
    random blocks with scales of every size (subnormal, negative, huge) against dequant.py, element by element."""
    n, k = 6, 64
    rows = torch.from_numpy(make_raw(qtype, (n, k), np.random.default_rng(int(qtype)))).to(DEVICE)
    want = dequantize(rows, qtype, (n, k)).T  # [K, N]
    eye = torch.eye(k, device=DEVICE)
    step = kernels.GEMV_MAX_ROWS if path == "gemv" else k
    launcher = kernels._KERNELS[qtype][0 if path == "gemv" else 1]
    got = torch.empty(k, n, device=DEVICE)
    for start in range(0, k, step):
        launcher(eye[start:start + step], rows, n, k, got[start:start + step])
    # d * q is exact in float32 (11 by at most 8 significant bits), so even a fused d * q + m rounds the same
    assert torch.equal(got, want)


def test_rows_of_x_may_be_strided_and_fewer_than_the_tile(make_rows):
    qtype, n, k = GGMLType.Q4_1, 11, 96
    rows = make_rows(qtype, n, k, seed=3).to(DEVICE)
    wide = random_x(12, k + 40, torch.float32, seed=4)
    for t in (1, 5, 12):  # GEMV, GEMV, GEMM
        x = wide[:t, 8:8 + k]
        assert x.stride(0) == k + 40
        assert_close(kernels.gguf_matmul(x, rows, qtype, n, k), reference(x, rows, qtype, n, k), torch.float32)


def test_register_adds_a_type(monkeypatch):
    calls = []

    def gemv(x, qweight, out_features, in_features, out):
        calls.append(("gemv", x.shape[0]))
        out.fill_(1.0)

    def gemm(x, qweight, out_features, in_features, out):
        calls.append(("gemm", x.shape[0]))
        out.fill_(2.0)

    monkeypatch.setitem(kernels._KERNELS, GGMLType.Q4_K, kernels._KERNELS.get(GGMLType.Q4_K))
    kernels.register("q4k", gemv, gemm)
    assert kernels.has_kernel(GGMLType.Q4_K)
    qweight = torch.zeros(3, 144, dtype=torch.uint8)
    small = kernels.gguf_matmul(torch.zeros(kernels.GEMV_MAX_ROWS, 256), qweight, "Q4_K", 3, 256)
    large = kernels.gguf_matmul(torch.zeros(kernels.GEMV_MAX_ROWS + 1, 256), qweight, GGMLType.Q4_K, 3, 256)
    assert calls == [("gemv", kernels.GEMV_MAX_ROWS), ("gemm", kernels.GEMV_MAX_ROWS + 1)]
    assert (small == 1).all() and (large == 2).all() and small.shape == (kernels.GEMV_MAX_ROWS, 3)


@pytest.mark.parametrize("qtype", [GGMLType.Q5_0, GGMLType.Q8_0], ids=lambda t: t.name)
def test_linear_method_kernel_path_reshapes_and_adds_the_bias(qtype, make_rows, one_torch_thread):
    """The "kernel" compute form (what a CUDA layer of these types takes) on [..., K] activations with a bias,
    against the exact path."""
    k, n = 96, 24
    rows = make_rows(qtype, n, k, seed=5)
    layers = {}
    for form in ("exact", "kernel"):
        layer = ReplicatedLinear(k, n, bias=True, quant_method=GGUFLinearMethod(qtype, mode="exact"))
        layer.qweight.weight_loader(layer.qweight, rows)
        layer.bias.data.copy_(torch.linspace(-1, 1, n))
        layer.quant_method.process_weights_after_loading(layer)
        assert layer.gguf_compute == "fp32"  # a CPU layer keeps the dequantized path
        if form == "kernel":
            layer.weight = torch.empty(0)
            layer.gguf_compute = "kernel"
        layers[form] = layer.to(DEVICE)
    for shape in ((2, 3, k), (1, k), (4, 5, k)):
        x = torch.randn(shape).to(DEVICE)
        got, want = layers["kernel"](x), layers["exact"](x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# larger shapes on a GPU: Llama-3-8B projections and shapes that fit no tile
GPU_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (1030, 4128), (4099, 1056)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n,k", GPU_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("qtype", SIMPLE_TYPES, ids=lambda t: t.name)
def test_matmul_on_the_gpu(qtype, n, k, make_rows):
    rows = make_rows(qtype, n, k, seed=n + k).cuda()
    weight = dequantize(rows, qtype, (n, k))
    for t in (1, 5, 9, 300):  # GEMV of 1 and 8-row tiles, GEMM of 16 and 64
        for dtype in DTYPES:
            x = random_x(t, k, dtype, seed=t, device="cuda")
            out = torch.full((t, n), float("nan"), dtype=dtype, device="cuda")
            kernels.gguf_matmul(x, rows, qtype, n, k, out=out)
            assert_close(out, x.float() @ weight.T, dtype)


@pytest.mark.gpu
@needs_gpu
def test_decode_matmul_is_captured_in_a_cuda_graph(make_rows):
    qtype, n, k = GGMLType.Q4_0, 4096, 4096
    rows = make_rows(qtype, n, k, seed=1).cuda()
    x = torch.zeros(4, k, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(4, n, dtype=torch.bfloat16, device="cuda")
    kernels.gguf_matmul(x, rows, qtype, n, k, out=out)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.gguf_matmul(x, rows, qtype, n, k, out=out)
    x.copy_(random_x(4, k, torch.bfloat16, seed=2, device="cuda"))
    graph.replay()
    assert_close(out, reference(x, rows, qtype, n, k), torch.bfloat16)


def _greedy(llm, prompts):
    from cvllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("types", [{}, {"q_proj": GGMLType.Q4_0, "k_proj": GGMLType.Q4_0, "v_proj": GGMLType.Q4_0,
                                        "o_proj": GGMLType.Q5_0, "lm_head": GGMLType.Q8_0}], ids=["mix1", "mix2"])
def test_tiny_model_on_cuda_reads_the_blocks_and_gives_the_cpu_exact_tokens(tmp_path, make_rows, types,
                                                                            monkeypatch):
    from cvllm import LLM

    monkeypatch.setenv("CVLLM_GGUF_KERNELS", "1")   # opt-in until these GPU tests have passed (linear_method.py)
    from cvllm_gguf.testing import write_tiny_llama

    path, _, _ = write_tiny_llama(tmp_path, make_rows, types=types)
    prompts = [[5, 17, 33, 2], [90, 1, 44, 44, 3, 8, 61, 12, 70, 9, 11, 4, 85, 30, 31, 32, 33, 50], [7]]
    cpu = LLM(model=str(path), backend="cpu", dtype="float32", num_kv_blocks=32)
    cuda = LLM(model=str(path), backend="cuda", dtype="float32", num_kv_blocks=32, max_num_seqs=4)
    cpu_layers = {name: m for name, m in cpu.llm_engine.runner.model.named_modules() if hasattr(m, "qweight")}
    in_place = 0
    for name, module in cuda.llm_engine.runner.model.named_modules():
        if not hasattr(module, "qweight"):
            continue
        assert module.qweight.is_cuda and module.qweight.dtype == torch.uint8
        assert torch.equal(module.qweight.cpu(), cpu_layers[name].qweight), name  # the file's bytes
        if kernels.has_kernel(module.qtype):
            assert module.gguf_compute == "kernel" and module.weight.numel() == 0, name
            in_place += 1
    assert in_place >= 6
    assert _greedy(cuda, prompts) == _greedy(cpu, prompts)

