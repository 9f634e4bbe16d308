"""The low-bit plane matmul (kernels/quant_matmul.py) against its layout's reference dequantization then a float32
matmul: every plane width, scale mode and group size the GGUF and GPTQ/AWQ repacks use, GEMV and GEMM paths, x in
float32, float16 and bfloat16. In Triton's interpreter without a GPU; compiled, on larger shapes, with one."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")

from cvllm_cuda.kernels.quant_matmul import (  # noqa: E402
    DEQUANT_CONFIGS,
    GEMM_CONFIGS,
    GEMM_MAX_ROWS,
    GEMV_CONFIGS,
    PER_POSITION_CONFIGS,
    default_gemm,
    dequantize_weight,
    quant_gemm,
    quant_gemv,
    quant_matmul,
)
from cvllm_cuda.quant_planes import QuantLayout, QuantWeight, dequantize_planes, pack_plane, unpack_plane  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
needs_gpu = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")

LAYOUTS = {   # the GGUF types' (cvllm_gguf/planes.py) and GPTQ's
    "q8_0": QuantLayout(8, 0, 32, 32, b_const=-128),
    "q4_1": QuantLayout(4, 0, 32, 32, has_m=True),
    "q5_0": QuantLayout(4, 1, 32, 32, b_const=-16),
    "q2_k": QuantLayout(2, 0, 16, 256, a_mode=2, b_mode=2, b_const=-1, has_m=True),
    "q3_k": QuantLayout(2, 1, 16, 256, a_mode=1, b_mode=1, b_const=-4),
    "q4_k": QuantLayout(4, 0, 32, 256, a_mode=2, b_mode=2, b_const=-1, has_m=True),
    "q6_k": QuantLayout(4, 2, 16, 256, a_mode=1, b_mode=1, b_const=-32),
    "gptq4_g128": QuantLayout(4, 0, 128, 128, b_mode=2, b_const=-1),
    "fp8_block128": QuantLayout(8, 0, 128, 128, b_const=0, float8=True),   # DeepSeek's 128-input scale blocks
}
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def random_weight(layout: QuantLayout, n: int, k: int, device: str, seed: int = 0) -> QuantWeight:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << layout.bits(), (n, k), generator=gen)
    if layout.float8:   # finite e4m3 values (0x7f / 0xff are NaN)
        q = torch.where((q & 0x7F) == 0x7F, q ^ 0x40, q)
    supers, scales = k // layout.super_group, k // layout.scale_group
    half = lambda: (torch.rand(supers, n, generator=gen) * 2e-2 + 1e-3).half()   # noqa: E731
    a = None
    if layout.a_mode == 1:
        a = torch.randint(-32, 32, (scales, n), generator=gen).to(torch.int8)
    elif layout.a_mode == 2:
        a = torch.randint(0, 64, (scales, n), generator=gen).to(torch.uint8)
    b = torch.randint(0, 64, (scales, n), generator=gen).to(torch.uint8) if layout.b_mode == 2 else None
    weight = QuantWeight(layout, n, k, low=pack_plane(q & ((1 << layout.low_bits) - 1), layout.low_bits),
                         high=pack_plane(q >> layout.low_bits, layout.high_bits) if layout.high_bits else None,
                         d=half(), m=half() if layout.has_m else None, a=a, b=b)
    return weight.to(device)


def check(weight: QuantWeight, t: int, dtype: torch.dtype, seed: int = 0) -> None:
    x = torch.randn(t, weight.in_features, generator=torch.Generator().manual_seed(seed)).to(dtype).to(
        weight.low.device)
    ref = x.float() @ dequantize_planes(weight).T
    out = quant_matmul(x, weight)
    assert out.dtype == dtype and out.shape == (t, weight.out_features)
    err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
    # the swapped GEMM's lanes round the factors to bf16 as well as the weights (quant_gemm_swapped.py)
    swapped = 1 < t <= GEMM_MAX_ROWS and default_gemm(x, weight) == "swapped"
    assert err < (2e-2 if swapped else TOLERANCE[dtype]), err


def test_pack_plane_round_trips():
    q = torch.randint(0, 16, (3, 64))
    assert torch.equal(unpack_plane(pack_plane(q, 4), 4, 64), q)
    q8 = torch.randint(0, 256, (2, 96))
    assert torch.equal(unpack_plane(pack_plane(q8, 8), 8, 96), q8)


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("t", [1, 3, GEMM_MAX_ROWS + 1])   # GEMV, dequantize-in-tile GEMM, dequantize + cuBLAS
def test_matmul_equals_dequantize_then_matmul(name, t):
    # N not a multiple of the tiles, K not a multiple of the group steps: the masks
    layout = LAYOUTS[name]
    weight = random_weight(layout, 13, 352 if layout.super_group == 32 else 3 * layout.super_group, DEVICE)
    check(weight, t, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("t", [1, 20, 100])   # GEMV, GEMM of 32-row and 128-row tiles
def test_half_inputs(dtype, t):
    check(random_weight(LAYOUTS["q4_k"], 10, 512, DEVICE, seed=3), t, dtype)


@pytest.mark.parametrize("name", ["q6_k", "q3_k", "q8_0"])
def test_dequantize_weight_gives_the_reference_values(name):
    weight = random_weight(LAYOUTS[name], 9, 512, DEVICE, seed=4)
    assert torch.equal(dequantize_weight(weight, torch.float32).cpu(), dequantize_planes(weight).cpu().T)


def test_gemm_writes_into_strided_rows():
    weight = random_weight(LAYOUTS["q4_k"], 20, 256, DEVICE, seed=5)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    out = torch.full((4, 40), float("nan"), device=DEVICE)
    quant_gemm(x, weight, out[:, 10:30])
    torch.testing.assert_close(out[:, 10:30].cpu(), (x @ dequantize_planes(weight).T).cpu(), rtol=1e-5, atol=1e-5)
    assert out[:, :10].isnan().all() and out[:, 30:].isnan().all()


@pytest.mark.parametrize("t", [1, 5])
def test_k_split_into_parts_adds_up(t):
    """Few output features: K is split over programs and the partial sums added (GEMV and GEMM)."""
    weight = random_weight(LAYOUTS["q5_0"], 12, 1024, DEVICE, seed=6)
    x = torch.randn(t, 1024, generator=torch.Generator().manual_seed(t)).to(DEVICE)
    ref = x @ dequantize_planes(weight).T
    for splits in (2, 3, 64):   # 64: more parts than K steps: as many as there are steps
        out = torch.full((t, 12), float("nan"), device=DEVICE)
        (quant_gemv if t == 1 else quant_gemm)(x, weight, out, splits=splits)
        # float32 sums in another order: relative to the outputs' size
        torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("name,layout", [("q4_k", LAYOUTS["q4_k"]), ("gptq4_g128", LAYOUTS["gptq4_g128"]),
                                         ("q6_k", LAYOUTS["q6_k"]), ("q2_k", LAYOUTS["q2_k"]),
                                         ("6-word groups", QuantLayout(4, 0, 48, 96, b_mode=2, b_const=-1)),
                                         ("fp8 per channel", QuantLayout(8, 0, 768, 768, b_const=0, float8=True))])
@pytest.mark.parametrize("block_w", [4, 8, 32])
@pytest.mark.parametrize("n,warps", [(9, 4), (32, 1)])
def test_gemv_tiles_of_whole_groups_parts_of_groups_or_single_words(name, layout, block_w, n, warps):
    """The GEMV shares factors over a scale group's words in a tile (group_words): groups smaller than, larger than
    and not nesting with the tile; N a multiple of the tile (the unmasked form) and one warp (a group's words in one
    thread: their sum taken every step, quant_tiles.groups_in_thread)."""
    weight = random_weight(layout, n, 768, DEVICE, seed=9)
    x = torch.randn(1, 768, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    out = torch.empty(1, n, device=DEVICE)
    quant_gemv(x, weight, out, (16, block_w, warps), splits=2)
    ref = x @ dequantize_planes(weight).T
    torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_gemm_config_may_set_block_m():
    weight = random_weight(LAYOUTS["q4_k"], 24, 256, DEVICE, seed=8)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    out = torch.empty(5, 24, device=DEVICE)
    quant_gemm(x, weight, out, (32, 16, 4, 2, 32))
    ref = x @ dequantize_planes(weight).T
    torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_configs_cover_every_plane_width():
    assert set(GEMV_CONFIGS) == set(GEMM_CONFIGS) == set(PER_POSITION_CONFIGS) == set(DEQUANT_CONFIGS) == {2, 4, 8}


@pytest.mark.parametrize("name", ["q4_k", "q6_k", "q2_k", "q8_0", "fp8_block128"])
def test_per_position_kernel_equals_the_reference(name):
    """The per-position GEMM (kept for tiles the unpacked kernel's does not fit) on its own."""
    weight = random_weight(LAYOUTS[name], 13, 512, DEVICE, seed=11)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    out = torch.empty(3, 13, device=DEVICE)
    quant_gemm(x, weight, out, kernel="per-position")
    ref = x @ dequantize_planes(weight).T
    torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_operand_lanes_auto_takes_float_activation_layouts_from_32_rows(monkeypatch):
    """CVLLM_SWAPPED_OPERAND_LANES=auto: GPTQ/AWQ-style layouts (float activations) from 32 rows, never the GGUF
    types' (int8 activations); "1" and "0" every product or none."""
    from cvllm_cuda.kernels import quant_gemm_swapped

    gptq = LAYOUTS["gptq4_g128"]
    q4k = dataclasses.replace(LAYOUTS["q4_k"], int8_activations=True)   # as cvllm_gguf/planes.py builds it
    monkeypatch.setattr(quant_gemm_swapped, "OPERAND_LANES", "auto")
    assert [quant_gemm_swapped.operand_lanes(gptq, rows) for rows in (16, 31, 32, 64)] == [False, False, True, True]
    assert not quant_gemm_swapped.operand_lanes(q4k, 64)
    for forced in (True, False):
        monkeypatch.setattr(quant_gemm_swapped, "OPERAND_LANES", forced)
        assert [quant_gemm_swapped.operand_lanes(layout, 64) for layout in (gptq, q4k)] == [forced, forced]


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)   # bf16: 4-bit words in lane order
@pytest.mark.parametrize("t,n,splits", [(3, 13, None), (20, 130, 3)])
@pytest.mark.parametrize("operand_lanes", [False, True], ids=["tile-lanes", "operand-lanes"])
def test_swapped_kernel_equals_the_reference(monkeypatch, name, dtype, t, n, splits, operand_lanes):
    """The swapped GEMM (quant_gemm_swapped.py: the weight as the first operand, x permuted) with a K split and
    ragged rows and columns, position by position or, for 4-bit planes without a high plane in bf16, in lanes (a
    word's four lanes in one thread, or, CVLLM_SWAPPED_OPERAND_LANES, each thread the lane its operand holds)."""
    from cvllm_cuda.kernels import quant_gemm_swapped
    if operand_lanes and not quant_gemm_swapped.in_lanes(LAYOUTS[name], dtype):
        pytest.skip("position by position: no lanes")
    monkeypatch.setattr(quant_gemm_swapped, "OPERAND_LANES", operand_lanes)
    weight = random_weight(LAYOUTS[name], n, 512, DEVICE, seed=12)
    x = torch.randn(t, 512, generator=torch.Generator().manual_seed(12)).to(dtype).to(DEVICE)
    out = torch.empty(t, n, device=DEVICE, dtype=dtype)
    quant_gemm(x, weight, out, config=(64, 16, 4, 1) if INTERPRET else None, splits=splits, kernel="swapped")
    ref = x.float() @ dequantize_planes(weight).T
    err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
    # bf16 in lanes: the factors rounded to bf16 as well as the weights (1e-2 holds the float path's bf16 rounding)
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), err


def test_swapped_kernel_reads_x_as_it_is_in_lane_order_and_permuted_by_position_otherwise():
    """Lane j of a 4-bit word holds elements 2 j and 2 j + 1, so the lanes come out in K order and x needs no copy;
    position-major, x[t, S * K / P + w] is input w * P + S."""
    from cvllm_cuda.kernels.quant_gemm_swapped import permuted
    x = torch.arange(16.0).view(1, 16)
    assert permuted(x, random_weight(LAYOUTS["q4_k"], 1, 256, "cpu"), lanes=True) is x
    by_position = permuted(x, random_weight(LAYOUTS["q4_k"], 1, 256, "cpu"), lanes=False)
    assert by_position[0].tolist() == [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15]


def test_decode_batches_of_lane_layouts_take_the_swapped_gemm(monkeypatch):
    """By default (CVLLM_QUANT_GEMM=auto) 4-bit layouts without a high plane with bf16 x take the swapped GEMM up to
    SWAPPED_MAX_ROWS rows (measured faster there), everything else the unpacked one; the switch forces either."""
    from cvllm_cuda.kernels import quant_matmul as qm
    x = lambda t, dtype=torch.bfloat16: torch.empty(t, 256, dtype=dtype)   # noqa: E731
    w = {name: random_weight(LAYOUTS[name], 8, 256, "cpu") for name in ("q4_k", "q4_1", "gptq4_g128", "q8_0", "q6_k")}
    for name in ("q4_k", "q4_1", "gptq4_g128"):
        assert qm.default_gemm(x(2), w[name]) == qm.default_gemm(x(qm.SWAPPED_MAX_ROWS), w[name]) == "swapped"
        assert qm.default_gemm(x(qm.SWAPPED_MAX_ROWS + 1), w[name]) == "unpacked"
        assert qm.default_gemm(x(8, torch.float16), w[name]) == "unpacked"
    assert qm.default_gemm(x(8), w["q8_0"]) == qm.default_gemm(x(8), w["q6_k"]) == "unpacked"
    monkeypatch.setattr(qm, "DEFAULT_GEMM", "unpacked")
    assert qm.default_gemm(x(8), w["q4_k"]) == "unpacked"
    monkeypatch.setattr(qm, "DEFAULT_GEMM", "swapped")
    assert qm.default_gemm(x(100), w["q6_k"]) == "swapped"


def test_a_tile_that_does_not_fit_falls_back_to_the_per_position_kernel(monkeypatch, caplog):
    """Out of shared memory for the unpacked kernel's default tile (a GPU's limit: raised by hand here): the call
    still answers, through the per-position kernel, and later calls of that layout and row tile go there at once."""
    from triton.runtime.errors import OutOfResources

    from cvllm_cuda.kernels import quant_matmul as qm
    calls = []
    real = qm._gemm

    def gemm(x, weight, out, config, splits, kernel):
        calls.append(kernel)
        if kernel == "unpacked":
            raise OutOfResources(270336, 232448, "shared memory")
        real(x, weight, out, config, splits, kernel)

    from cvllm_cuda.kernels import quant_tiles
    monkeypatch.setattr(qm, "_gemm", gemm)
    monkeypatch.setattr(quant_tiles, "DOES_NOT_FIT", set())
    monkeypatch.setattr(quant_tiles, "COMPILED", set())
    weight = random_weight(LAYOUTS["q4_k"], 20, 256, DEVICE, seed=12)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    ref = x @ dequantize_planes(weight).T
    for _ in range(2):
        out = torch.empty(4, 20, device=DEVICE)
        quant_gemm(x, weight, out)
        torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert calls == ["unpacked", "per-position", "per-position"]
    assert "per-position kernel serves it" in caplog.text and "OutOfResources" in caplog.text
    with pytest.raises(OutOfResources):   # an explicit tile is the caller's: no fallback
        quant_gemm(x, weight, out, config=(128, 8, 4, 4), kernel="unpacked")


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("t", [1, 2, 8, 16, 33, 300])
def test_gpu_shapes(name, t):
    from cvllm_cuda.kernels import quant_tiles
    check(random_weight(LAYOUTS[name], 1000, 4096, DEVICE, seed=t), t, torch.bfloat16)
    # the default GEMM tile compiled for every layout: no fallback to the per-position kernel
    assert not quant_tiles.DOES_NOT_FIT, quant_tiles.DOES_NOT_FIT


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("t", [2, 16, 33, 128])
@pytest.mark.parametrize("operand_lanes", [False, True], ids=["tile-lanes", "operand-lanes"])
def test_gpu_swapped_gemm(monkeypatch, name, t, operand_lanes):
    """The swapped GEMM (4-bit planes without a high plane in lanes: quant_gemm's default there) compiled, its default
    tiles, against float32: bf16 factors in lanes, so 2e-2 of the largest output as in the interpreter test; with
    CVLLM_SWAPPED_OPERAND_LANES too."""
    from cvllm_cuda.kernels import quant_gemm_swapped
    if operand_lanes and not quant_gemm_swapped.in_lanes(LAYOUTS[name], torch.bfloat16):
        pytest.skip("position by position: no lanes")
    monkeypatch.setattr(quant_gemm_swapped, "OPERAND_LANES", operand_lanes)
    weight = random_weight(LAYOUTS[name], 1000, 4096, DEVICE, seed=t)
    x = torch.randn(t, 4096, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16).to(DEVICE)
    out = torch.empty(t, 1000, device=DEVICE, dtype=torch.bfloat16)
    quant_gemm(x, weight, out, kernel="swapped")
    ref = x.float() @ dequantize_planes(weight).T
    assert (out.float() - ref).abs().max().item() < 2e-2 * ref.abs().max().item()
    from cvllm_cuda.kernels import quant_tiles
    assert not quant_tiles.DOES_NOT_FIT, quant_tiles.DOES_NOT_FIT


@needs_gpu
@pytest.mark.gpu
def test_decode_matmul_is_captured_in_a_cuda_graph():
    weight = random_weight(LAYOUTS["q4_k"], 512, 1024, DEVICE)
    x = torch.randn(1, 1024, device=DEVICE, dtype=torch.bfloat16)
    out = torch.empty(1, 512, device=DEVICE, dtype=torch.bfloat16)
    quant_matmul(x, weight, out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quant_matmul(x, weight, out)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    ref = (x.float() @ dequantize_planes(weight).T)
    assert (out.float() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()
