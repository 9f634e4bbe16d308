"""The metal backend as the engine meets it: registered through its entry point, chosen by priority only where it is
available, its memory figures (unified memory on MPS) turned into a KV pool by --mem / --kv-fraction, its device
and dtype rules. The MPS figures come from a faked torch.mps here: no Mac ran these."""

from __future__ import annotations

import logging

import pytest
import torch

from cvllm import plugins
from cvllm.backends.cpu import CpuBackend
from cvllm.backends.selection import select_backend
from cvllm.engine.build import kv_blocks
from cvllm.engine.config import EngineConfig
from cvllm_metal import backend as backend_module
from cvllm_metal import device
from cvllm_metal.backend import MetalBackend

GiB = 1 << 30


def test_registered_through_the_entry_point():
    assert "metal" in plugins.backends().names()
    assert plugins.backends().get("metal") is MetalBackend


@pytest.mark.skipif(device.mps_available(), reason="a machine with MPS picks the metal backend")
def test_a_machine_without_mps_keeps_the_cpu_backend(monkeypatch):
    """Installed on a machine without MPS (CI's), the metal backend is not available and the CPU backend runs;
    naming it is an error that says so."""
    monkeypatch.delenv(device.ON_CPU_ENV, raising=False)
    assert not MetalBackend.is_available()
    assert type(select_backend(None)) is CpuBackend
    with pytest.raises(RuntimeError, match="backend 'metal' is installed but not available"):
        select_backend("metal")


def test_where_mps_is_there_the_metal_backend_wins(monkeypatch):
    monkeypatch.delenv(device.ON_CPU_ENV, raising=False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert MetalBackend.is_available()
    assert MetalBackend.priority > CpuBackend.priority
    monkeypatch.setattr(MetalBackend, "__init__", lambda self: None)   # no Metal device to build here
    assert type(select_backend(None)) is MetalBackend


def test_the_test_flag_runs_it_on_the_cpu(monkeypatch):
    monkeypatch.setenv(device.ON_CPU_ENV, "1")
    backend = select_backend(None)
    assert type(backend) is MetalBackend and backend.device == torch.device("cpu")
    assert backend.default_dtype == torch.bfloat16   # the CPU has bf16
    assert MetalBackend(device="cpu").device.type == "cpu"


def test_one_device():
    MetalBackend.bind_device(0)
    with pytest.raises(ValueError, match="one device"):
        MetalBackend.bind_device(1)


@pytest.mark.parametrize("release, bf16", [("14.5", True), ("15.0", True), ("13.6.1", False), ("", False)])
def test_bfloat16_needs_macos_14(monkeypatch, release, bf16):
    monkeypatch.setattr(device.platform, "mac_ver", lambda: (release, ("", "", ""), ""))
    assert device.bf16_supported(torch.device("mps")) is bf16
    assert device.bf16_supported(torch.device("cpu"))


@pytest.fixture
def fake_mps(monkeypatch):
    """torch.mps's memory figures for a 16 GiB Mac: 10.67 GiB recommended working set, 2 GiB held by the driver."""
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 16 * GiB * 2 // 3)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 2 * GiB)
    monkeypatch.setattr(backend_module, "_logged", [])
    monkeypatch.setattr(device.platform, "mac_ver", lambda: ("14.5", ("", "", ""), ""))


def test_unified_memory_figures(fake_mps, monkeypatch):
    free, total = MetalBackend(device="mps").memory()
    assert (free, total) == (16 * GiB * 2 // 3 - 2 * GiB, 16 * GiB * 2 // 3)
    # torch without recommended_max_memory (or a device that refuses): two thirds of the RAM
    monkeypatch.delattr(torch.mps, "recommended_max_memory")
    monkeypatch.setattr(device, "physical_memory", lambda: 12 * GiB)
    assert device.mps_memory() == (6 * GiB, 8 * GiB)

    def refuses():
        raise RuntimeError("no MPS")

    monkeypatch.setattr(torch.mps, "driver_allocated_memory", refuses)
    monkeypatch.setattr(torch.mps, "current_allocated_memory", lambda: 1 * GiB)
    assert device.mps_memory() == (7 * GiB, 8 * GiB)


def test_kv_pool_from_unified_memory(fake_mps):
    """core's sizing (engine/build.py) over the metal backend's figures: --mem, --kv-fraction, the default."""
    backend = MetalBackend(device="mps")
    memory = backend.memory()
    free = memory[0]
    per_block = 1 << 20   # 1 MiB blocks

    def blocks(**settings) -> int:
        return kv_blocks(EngineConfig(model="m", **settings), backend, memory, per_block, max_model_len=1 << 20,
                         max_num_seqs=256)

    assert blocks(kv_cache_memory=3 * GiB) == 3 * 1024                    # --mem 3072
    assert blocks(kv_fraction=0.25) == int(free * 0.25) // per_block      # --kv-fraction 0.25
    assert blocks() == free // 2 // per_block                            # unified memory: half of what is free
    assert blocks(kv_cache_memory=3 * GiB, kv_fraction=0.25) == 3 * 1024  # --mem wins


def test_on_the_cpu_it_sizes_as_the_cpu_backend_does():
    metal, cpu = MetalBackend(device="cpu"), CpuBackend()
    assert metal.default_kv_cache_bytes(10 * GiB) == cpu.default_kv_cache_bytes(10 * GiB)
    assert metal.default_kv_cache_bytes(2 * GiB) == cpu.default_kv_cache_bytes(2 * GiB)
    assert metal.memory()[1] == cpu.memory()[1]


def test_on_mps_it_says_what_it_does_not_do(fake_mps, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="cvllm_metal.backend"):
        assert MetalBackend(device="mps").default_dtype == torch.bfloat16
        MetalBackend(device="mps")   # once per process
    assert caplog.text.count("quantized checkpoints (GGUF, GPTQ/AWQ, FP8) are dequantized at load on MPS") == 1
    assert "bfloat16 needs macOS 14" not in caplog.text
    caplog.clear()
    monkeypatch.setattr(backend_module, "_logged", [])
    monkeypatch.setattr(device.platform, "mac_ver", lambda: ("13.6", ("", "", ""), ""))
    with caplog.at_level(logging.WARNING, logger="cvllm_metal.backend"):
        assert MetalBackend(device="mps").default_dtype == torch.float16
    assert "serve a bf16 checkpoint with --dtype float16" in caplog.text


def test_device_calls_stay_off_mps_on_the_cpu(monkeypatch):
    """synchronize, events and the cache release touch torch.mps only on MPS (the CPU's work is the host's)."""
    def no_mps(*args, **kwargs):
        raise AssertionError("torch.mps called for a CPU backend")

    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.mps, name, no_mps)
    backend = MetalBackend(device="cpu")
    backend.synchronize()
    backend.empty_cache()
    assert backend.record_event() is None
