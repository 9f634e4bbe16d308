"""The batch-1 GEMV's paired form (kernels/quant_gemv.py, CVLLM_QUANT_GEMV_PAIRS): in Triton's interpreter against
dequantize-then-matmul, its inline PTX through a model of its instructions (the interpreter cannot run PTX), and
compiled on a GPU."""

from __future__ import annotations

import struct

import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")

from test_quant_matmul import DEVICE, LAYOUTS, TOLERANCE, needs_gpu, random_weight  # noqa: E402

from cvllm_cuda.kernels.quant_gemv import PAIR_BF16_ASM, PAIR_F16_ASM, pairs_form, quant_gemv  # noqa: E402
from cvllm_cuda.quant_planes import dequantize_planes  # noqa: E402


@pytest.mark.parametrize("name", ["gptq4_g128", "q4_k", "q4_1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("block_w,n,warps", [(8, 9, 4), (32, 32, 1), (32, 64, 4), (None, 64, None)])
def test_paired_gemv_equals_dequantize_then_matmul(name, dtype, block_w, n, warps):
    """The paired form (16-bit pairs of a word's products, quant_gemv.py): tiles of parts of groups and of whole
    ones, masked and not, K split, and its default tile; within x's own rounding of the float32 reference."""
    weight = random_weight(LAYOUTS[name], n, 768, DEVICE, seed=12)
    x = torch.randn(1, 768, generator=torch.Generator().manual_seed(12)).to(dtype).to(DEVICE)
    out = torch.full((1, n), float("nan"), dtype=dtype, device=DEVICE)
    assert pairs_form(weight, dtype, True) != 0
    quant_gemv(x, weight, out, (16, block_w, warps) if block_w else None, splits=2, pairs=True)
    ref = x.float() @ dequantize_planes(weight).T
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < TOLERANCE[dtype], err


def test_paired_gemv_only_for_16_bit_x_and_a_lone_4_bit_plane(monkeypatch):
    q4k = random_weight(LAYOUTS["q4_k"], 4, 256, "cpu")
    assert pairs_form(q4k, torch.bfloat16, True) == 1
    assert pairs_form(q4k, torch.float16, True) == 2
    assert pairs_form(q4k, torch.float32, True) == 0
    for name in ("q6_k", "q5_0", "q8_0", "fp8_block128"):
        assert pairs_form(random_weight(LAYOUTS[name], 4, 256, "cpu"), torch.bfloat16, True) == 0
    monkeypatch.delenv("CVLLM_QUANT_GEMV_PAIRS", raising=False)
    assert pairs_form(q4k, torch.bfloat16) == 0          # off by default
    monkeypatch.setenv("CVLLM_QUANT_GEMV_PAIRS", "1")
    assert pairs_form(q4k, torch.bfloat16) == 1


def _run_ptx(asm: str, args: dict) -> dict:
    """A model of the few PTX instructions the paired GEMV's inline assembly uses, run on Python ints (32-bit
    registers; 16-bit float pairs rounded by torch)."""
    regs = dict(args)

    def val(tok):
        return regs[tok] if tok in regs else int(tok, 0) & 0xFFFFFFFF

    def halves(v, dtype):
        return torch.tensor([v & 0xFFFF, v >> 16], dtype=torch.int32).to(torch.uint16).view(dtype).double()

    def pack(h, dtype):
        lo, hi = h.to(dtype).view(torch.uint16).to(torch.int32).tolist()
        return lo | hi << 16

    def f32(v):
        return struct.unpack("<f", struct.pack("<I", v))[0]

    def bits(f):
        return struct.unpack("<I", struct.pack("<f", f))[0]

    for ins in asm.strip("{} ").split(";"):
        if not ins.strip() or ins.strip().startswith(".reg"):
            continue
        op, rest = ins.split(None, 1)
        ops = [o.strip() for o in rest.split(",")]
        if op == "mov.b32" and ops[0].startswith("{"):     # {h0, h1} <- a
            regs[ops[0][1:]], regs[ops[1][:-1]] = val(ops[2]) & 0xFFFF, val(ops[2]) >> 16
        elif op == "mov.b32":
            regs[ops[0]] = val(ops[1])
        elif op == "lop3.b32":
            assert ops[4] == "0xEA"                          # (a & b) | c
            regs[ops[0]] = (val(ops[1]) & val(ops[2])) | val(ops[3])
        elif op == "shr.b32":
            regs[ops[0]] = val(ops[1]) >> int(ops[2])
        elif op == "shl.b32":
            regs[ops[0]] = (val(ops[1]) << int(ops[2])) & 0xFFFFFFFF
        elif op == "and.b32":
            regs[ops[0]] = val(ops[1]) & val(ops[2])
        elif op in ("fma.rn.bf16x2", "fma.rn.f16x2"):       # one rounding of the exact a * b + c
            dtype = torch.bfloat16 if "bf16" in op else torch.float16
            a, b, c = (halves(val(o), dtype) for o in ops[1:])
            regs[ops[0]] = pack(a * b + c, dtype)
        elif op == "cvt.f32.f16":
            regs[ops[0]] = bits(halves(val(ops[1]), torch.float16)[0].item())
        elif op == "add.f32":
            regs[ops[0]] = bits(f32(val(ops[1])) + f32(val(ops[2])))
        else:
            raise AssertionError(f"no model of {op}")
    return regs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_paired_gemv_assembly_sums_a_words_products(dtype):
    """The inline PTX (which Triton's interpreter cannot run) through a model of its instructions: nibble e of the
    word times x's element e, summed, for 500 random words (pair j: elements j and j + 4); each half's four FMAs
    round to x's type."""
    asm = (PAIR_BF16_ASM if dtype == torch.bfloat16 else PAIR_F16_ASM).value
    ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    gen = torch.Generator().manual_seed(13)
    for _ in range(500):
        word = torch.randint(0, 1 << 32, (1,), generator=gen, dtype=torch.int64).item()
        x = torch.randn(8, generator=gen).to(dtype)
        xb = x.view(torch.uint16).to(torch.int32).tolist()
        pairs = {f"${2 + j}": xb[j] | xb[j + 4] << 16 for j in range(4)}
        got = struct.unpack("<f", struct.pack("<I", _run_ptx(asm, {"$1": word, **pairs})["$0"]))[0]
        terms = [((word >> (4 * e)) & 0xF) * x[e].double().item() for e in range(8)]
        assert abs(got - sum(terms)) <= 4 * ulp * sum(abs(t) for t in terms) + 1e-30, (hex(word), got, sum(terms))


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gptq4_g128", "q4_k", "q4_1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_paired_gemv(name, dtype):
    """The paired GEMV compiled (its inline PTX: lop3 and 16-bit pair FMAs), default tile and splits, a Llama-shaped K,
    against float32 within x's rounding; the same x through the float form for comparison."""
    weight = random_weight(LAYOUTS[name], 1000, 4096, DEVICE, seed=14)
    x = torch.randn(1, 4096, generator=torch.Generator().manual_seed(14)).to(dtype).to(DEVICE)
    paired, plain = (torch.full((1, 1000), float("nan"), dtype=dtype, device=DEVICE) for _ in range(2))
    quant_gemv(x, weight, paired, pairs=True)
    quant_gemv(x, weight, plain, pairs=False)
    ref = x.float() @ dequantize_planes(weight).T
    for out in (paired, plain):
        assert (out.float() - ref).abs().max().item() < TOLERANCE[dtype] * ref.abs().max().item()
