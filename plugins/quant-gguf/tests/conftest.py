"""Random GGML blocks for the oracle tests (the gguf package's numpy code is the reference), and the demo
model for the end-to-end ones."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

# the block kernels (cvllm_gguf.kernels) run in Triton's CPU interpreter without a GPU; Triton reads this when a
# kernel is decorated, i.e. before a test module imports them (as plugins/backend-cuda/tests/conftest.py does)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cvllm.testing.requirements import demo_model  # noqa: E402
from cvllm.testing.threads import one_torch_thread as single_torch_thread  # noqa: E402
from cvllm_gguf.quant_types import FLOAT_DTYPES, FORMATS, GGMLType  # noqa: E402

# byte offsets of the f16 scale fields in each block type: random bytes there could be NaN/inf,
# which the tests replace by random finite halves (the quant fields stay fully random)
F16_FIELDS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,), GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,), GGMLType.Q2_K: (80, 82), GGMLType.Q3_K: (108,), GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,),
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    # triton 3.6's interpreter converts 1-element arrays to ints the way numpy deprecated: hundreds per test
    config.addinivalue_line("filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def finite_half_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """Uniformly random f16 bit patterns except inf/NaN (exponent 31): zeros, subnormals, huge values."""
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    special = (bits & 0x7C00) == 0x7C00
    bits[special] ^= 0x4000  # clear the exponent's top bit: now a finite number
    return bits


def random_raw(qtype: GGMLType, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Raw bytes [*shape[:-1], bytes_per_row] of random blocks with finite scales."""
    fmt = FORMATS[qtype]
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    n_blocks = rows * shape[-1] // fmt.block_size
    blocks = rng.integers(0, 256, size=(n_blocks, fmt.type_size), dtype=np.uint8)
    if qtype == GGMLType.F32:
        blocks = rng.standard_normal(n_blocks).astype(np.float32).view(np.uint8).reshape(n_blocks, 4)
    elif qtype in (GGMLType.F16, GGMLType.BF16):
        half = finite_half_bits(rng, n_blocks) if qtype == GGMLType.F16 else \
            (rng.standard_normal(n_blocks).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        blocks = half.view(np.uint8).reshape(n_blocks, 2)
    for offset in F16_FIELDS.get(qtype, ()):
        blocks[:, offset:offset + 2] = finite_half_bits(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(*shape[:-1], shape[-1] // fmt.block_size * fmt.type_size)


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 from the cache `cvllm fetch-demo` filled: skipped without it, an error in CI."""
    return demo_model()


@pytest.fixture
def make_raw():
    return random_raw


@pytest.fixture(scope="module")
def one_torch_thread():
    with single_torch_thread():
        yield


def weight_rows(qtype: GGMLType, out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Raw rows [out, bytes_per_row] like a checkpoint's: random quants, scales of real size (~1e-3)."""
    rng = np.random.default_rng(seed)
    if qtype in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        w = torch.from_numpy(rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.05)
        return w.to(FLOAT_DTYPES[qtype]).view(torch.uint8)
    raw = random_raw(qtype, (out_features, in_features), rng)
    blocks = raw.reshape(-1, FORMATS[qtype].type_size)
    for offset in F16_FIELDS[qtype]:
        scales = rng.uniform(1e-4, 2e-3, size=blocks.shape[0]).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw)


@pytest.fixture
def make_rows():
    return weight_rows
