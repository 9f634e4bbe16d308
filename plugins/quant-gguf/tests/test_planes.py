"""GGUF blocks repacked into the CUDA matmul's plane layout keep every value: the layout's reference dequantization
equals dequant.py's bit for bit, for every type, on random blocks (random quants, random finite f16 scales)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("cvllm_cuda")

from cvllm_cuda.quant_planes import dequantize_planes  # noqa: E402
from cvllm_gguf.dequant import dequantize  # noqa: E402
from cvllm_gguf.planes import LAYOUTS, to_planes  # noqa: E402
from cvllm_gguf.quant_types import FORMATS, GGMLType, row_bytes  # noqa: E402

TYPES = sorted(LAYOUTS)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_planes_hold_the_same_values(qtype, make_raw):
    n, k = 6, 512
    raw = torch.from_numpy(make_raw(qtype, (n, k), np.random.default_rng(int(qtype))))
    planes = to_planes(raw, qtype, k)
    expected = dequantize(raw, qtype, (n, k))
    got = dequantize_planes(planes)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_planes_take_about_the_file_bytes(qtype, make_raw):
    n, k = 4, 1024
    raw = torch.from_numpy(make_raw(qtype, (n, k), np.random.default_rng(1)))
    planes = to_planes(raw, qtype, k)
    file_bytes = n * row_bytes(qtype, k)
    extra = planes.nbytes() / file_bytes - 1
    # only the K-quants' packed 6-bit (or 4+4-bit) scales grow, one byte each
    assert 0 <= extra <= (0.2 if qtype == GGMLType.Q2_K else 0.04), (qtype.name, extra)
    assert planes.low.dtype == torch.int32 and planes.low.is_contiguous()
    assert FORMATS[qtype].block_size in (32, 256)


def test_large_weights_are_repacked_in_row_slices(make_raw, monkeypatch):
    import cvllm_gguf.planes as planes_module

    monkeypatch.setattr(planes_module, "_CHUNK_ELEMENTS", 3 * 256)
    raw = torch.from_numpy(make_raw(GGMLType.Q4_K, (10, 256), np.random.default_rng(2)))
    planes = to_planes(raw, GGMLType.Q4_K, 256)
    assert planes.low.shape == (256 * 4 // 32, 10)
    assert torch.equal(dequantize_planes(planes), dequantize(raw, GGMLType.Q4_K, (10, 256)))
