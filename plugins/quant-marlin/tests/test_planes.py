"""GPTQ and AWQ layers in the CUDA backend's low-bit planes (cvllm_marlin/planes.py): the planes dequantize to the
formats' own dequantization bit for bit, act-order layers compute with their inputs reordered by group, and what the
planes cannot hold keeps the dequantized path. The linear method's "planes" form is forced on CPU (it is picked on a
CUDA device only); without a GPU its Triton kernel runs in the CPU interpreter (conftest.py sets TRITON_INTERPRET)."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from marlin_reference import awq_tensors, gptq_tensors, rtn, write_quantized

pytest.importorskip("cvllm_cuda")

from cvllm.layers.linear import MergedColumnParallelLinear  # noqa: E402
from cvllm.testing.checkpoints import make_checkpoint  # noqa: E402
from cvllm.testing.requirements import import_or_skip  # noqa: E402
from cvllm_cuda.quant_planes import dequantize_planes  # noqa: E402
from cvllm_marlin import linear_method, planes  # noqa: E402
from cvllm_marlin.config import AWQConfig, GPTQConfig  # noqa: E402
from cvllm_marlin.linear_method import AWQLinearMethod, GPTQLinearMethod  # noqa: E402
from cvllm_marlin.packing import dequantize_awq, dequantize_gptq  # noqa: E402


def quantize(out_features: int, in_features: int, bits: int, group: int, sym: bool = True, v1: bool = True,
             perm: torch.Tensor | None = None, awq: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """A layer's checkpoint tensors (the oracle's RTN of a random weight)."""
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05
    quant = rtn(weight, bits, group, sym, perm, awq=awq)
    return awq_tensors(quant) if awq else gptq_tensors(quant, bits, v1)


def gptq(t: dict[str, torch.Tensor], bits: int, group: int, v1: bool = True, g_idx: torch.Tensor | None = None):
    """(planes, the packing module's dequantized weight [N, K]) of GPTQ tensors."""
    g_idx = t["g_idx"] if g_idx is None else g_idx
    built = planes.gptq_planes(t["qweight"], t["qzeros"], t["scales"], g_idx, bits, group, int(v1))
    return built, dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], g_idx.reshape(-1)[:g_idx.shape[-1]],
                                  bits, int(v1))


@pytest.fixture
def quant_matmul():
    import_or_skip("triton")  # a skip locally, an error under CI=true
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors through Triton's interpreter; with a GPU the end-to-end gpu test covers this path")
    from cvllm_cuda.kernels.quant_matmul import quant_matmul

    return quant_matmul


@pytest.fixture
def fresh_log(monkeypatch):
    """Every fallback reason logged again (they are logged once per process)."""
    monkeypatch.setattr(planes, "_logged", set())


def assert_product_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert ((got - want).norm() / want.norm()).item() < 1e-5


@pytest.mark.parametrize("v1", [True, False], ids=["v1", "v2"])
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group", [32, 64, -1])
@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_planes_dequantize_exactly(bits, group, sym, v1):
    t = quantize(64, 128, bits, group, sym, v1, seed=bits + group)
    built, want = gptq(t, bits, group, v1)
    assert built.perm is None
    assert torch.equal(built.weight.low, t["qweight"])    # GPTQ's words are the plane: no repack
    assert built.weight.layout.scale_group == (128 if group == -1 else group)
    assert torch.equal(dequantize_planes(built.weight), want)


def test_row_parallel_part_uses_its_own_groups():
    """A row-parallel rank holds groups from ``group_start`` on: g_idx names them globally."""
    t = quantize(64, 128, 4, 32, sym=False)
    part = {"qweight": t["qweight"][8:], "qzeros": t["qzeros"][2:], "scales": t["scales"][2:]}
    g_idx = t["g_idx"][64:]
    built = planes.gptq_planes(*part.values(), g_idx, 4, 32, group_start=2)
    assert built.perm is None
    assert torch.equal(dequantize_planes(built.weight), dequantize_gptq(*part.values(), g_idx, 4, 1, 2))


@pytest.mark.parametrize("group", [32, 64, -1])
def test_awq_planes_dequantize_exactly(group):
    t = quantize(64, 128, 4, group, awq=True, seed=group)
    built = planes.awq_planes(t["qweight"], t["qzeros"], t["scales"], group)
    assert built.perm is None and built.weight.low.shape == (128 // 8, 64)
    assert torch.equal(dequantize_planes(built.weight), dequantize_awq(t["qweight"], t["qzeros"], t["scales"], group))


def test_repack_in_column_chunks_is_the_whole(monkeypatch):
    """A large layer repacks a few columns at a time: the chunks must add up to the one-piece repack."""
    t = quantize(64, 128, 4, 32, awq=True)
    whole = planes.awq_planes(t["qweight"], t["qzeros"], t["scales"], 32).weight.low
    monkeypatch.setattr(planes, "CHUNK_ELEMENTS", 128 * 24)   # 24 columns: chunks of 24, 24, 16
    assert torch.equal(planes.awq_planes(t["qweight"], t["qzeros"], t["scales"], 32).weight.low, whole)


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 64), (4, -1)])
def test_act_order_planes_hold_the_inputs_in_group_order(bits, group):
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(bits))
    t = quantize(64, 128, bits, group, sym=False, perm=perm)
    built, want = gptq(t, bits, group)
    if group == -1:   # one group: any order is group order
        assert built.perm is None
        assert torch.equal(dequantize_planes(built.weight), want)
        return
    assert built.perm.dtype == torch.int64 and sorted(built.perm.tolist()) == list(range(128))
    assert torch.equal(t["g_idx"][built.perm].long(), torch.arange(128) // group)
    assert torch.equal(dequantize_planes(built.weight), want[:, built.perm])
    # fused shards quantized with the same order share one permutation
    fused, _ = gptq(t, bits, group, g_idx=torch.stack([t["g_idx"], t["g_idx"]]))
    assert torch.equal(fused.perm, built.perm)


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 64)])
def test_act_order_product_with_the_inputs_gathered(bits, group, quant_matmul):
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(7))
    t = quantize(48, 128, bits, group, sym=False, perm=perm, seed=3)
    built, want = gptq(t, bits, group)
    for rows in (1, 3, 20):   # GEMV, GEMM, dequantize + matmul
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
        assert_product_close(quant_matmul(x.index_select(1, built.perm), built.weight), x @ want.t())


def test_unsupported_layers_keep_the_dequantized_path(fresh_log, caplog):
    caplog.set_level(logging.INFO, logger=planes.__name__)
    g = torch.Generator().manual_seed(0)
    t = quantize(32, 128, 4, 32, sym=False, perm=torch.randperm(128, generator=g))
    other = quantize(32, 128, 4, 32, sym=False, perm=torch.randperm(128, generator=g))["g_idx"]
    # fused shards quantized with different orders
    assert gptq(t, 4, 32, g_idx=torch.stack([t["g_idx"], other]))[0] is None
    # a row-parallel rank's half under act-order: every group's scales, some of each group's inputs
    assert planes.gptq_planes(t["qweight"][:8], t["qzeros"], t["scales"], t["g_idx"][:64], 4, 32) is None
    # as many inputs as the groups hold, but unevenly: one input moved from group 3 to group 0
    uneven = t["g_idx"].clone()
    uneven[(uneven == 3).nonzero()[0]] = 0
    assert gptq(t, 4, 32, g_idx=uneven)[0] is None
    # K or the group not a multiple of 32
    narrow = quantize(32, 48, 4, -1)
    assert planes.gptq_planes(narrow["qweight"], narrow["qzeros"], narrow["scales"], narrow["g_idx"], 4, -1) is None
    small = quantize(32, 128, 4, 16)
    assert planes.gptq_planes(small["qweight"], small["qzeros"], small["scales"], small["g_idx"], 4, 16) is None
    awq = quantize(32, 48, 4, -1, awq=True)
    assert planes.awq_planes(awq["qweight"], awq["qzeros"], awq["scales"], -1) is None
    reasons = [r.getMessage() for r in caplog.records]
    assert len(reasons) == 3   # once per reason
    assert any("different g_idx" in r for r in reasons) and any("multiples of 32" in r for r in reasons)


K, WIDTHS = 128, [32, 48]   # a gate/up-like fused layer: two shards


def fused_layer(fmt: str, bits: int, group: int, act_order: bool, same_order: bool = True):
    if fmt == "awq":
        method = AWQLinearMethod(AWQConfig(bits=4, group_size=group))
    else:
        method = GPTQLinearMethod(GPTQConfig(bits=bits, group_size=group, sym=False, desc_act=act_order,
                                             zero_offset=1))
    layer = MergedColumnParallelLinear(K, WIDTHS, bias=True, quant_method=method)
    g = torch.Generator().manual_seed(11)
    order = torch.randperm(K, generator=g) if act_order else None
    for shard, width in enumerate(WIDTHS):
        perm = order if same_order or order is None else torch.randperm(K, generator=g)
        t = quantize(width, K, bits, group, sym=False, perm=perm, awq=fmt == "awq", seed=shard)
        for name, tensor in t.items():
            getattr(layer, name).weight_loader(getattr(layer, name), tensor, shard)
    layer.bias.data.copy_(torch.linspace(-1, 1, sum(WIDTHS)))
    return layer


@pytest.mark.parametrize("fmt, bits, group, act_order", [
    ("gptq", 4, 32, False), ("gptq", 8, -1, False), ("gptq", 4, 32, True), ("gptq", 8, 64, True),
    ("awq", 4, 64, False),
], ids=["gptq-4bit-g32", "gptq-8bit-per-row", "gptq-4bit-g32-act-order", "gptq-8bit-g64-act-order", "awq-g64"])
def test_planes_form_reshapes_gathers_and_adds_the_bias(fmt, bits, group, act_order, quant_matmul, monkeypatch):
    """The "planes" form (what a CUDA layer takes) on [..., K] activations with a bias, against the dequantized
    form, for every kernel path (1 row, 3, 20)."""
    dense = fused_layer(fmt, bits, group, act_order)
    dense.quant_method.process_weights_after_loading(dense)
    assert dense.marlin_compute == "dense"   # a CPU layer keeps the dequantized path
    monkeypatch.setattr(linear_method, "plane_kernels_usable", lambda device: True)   # as on a CUDA device
    layer = fused_layer(fmt, bits, group, act_order)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.marlin_compute == "planes"
    assert layer.weight.numel() == 0 and layer.qweight.numel() == 0 and layer.scales.numel() == 0   # no float copy
    assert layer.quant_low.shape == (K * bits // 32, sum(WIDTHS))
    assert (layer.quant_perm is not None) == (act_order and group != -1)
    for shape in ((1, K), (3, K), (4, 5, K)):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
        got, want = layer(x), dense(x)
        assert got.shape == want.shape == (*shape[:-1], sum(WIDTHS))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("fmt, bits, group, act_order", [
    ("gptq", 4, 32, False), ("gptq", 8, 64, True), ("awq", 4, 64, False), ("gptq", 4, -1, False),
], ids=["gptq-4bit-g32", "gptq-8bit-g64-act-order", "awq-g64", "gptq-4bit-per-row"])
def test_int8_activations_where_asked(fmt, bits, group, act_order, quant_matmul, monkeypatch):
    """CVLLM_GPTQ_INT8_ACTIVATIONS=1: the planes' layout takes the int8-activation GEMV, whose product of up to its
    MAX_ROWS rows is x (gathered in group order under act-order) rounded to int8 per 32 inputs times the weight;
    more rows keep float x. Unset, the layout keeps the float GEMV (W4A16, the default)."""
    from cvllm_cuda.kernels import quant_gemv_int8
    from cvllm_cuda.kernels.int8_activations import dequantized_activations

    monkeypatch.setattr(linear_method, "plane_kernels_usable", lambda device: True)   # as on a CUDA device
    assert planes.layout(bits, 32).int8_activations is False
    monkeypatch.setenv(planes.INT8_ACTIVATIONS_ENV, "1")
    layer = fused_layer(fmt, bits, group, act_order)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.marlin_compute == "planes" and layer.quant_weight.layout.int8_activations
    assert quant_gemv_int8.applies(layer.quant_weight.layout, K)
    want = dequantize_planes(layer.quant_weight).float()       # [N, K] in the planes' input order
    perm = layer.quant_perm
    for rows in (1, quant_gemv_int8.MAX_ROWS, 20):
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
        gathered = x if perm is None else x.index_select(1, perm)
        ref = (dequantized_activations(gathered) if rows <= quant_gemv_int8.MAX_ROWS else gathered) @ want.t()
        ref = ref + layer.bias.float()
        torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_fused_shards_with_different_orders_stay_dense(monkeypatch, fresh_log):
    monkeypatch.setattr(linear_method, "plane_kernels_usable", lambda device: True)
    layer = fused_layer("gptq", 4, 32, act_order=True, same_order=False)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.marlin_compute == "dense" and layer.weight.shape == (sum(WIDTHS), K)
    assert layer.qweight.numel() == 0


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                               reason="needs a CUDA device (and TRITON_INTERPRET unset)")


def _greedy(llm, prompts):
    from cvllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("fmt, options", [
    ("gptq", {"bits": 4, "group_size": 32, "sym": False}), ("gptq", {"bits": 8, "group_size": -1}),
    ("gptq", {"bits": 4, "group_size": 32, "desc_act": True}), ("awq", {"bits": 4, "group_size": 32}),
], ids=["gptq-4bit-g32", "gptq-8bit-per-row", "gptq-4bit-act-order", "awq-g32"])
def test_tiny_model_on_cuda_computes_from_planes_and_gives_the_cpu_tokens(tmp_path, fmt, options):
    from cvllm import LLM

    make_checkpoint(tmp_path / "base", "llama")
    write_quantized(tmp_path / "base", tmp_path / fmt, fmt, **options)
    prompts = [[1, 5, 9, 23, 7, 11, 3, 4, 99, 100, 17, 2, 8, 40, 41, 42, 43, 44, 45], [4, 8, 15], [7]]
    cpu = LLM(str(tmp_path / fmt), backend="cpu", dtype="float32", num_kv_blocks=32)
    cuda = LLM(str(tmp_path / fmt), backend="cuda", dtype="float32", num_kv_blocks=32, max_num_seqs=4)
    try:
        forms = {}
        for name, module in cuda.llm_engine.runner.model.named_modules():
            if hasattr(module, "marlin_compute"):
                forms.setdefault(name.rpartition(".")[2], set()).add(module.marlin_compute)
        # the oracle quantizes q/k/v (and gate/up) with different act-orders: those fused layers stay dense
        fused = {"dense" if options.get("desc_act") else "planes"}
        assert forms == {"qkv_proj": fused, "gate_up_proj": fused, "o_proj": {"planes"}, "down_proj": {"planes"}}
        down = cuda.llm_engine.runner.model.model.layers[0].mlp.down_proj
        assert down.weight.numel() == 0 and down.qweight.numel() == 0 and down.quant_low.is_cuda   # no float copy
        assert _greedy(cuda, prompts) == _greedy(cpu, prompts)
    finally:
        cuda.shutdown()
        cpu.shutdown()
