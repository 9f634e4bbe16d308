"""The step's integer inputs travel to a device in one upload (engine/step_inputs.py): each comes back in its own
dtype and shape, at a 16-byte-aligned address whatever the sizes before it (Triton compiles one kernel variant per
pointer alignment, so an alignment that followed the token count would compile new variants mid-serving)."""

from __future__ import annotations

import pytest
import torch

from cvllm.engine import step_inputs
from cvllm.engine.step_inputs import HostStep, host_step_from_packed, pack, to_device


class _Device:
    """A backend whose device is not the CPU (the upload below hands back the packed host tensor itself)."""
    device = torch.device("meta")


@pytest.fixture
def uploaded(monkeypatch):
    monkeypatch.setattr(step_inputs, "upload", lambda packed, device: packed)


@pytest.mark.parametrize("tokens", [1, 2, 3, 7, 8, 255, 256])
@pytest.mark.parametrize("seqs", [1, 3, 16])
def test_inputs_come_back_equal_and_16_byte_aligned(uploaded, tokens, seqs):
    g = torch.Generator().manual_seed(tokens * 100 + seqs)
    inputs = [torch.randint(0, 1 << 40, (tokens,), generator=g),                      # input ids, int64
              torch.randint(0, 1 << 20, (tokens,), generator=g),                      # positions
              torch.randint(0, 1 << 20, (seqs + 1,), generator=g, dtype=torch.int32),  # query starts
              torch.randint(0, 1 << 20, (seqs,), generator=g, dtype=torch.int32),      # sequence lengths
              torch.randint(0, 1 << 30, (tokens,), generator=g),                      # slots
              torch.randint(0, 1 << 20, (seqs, 5), generator=g, dtype=torch.int32),   # block tables
              torch.arange(tokens),                                                    # logits rows
              torch.zeros(2, 0, dtype=torch.long)]                                    # nothing to fill in
    query_start = inputs[2].tolist()
    host = HostStep(inputs, query_start, [b - a for a, b in zip(query_start, query_start[1:])], inputs[3].tolist(),
                    False)
    ids, positions, ctx, logits_indices = to_device(host, _Device(), 16)
    out = [ids, positions, ctx.query_start_loc, ctx.seq_lens, ctx.slot_mapping, ctx.block_tables, logits_indices]
    base = out[0].data_ptr()
    for sent, got in zip(inputs, out):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)
        assert (got.data_ptr() - base) % 16 == 0, "each input starts at a 16-byte boundary"


def test_a_receiving_rank_rebuilds_the_same_step_from_the_packed_bytes():
    """Tensor parallelism sends ``pack(host.tensors)``; the receiver's HostStep equals the sender's."""
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randint(0, 1000, (5,), generator=g), torch.arange(5), torch.tensor([0, 1, 5], dtype=torch.int32),
               torch.tensor([9, 12], dtype=torch.int32), torch.randint(0, 99, (5,), generator=g),
               torch.randint(0, 50, (2, 3), generator=g, dtype=torch.int32), torch.tensor([0, 4]),
               torch.tensor([[0], [1]])]
    sent = HostStep(tensors, [0, 1, 5], [1, 4], [9, 12], False)
    got = host_step_from_packed(pack(tensors).clone(), 5, 2, 3, 2, 1, False)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(sent.tensors, got.tensors))
    assert (got.query_start, got.query_lens, got.seq_lens, got.num_fill) == ([0, 1, 5], [1, 4], [9, 12], 1)
