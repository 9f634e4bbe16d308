"""weight_loading.transform_weights / split_rows: a checkpoint tensor stored fused or stacked, cut into what the
layers load; a lazy tensor is cut without being read; a transform that fails names the checkpoint tensor."""

from __future__ import annotations

import pytest
import torch

from cvllm.checkpoint.base import CheckpointError
from cvllm.checkpoint.lazy import LazyTensor
from cvllm.weight_loading import split_rows, transform_weights

QKV = dict([split_rows(".qkv_proj.", [(".q_proj.", 4), (".k_proj.", 2), (".v_proj.", 2)])])


def test_fused_rows_are_cut_into_named_parts_and_the_rest_pass_through():
    qkv = torch.arange(8 * 3).reshape(8, 3)
    out = dict(transform_weights([("l.0.qkv_proj.weight", qkv), ("l.0.o_proj.weight", qkv)], QKV))
    assert list(out) == ["l.0.q_proj.weight", "l.0.k_proj.weight", "l.0.v_proj.weight", "l.0.o_proj.weight"]
    assert torch.equal(torch.cat([out["l.0.q_proj.weight"], out["l.0.k_proj.weight"], out["l.0.v_proj.weight"]]),
                       qkv)
    assert out["l.0.o_proj.weight"] is qkv


def test_other_suffixes_of_a_fused_layer_are_left_whole():
    scale = torch.ones(3)
    assert dict(transform_weights([("l.0.qkv_proj.input_scale", scale)], QKV)) == {"l.0.qkv_proj.input_scale": scale}


def test_a_wrong_row_count_is_a_checkpoint_error_naming_the_tensor():
    with pytest.raises(CheckpointError, match=r"cannot load 'l\.3\.qkv_proj\.weight': 9 rows; the config says 8 "
                                              r"\(q_proj 4 \+ k_proj 2 \+ v_proj 2\)"):
        list(transform_weights([("l.3.qkv_proj.weight", torch.zeros(9, 3))], QKV))


def test_any_failing_transform_is_wrapped():
    def broken(name, tensor):
        raise RuntimeError("shape '[2, -1]' is invalid")
        yield

    with pytest.raises(CheckpointError, match=r"cannot load 'x\.norm\.weight': shape"):
        list(transform_weights([("x.norm.weight", torch.zeros(3))], {".norm.": broken}))


def test_lazy_tensors_are_cut_without_being_read():
    full = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    reads = []

    def read(box):
        reads.append(box)
        return full[tuple(slice(start, start + length) for start, length in box)]

    parts = dict(transform_weights([("l.0.qkv_proj.weight", LazyTensor((8, 3), torch.float32, read))], QKV))
    assert not reads and all(isinstance(t, LazyTensor) for t in parts.values())
    assert torch.equal(parts["l.0.k_proj.weight"].materialize(), full[4:6])
    assert reads == [((4, 2), (0, 3))]
