"""The step's integer inputs travel to a device in one upload (ModelRunner._to_device): each comes back in its own
dtype and shape, at a 16-byte-aligned address whatever the sizes before it (Triton compiles one kernel variant per
pointer alignment, so an alignment that followed the token count would compile new variants mid-serving)."""

from __future__ import annotations

import pytest
import torch

import cvllm.engine.model_runner as model_runner
from cvllm.engine.model_runner import ModelRunner


@pytest.fixture
def runner(monkeypatch):
    """A runner whose device is not the CPU, and whose upload hands back the packed host tensor itself."""
    runner = ModelRunner.__new__(ModelRunner)   # _to_device needs no model
    runner.device = torch.device("meta")
    monkeypatch.setattr(model_runner, "upload", lambda packed, device: packed)
    return runner


@pytest.mark.parametrize("tokens", [1, 2, 3, 7, 8, 255, 256])
@pytest.mark.parametrize("seqs", [1, 3, 16])
def test_inputs_come_back_equal_and_16_byte_aligned(runner, tokens, seqs):
    g = torch.Generator().manual_seed(tokens * 100 + seqs)
    inputs = [torch.randint(0, 1 << 40, (tokens,), generator=g),                      # input ids, int64
              torch.randint(0, 1 << 20, (tokens,), generator=g),                      # positions
              torch.randint(0, 1 << 20, (seqs + 1,), generator=g, dtype=torch.int32),  # query starts
              torch.randint(0, 1 << 20, (seqs,), generator=g, dtype=torch.int32),      # sequence lengths
              torch.randint(0, 1 << 30, (tokens,), generator=g),                      # slots
              torch.randint(0, 1 << 20, (seqs, 5), generator=g, dtype=torch.int32),   # block tables
              torch.zeros(2, 0, dtype=torch.long)]                                    # nothing to fill in
    out = runner._to_device(*inputs)
    base = out[0].data_ptr()
    for sent, got in zip(inputs, out):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)
        assert (got.data_ptr() - base) % 16 == 0, "each input starts at a 16-byte boundary"
