"""The shared switch of the low-bit kernels (cvllm.layers.quantization.plane_kernels_usable)."""

from __future__ import annotations

import torch


def test_plane_kernels_are_used_on_cuda_devices_unless_turned_off(monkeypatch):
    """Every quantization plugin asks this one switch (CVLLM_QUANT_KERNELS) whether a layer takes the CUDA
    backend's low-bit kernels."""
    from cvllm.layers.quantization import QUANT_KERNELS_ENV, plane_kernels_usable

    monkeypatch.delenv(QUANT_KERNELS_ENV, raising=False)
    assert not plane_kernels_usable(torch.device("cpu"))
    try:
        import cvllm_cuda.kernels.quant_matmul  # noqa: F401
        importable = True
    except ImportError:
        importable = False
    assert plane_kernels_usable(torch.device("cuda")) == importable
    monkeypatch.setenv(QUANT_KERNELS_ENV, "0")
    assert not plane_kernels_usable(torch.device("cuda"))
