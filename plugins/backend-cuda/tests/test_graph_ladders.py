"""The shapes the CUDA graphs are captured for (cvllm_cuda/graphs.py): decode batch sizes and lone prefill chunks.
Plain functions: these run without a GPU."""

from __future__ import annotations

import pytest

from cvllm_cuda.graphs import batch_size_ladder, chunk_ladder


def test_batch_sizes_pad_at_most_seven_rows_above_eight():
    assert batch_size_ladder(256)[:6] == [1, 2, 4, 8, 16, 24] and batch_size_ladder(256)[-1] == 256
    assert batch_size_ladder(3) == [1, 2, 3]


@pytest.mark.parametrize("most, sizes", [
    (64, [8, 16, 32, 64]), (100, [8, 16, 32, 64, 100]), (16, [8, 16]), (5, [5]), (1, []), (0, []),
])
def test_chunk_lengths_double_from_eight_up_to_the_longest(most, sizes):
    assert chunk_ladder(most) == sizes
