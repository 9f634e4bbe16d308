"""LazyTensor (cvllm/checkpoint/lazy.py): narrowing reads nothing and composes, ``materialize`` reads exactly the
part narrowed to, and who gets lazy tensors: only loaders marked ``lazy_aware``, only when asked for (``weights(lazy=
True)``, a tensor-parallel rank). World size 1 still loads views of the safetensors mapping, never copies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from cvllm.checkpoint.base import Checkpoint
from cvllm.checkpoint.lazy import LazyTensor, lazy_aware, materialize, view_reader
from cvllm.checkpoint.safetensors_files import iterate_safetensors
from cvllm.distributed import set_tensor_parallel
from cvllm.layers.embedding import VocabParallelEmbedding
from cvllm.weight_loading import load_weights_by_name


def recording(tensor: torch.Tensor) -> tuple[LazyTensor, list]:
    boxes = []

    def read(box):
        boxes.append(box)
        return view_reader(tensor)(box)

    return LazyTensor(tensor.shape, tensor.dtype, read), boxes


def test_narrowing_composes_and_reads_only_the_part():
    full = torch.arange(6 * 8 * 4).view(6, 8, 4)
    lazy, boxes = recording(full)
    part = lazy.narrow(1, 2, 5).narrow(-1, 1, 2).narrow(1, 1, 3)
    assert boxes == [] and part.shape == (6, 3, 2) and part.nbytes == 36 * full.element_size()
    assert torch.equal(part.materialize(), full.narrow(1, 2, 5).narrow(-1, 1, 2).narrow(1, 1, 3))
    assert boxes == [((0, 6), (3, 3), (1, 2))]


@pytest.mark.parametrize("size, chunks", [(8, 2), (7, 3), (2, 4)])
def test_chunk_is_torch_chunk(size, chunks):
    full = torch.randn(3, size)
    lazy, _ = recording(full)
    parts = lazy.chunk(chunks, dim=-1)
    assert all(torch.equal(p.materialize(), t) for p, t in zip(parts, full.chunk(chunks, dim=-1), strict=True))


def test_narrow_out_of_range_and_a_reader_of_the_wrong_shape():
    lazy, _ = recording(torch.zeros(4, 4))
    with pytest.raises(IndexError, match=r"narrow\(0, 3, 2\) out of range"):
        lazy.narrow(0, 3, 2)
    wrong = LazyTensor((4, 4), torch.float32, lambda box: torch.zeros(4, 3))
    with pytest.raises(RuntimeError, match=r"returned shape \(4, 3\) for a part of shape \(4, 4\)"):
        wrong.materialize()


def test_weights_are_read_whole_unless_asked_for_lazy():
    full = torch.randn(4, 4)
    lazy, _ = recording(full)
    checkpoint = Checkpoint(path=Path("x"), config=None, weight_iterator=lambda: iter([("a", lazy), ("b", full)]))
    read = dict(checkpoint.weights())
    assert torch.equal(read["a"], full) and read["b"] is full
    assert dict(checkpoint.weights(lazy=True))["a"] is lazy
    assert materialize(full) is full


def test_only_lazy_aware_loaders_get_lazy_tensors():
    model = nn.Module()
    model.plain = nn.Parameter(torch.zeros(2, 3), requires_grad=False)     # default loader
    model.custom = nn.Parameter(torch.zeros(2, 3), requires_grad=False)    # a loader that predates lazy tensors
    model.aware = nn.Parameter(torch.zeros(2, 3), requires_grad=False)
    seen = {}
    model.custom.weight_loader = lambda param, loaded: (seen.__setitem__("custom", loaded), param.copy_(loaded))
    model.aware.weight_loader = lazy_aware(lambda param, loaded: (seen.__setitem__("aware", loaded),
                                                                  param.copy_(loaded.materialize())))
    values = torch.arange(6.0).view(2, 3)
    loaded = load_weights_by_name(model, [(name, recording(values)[0]) for name in ("plain", "custom", "aware")])
    assert loaded == {"plain", "custom", "aware"}
    assert type(seen["custom"]) is torch.Tensor and isinstance(seen["aware"], LazyTensor)
    assert all(torch.equal(p, values) for p in model.parameters())


def test_world_size_one_loads_views_of_the_mapping(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(8, 4)}, str(path))
    (name, lazy), = iterate_safetensors([path])
    assert isinstance(lazy, LazyTensor)
    first, second = lazy.materialize(), lazy.materialize()
    assert first.data_ptr() == second.data_ptr()   # the same bytes of the mapping both times: nothing copied
    assert lazy.narrow(0, 4, 4).materialize().data_ptr() == first.data_ptr() + 4 * 4 * 4


def test_embedding_rank_past_the_vocabulary_reads_nothing():
    """5 tokens over 4 ranks (2 a rank): rank 2 keeps 1 row and a zero pad, rank 3 none at all."""
    table = torch.randn(5, 3)
    for rank, kept in ((2, 1), (3, 0)):
        set_tensor_parallel(rank, 4)
        try:
            embedding = VocabParallelEmbedding(5, 3)
        finally:
            set_tensor_parallel(0, 1)
        lazy, boxes = recording(table)
        embedding.weight_loader(embedding.weight, lazy)
        assert boxes == [((min(rank * 2, 5), kept), (0, 3))]
        assert torch.equal(embedding.weight.data[:kept], table[rank * 2:][:kept]) and not embedding.weight[kept:].any()
