"""Kernels compiled for Hopper on CPU, in the dtypes a model runs them in (sm90.py: the interpreter tests do not
type-check, and a float32 test did not show that the fused rotary + cache write did not compile for bf16 activations
with an FP8 cache: --kv-cache-dtype fp8 failed at CUDA graph capture, 2026-12-03): the FP8 KV cache's kernels, the
attention, argmax and speculative kernels, the producers of int8 activations; the low-bit GEMMs and GEMVs (whose
inline PTX the interpreter never sees) in test_sm90_compile_quant.py, which the test below compiles too."""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import subprocess
import sys

import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")

import sm90  # noqa: E402

# (the modules: cvllm_cuda.kernels exports functions of the same names)
kv_cache, paged_attention, rotary = (
    importlib.import_module(f"cvllm_cuda.kernels.{name}") for name in ("kv_cache", "paged_attention", "rotary"))

FP8 = torch.float8_e4m3fn
# In Triton's interpreter the kernels are not compilable objects (nor the helpers they call): there, this file's
# tests run in a child pytest with the interpreter off (no GPU is needed to compile)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
compiles = pytest.mark.skipif(INTERPRETED, reason="run by test_kernels_compile_for_hopper, interpreter off")


@pytest.mark.skipif(not INTERPRETED, reason="the tests below run here directly")
def test_kernels_compile_for_hopper():
    # this file's compile tests and the low-bit GEMMs' and GEMVs' (test_sm90_compile_quant.py)
    quant = os.path.join(os.path.dirname(__file__), "test_sm90_compile_quant.py")
    child = subprocess.run([sys.executable, "-m", "pytest", __file__, quant, "-p", "no:cacheprovider", "-o",
                            "addopts=", "-q"],
                           env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True, timeout=900)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    # every compile test ran and passed (the one skipped there is this test itself)
    assert re.search(r"\b\d+ passed, 1 skipped in ", child.stdout), child.stdout[-2000:]
TOKENS, Q_HEADS, KV_HEADS, DIM, BLOCKS, BLOCK_SIZE = 4, 8, 2, 128, 4, 16


def compiled_launches(monkeypatch, module, kernel_name: str, launch) -> list:
    """Runs ``launch()`` with ``module.kernel_name`` recorded instead of run; compiles each recorded launch (within
    the H200's shared memory, and its ``maxnreg`` where it has one) and returns the compiled kernels."""
    recorder = sm90.LaunchRecorder(getattr(module, kernel_name))
    monkeypatch.setattr(module, kernel_name, recorder)
    launch()
    kernels = []
    for args, kwargs in recorder.launches:
        kernels.append(sm90.compile_launch(recorder.fn, args, kwargs))
        assert kernels[-1].metadata.shared <= 232448, kernels[-1].metadata.shared
        if kwargs.get("maxnreg"):
            assert sm90.registers(kernels[-1]) <= kwargs["maxnreg"]
    return kernels


def caches(cache_dtype):
    return [torch.zeros(BLOCKS, BLOCK_SIZE, KV_HEADS, DIM, dtype=cache_dtype) for _ in range(2)]


def scales(cache_dtype):
    return (torch.ones(KV_HEADS), torch.ones(KV_HEADS)) if cache_dtype == FP8 else None


@compiles
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cache_fp8", [True, False])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_fused_rotary_cache_write_compiles(monkeypatch, dtype, cache_fp8, qk_norm):
    cache_dtype = FP8 if cache_fp8 else dtype
    q, k, v = (torch.zeros(TOKENS, h * DIM, dtype=dtype) for h in (Q_HEADS, KV_HEADS, KV_HEADS))
    cos_sin = torch.zeros(64, DIM, dtype=dtype)
    norm = (torch.ones(DIM, dtype=dtype), torch.ones(DIM, dtype=dtype), 1e-6) if qk_norm else None
    k_cache, v_cache = caches(cache_dtype)
    positions, slots = torch.arange(TOKENS), torch.arange(TOKENS)
    assert len(compiled_launches(monkeypatch, rotary, "_rotary_kernel", lambda: rotary.rotary_write_kv(
        positions, q, k, v, cos_sin, DIM, k_cache, v_cache, slots, scales(cache_dtype), qk_norm=norm))) == 1


@compiles
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_cache_write_compiles(monkeypatch, dtype):
    k, v = (torch.zeros(TOKENS, KV_HEADS, DIM, dtype=dtype) for _ in range(2))
    k_cache, v_cache = caches(FP8)
    assert len(compiled_launches(monkeypatch, kv_cache, "_write_kv_kernel", lambda: kv_cache.write_kv(
        k, v, k_cache, v_cache, torch.arange(TOKENS), scales(FP8)))) == 1


@compiles
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("max_query_len", [1, 4])   # decode and a prefill chunk (or a verify step)
@pytest.mark.parametrize("max_registers", [None, 128])
def test_attention_over_fp8_cache_compiles(monkeypatch, dtype, max_query_len, max_registers):
    num_seqs = TOKENS // max_query_len
    q = torch.zeros(TOKENS, Q_HEADS, DIM, dtype=dtype)
    k_cache, v_cache = caches(FP8)
    query_start_loc = torch.arange(0, TOKENS + 1, max_query_len, dtype=torch.int32)
    seq_lens = torch.full((num_seqs,), 40, dtype=torch.int32)
    tables = torch.zeros(num_seqs, BLOCKS, dtype=torch.int32)
    config = paged_attention.AttentionConfig(block_m=64, block_n=64, num_warps=4, num_stages=2,
                                             max_registers=max_registers)
    attention = lambda: paged_attention.paged_attention(   # noqa: E731
        q, k_cache, v_cache, query_start_loc, seq_lens, tables, max_query_len, 0.1, None, None, num_splits=1,
        config=config, kv_scales=scales(FP8))
    assert len(compiled_launches(monkeypatch, paged_attention, "_attention_kernel", attention)) == 1


@compiles
@pytest.mark.parametrize("sliding_window", [None, 40])
def test_fp8_decode_attention_reads_values_by_key_without_byte_loads(monkeypatch, sliding_window):
    """An FP8 V cache by key (kv_cache.empty_value_cache, what the engine allocates): the tuned decode tile reads
    it from shared memory in 8-byte words, where a V cache by dim took one ld.shared.b8 per value (128 a thread a
    64-key step: 1,488 SASS instructions in the loop against 847, bench/sass_stats.py's attention figures)."""
    q = torch.zeros(TOKENS, Q_HEADS, DIM, dtype=torch.bfloat16)
    ptx = {}
    for by_key in (False, True):
        k_cache, v_cache = caches(FP8)
        if by_key:
            v_cache = kv_cache.empty_value_cache(v_cache.shape, FP8, v_cache.device)
        attention = lambda k_cache=k_cache, v_cache=v_cache: paged_attention.paged_attention(   # noqa: E731
            q, k_cache, v_cache, torch.arange(TOKENS + 1, dtype=torch.int32),
            torch.full((TOKENS,), 40, dtype=torch.int32), torch.zeros(TOKENS, BLOCKS, dtype=torch.int32), 1,
            DIM ** -0.5, sliding_window, None, num_splits=1, kv_scales=scales(FP8),
            config=paged_attention.AttentionConfig(16, 64, 2, 3, max_registers=168))
        with monkeypatch.context() as patch:
            kernels = compiled_launches(patch, paged_attention, "_attention_kernel", attention)
        ptx[by_key] = kernels[0].asm["ptx"]
        # by dim the cap of 168 spilled 24 bytes (by key the tile holds 192 registers uncapped, 208 before); with a
        # window it spills 32 bytes by key too
        if by_key and not sliding_window:
            assert sm90.resource_usage(kernels[0])["STACK"] == 0, "spilled to local memory"
        if by_key:   # nothing read after the last K / V tile (the V scale had been: one more round trip at the end)
            lines = sm90.unpredicated(kernels[0])
            last_tile = max(i for i, line in enumerate(lines) if line.startswith("LDG.E.128"))
            assert not any(line.startswith("LDG") for line in lines[last_tile + 1:]), lines[last_tile + 1:][:40]
    assert ptx[False].count("ld.shared.b8") >= 128 and ptx[True].count("ld.shared.b8") == 0
    assert ptx[True].count("ld.shared.v2.b32") >= 64 and "cp.async" in ptx[True]


@compiles
@pytest.mark.parametrize("late", [False, True])
def test_norm_and_split_combination_under_pdl(monkeypatch, late):
    """The add + RMSNorm reads its weight before the PDL wait (no kernel writes it; quant_tiles.EARLY_WEIGHTS: 2
    loads a thread for 4096 bf16 over 8 warps), x and the residual right after it, and nothing after its first
    store (its weight had been a second round trip, read after the sum of squares). With pdl.LATE_TRIGGER
    (CVLLM_PDL_LATE_TRIGGER) the norm and the split-KV combination let their successor launch (PREEXIT) only after
    a store that needs their inputs; otherwise right after their wait (ACQBULK)."""
    pdl = importlib.import_module("cvllm_cuda.kernels.pdl")
    monkeypatch.setattr(pdl, "options", lambda device: {"USE_PDL": True, "launch_pdl": True})
    monkeypatch.setattr(pdl, "LATE_TRIGGER", late)
    rms_norm = importlib.import_module("cvllm_cuda.kernels.rms_norm")
    x = torch.zeros(1, 4096, dtype=torch.bfloat16)
    norm = lambda: rms_norm.fused_add_rms_norm(x, x, torch.ones(4096, dtype=torch.bfloat16), 1e-5)  # noqa: E731
    [norm_kernel] = compiled_launches(monkeypatch, rms_norm, "_add_rms_norm_kernel", norm)
    assert sm90.loads_before_wait(norm_kernel) == 2
    paged_attention = importlib.import_module("cvllm_cuda.kernels.paged_attention")
    monkeypatch.setattr(paged_attention, "_attention_kernel", sm90.LaunchRecorder(paged_attention._attention_kernel))
    attention = lambda: paged_attention.paged_attention(  # noqa: E731
        torch.zeros(1, Q_HEADS, DIM, dtype=torch.bfloat16), *caches(torch.bfloat16), torch.arange(2, dtype=torch.int32),
        torch.full((1,), 40, dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32), 1, DIM ** -0.5, None, None,
        num_splits=4)
    attention_splits = importlib.import_module("cvllm_cuda.kernels.attention_splits")
    [combine_kernel] = compiled_launches(monkeypatch, attention_splits, "_combine_splits_kernel", attention)
    for kernel in (norm_kernel, combine_kernel):
        lines = sm90.unpredicated(kernel)
        first_store = next(i for i, line in enumerate(lines) if line.startswith("STG"))
        [trigger] = [i for i, line in enumerate(lines) if line.startswith("PREEXIT")]
        [wait] = [i for i, line in enumerate(lines) if line.startswith("ACQBULK")]
        assert not any(line.startswith("LDG") for line in lines[first_store:])
        if late:
            assert trigger > first_store
        else:
            assert wait < trigger < min(i for i, line in enumerate(lines) if i > wait and line.startswith("LDG"))


@compiles
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_gated_activation_loads_gate_and_up_together(monkeypatch, act):
    """silu(gate) * up: ptxas had issued up's load after silu's math, which waits for gate (load_order.py); joined,
    both loads come before the first special-function instruction (exp, tanh's)."""
    activation = importlib.import_module("cvllm_cuda.kernels.activation")
    gate_up = torch.zeros(1, 2 * 14336, dtype=torch.bfloat16)
    call = lambda: (activation.silu_and_mul(gate_up) if act == "silu"  # noqa: E731
                    else activation.gelu_and_mul(gate_up, "tanh"))
    [kernel] = compiled_launches(monkeypatch, activation, "_gated_kernel", call)
    lines = sm90.unpredicated(kernel)
    loads = [i for i, line in enumerate(lines) if line.startswith("LDG")]
    first_math = min(i for i, line in enumerate(lines) if line.startswith("MUFU"))
    assert len(loads) == 2 and max(loads) < first_math, (loads, first_math)


@compiles
@pytest.mark.parametrize("report", [False, True])
def test_argmax_compiles(monkeypatch, report):
    """The sampler's argmax in bf16 logits, with and without the rows that are not finite reported."""
    argmax = importlib.import_module("cvllm_cuda.kernels.argmax")
    chunks = sm90.LaunchRecorder(argmax._chunk_argmax_kernel)
    monkeypatch.setattr(argmax, "_chunk_argmax_kernel", chunks)
    logits = torch.zeros(5, 49152, dtype=torch.bfloat16)
    kernels = compiled_launches(monkeypatch, argmax, "_row_argmax_kernel",
                                lambda: argmax.argmax_reported(logits) if report else argmax.argmax(logits))
    assert len(kernels) == 1 and len(chunks.launches) == 1
    sm90.compile_launch(chunks.fn, *chunks.launches[0])


@compiles
def test_lagged_fixup_compiles(monkeypatch):
    """A lagged verify step's inputs put in place (device drafts), with the tables in the graphs' row stride."""
    lagged = importlib.import_module("cvllm_cuda.kernels.lagged_fixup")
    rows, seqs = 10, 2
    tables = torch.zeros(seqs, 16, dtype=torch.int32)[:, :4]
    fill = torch.stack([torch.arange(rows), torch.arange(rows)])
    fixup = lambda: lagged.lagged_fixup(   # noqa: E731
        torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64),
        torch.zeros(seqs, dtype=torch.int32), torch.zeros(rows, dtype=torch.int64), tables, fill,
        torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64), 16)
    assert len(compiled_launches(monkeypatch, lagged, "_lagged_fixup_kernel", fixup)) == 1


@compiles
@pytest.mark.parametrize("low_bits", [2, 4, 8])
@pytest.mark.parametrize("rows", [1, 5])
def test_producers_of_int8_activations_compile(monkeypatch, low_bits, rows):
    """RMSNorm (Llama-3-8B's 4096), silu * up and gelu * up (14336) and the attention's split combination
    (128-wide heads) making a low-bit GEMV's int8 activations beside their bf16 outputs (int8_activations.py), a
    decode step's rows and a verify step's, and the quantizer kernel alone."""
    from types import SimpleNamespace

    from test_quant_matmul import LAYOUTS
    activation, int8_activations, rms_norm = (importlib.import_module(f"cvllm_cuda.kernels.{name}")
                                              for name in ("activation", "int8_activations", "rms_norm"))
    layout = dataclasses.replace(next(lay for lay in LAYOUTS.values() if lay.low_bits == low_bits and
                                      not lay.high_bits), int8_activations=True)
    layers = {k: SimpleNamespace(quant_weight=SimpleNamespace(layout=layout, in_features=k, handed=None))
              for k in (4096, 14336, Q_HEADS * DIM)}

    def made_int8(k):   # the producer's launch took the int8 variant and handed its form over (then cleared)
        handed, layers[k].quant_weight.handed = layers[k].quant_weight.handed, None
        return handed is not None and handed[1] == low_bits

    x = torch.zeros(rows, 4096, dtype=torch.bfloat16)
    norm = lambda: rms_norm.fused_add_rms_norm(x, x, torch.ones(4096, dtype=torch.bfloat16), 1e-5,  # noqa: E731
                                               feeds=layers[4096])
    assert len(compiled_launches(monkeypatch, rms_norm, "_add_rms_norm_kernel", norm)) == 1 and made_int8(4096)
    gate_up = torch.zeros(rows, 2 * 14336, dtype=torch.bfloat16)
    both = lambda: (activation.silu_and_mul(gate_up, feeds=layers[14336]),  # noqa: E731
                    made_int8(14336) and activation.gelu_and_mul(gate_up, "tanh", feeds=layers[14336]))
    assert len(compiled_launches(monkeypatch, activation, "_gated_kernel", both)) == 2 and made_int8(14336)
    alone = lambda: int8_activations.quantize_activations(x, low_bits)  # noqa: E731
    assert len(compiled_launches(monkeypatch, int8_activations, "_quantize_kernel", alone)) == 1
    paged_attention = importlib.import_module("cvllm_cuda.kernels.paged_attention")
    q, cache = torch.zeros(rows, Q_HEADS, DIM, dtype=torch.bfloat16), caches(torch.bfloat16)
    lens = torch.full((rows,), 40, dtype=torch.int32)
    attention = lambda: paged_attention.paged_attention(  # noqa: E731
        q, *cache, torch.arange(rows + 1, dtype=torch.int32), lens, torch.zeros(rows, 4, dtype=torch.int32), 1,
        DIM ** -0.5, None, None, num_splits=4, feeds=layers[Q_HEADS * DIM])
    monkeypatch.setattr(paged_attention, "_attention_kernel", sm90.LaunchRecorder(paged_attention._attention_kernel))
    attention_splits = importlib.import_module("cvllm_cuda.kernels.attention_splits")
    assert len(compiled_launches(monkeypatch, attention_splits, "_combine_splits_kernel", attention)) == 1
    assert made_int8(Q_HEADS * DIM)
