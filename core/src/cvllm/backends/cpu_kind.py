"""What kind of CPU the backend runs on, told once at start: the vector width torch dispatches its kernels to
(``torch.backends.cpu.get_cpu_capability()``, which ``ATEN_CPU_CAPABILITY`` can lower) and whether the chip computes
bf16 natively (the avx512_bf16 / amx_bf16 flags of /proc/cpuinfo).

The fast path's activation dtype is bf16 on every kind (a quantized GGUF's ``--dtype auto``): with the weights kept
int4-packed, torch's int4 matmul has vectorised kernels for bf16 activations only (AVX-512 and AVX2 alike), and
float32 or float16 activations take its scalar path, measured 45-250x slower a layer on this 2-core VM under both
kinds (bench/results/2026-12-03-cpu-dtype_by_kind.json: a demo layer at batch 1, bf16 0.18 ms on AVX-512 and 0.31
on AVX2, float32 25 and 14 ms). On a chip without native bf16 the bf16 values are widened
to float32 in registers, which costs little next to reading the weights. ``--dtype float32`` is the exact path
(weights dequantized to float32 once, plain matmuls)."""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


def native_bf16() -> bool:
    """bf16 computed natively: the chip has the instructions and torch dispatches to its AVX-512 kernels."""
    return capability() == "AVX512" and any(flag in cpu_flags() for flag in NATIVE_BF16_FLAGS)


@functools.cache
def log_kind() -> str:
    """Logs (once a process) and returns the line that says which kernels this CPU gets."""
    flags = [flag for flag in NATIVE_BF16_FLAGS if flag in cpu_flags()]
    line = (f"CPU kernels: torch {capability()}"
            f"{', native bf16 (' + ', '.join(flags) + ')' if native_bf16() else ', bf16 widened to float32'}; "
            "fast path: bf16 activations, quantized weights int4-packed (--dtype float32: the exact path)")
    logger.info(line)
    return line
