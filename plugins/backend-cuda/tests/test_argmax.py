"""The argmax kernel (kernels/argmax.py) against torch.argmax: first index of the maximum, NaN ranking highest,
rows of -inf, vocabularies that are no multiple of its chunk; in Triton's interpreter and compiled on a GPU, and
inside the sampler (greedy rows and the exponential race) where the engine hands it over."""

from __future__ import annotations

import os

import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")  # a skip locally, an error under CI=true

from cvllm_cuda.kernels.argmax import CHUNK, argmax, argmax_reported  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                               reason="needs a CUDA device and compiled (not interpreted) Triton")


def awkward_rows(generator: torch.Generator, rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows, then: a tie across chunks, all -inf, +inf and NaN together, NaN in the last chunk only."""
    x = torch.randn(rows, vocab, generator=generator).to(dtype)
    if rows >= 5:
        x[1, vocab - 1] = x[1, min(CHUNK // 2, vocab // 3)] = x[1].max() + 1   # the first of the tie wins
        x[2] = float("-inf")
        x[3, 7], x[3, vocab // 2] = float("inf"), float("nan")  # NaN outranks +inf
        x[4, vocab - 2] = float("nan")
    return x.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,vocab", [(5, 3 * CHUNK + 17), (6, 100), (1, CHUNK)])
def test_argmax_matches_torch(generator, dtype, rows, vocab):
    x = awkward_rows(generator, rows, vocab, dtype)
    assert torch.equal(argmax(x), x.argmax(dim=-1))


def reported_reference(x: torch.Tensor) -> torch.Tensor:
    """What the sampler tells the host for a greedy row: the argmax, -1 where the row holds NaN or +inf."""
    return torch.where(x.amax(dim=-1) < float("inf"), x.argmax(dim=-1), -1)


@pytest.mark.parametrize("rows,vocab", [(5, 3 * CHUNK + 17), (6, 100)])
def test_argmax_reported_flags_rows_that_are_not_finite(generator, rows, vocab):
    x = awkward_rows(generator, rows, vocab, torch.float32)
    x[0, 3] = float("inf")                 # +inf alone: not finite
    if rows > 5:
        x[5, vocab - 1] = float("nan")     # NaN in the last chunk only
    ids, reported = argmax_reported(x)
    assert torch.equal(ids, x.argmax(dim=-1)) and torch.equal(reported, reported_reference(x))
    assert (reported == -1).sum() == (4 if rows > 5 else 3)   # rows 0, 3, 4 (and 5); row 2 (all -inf) is finite


def test_the_sampler_takes_the_argmax_it_is_given(generator):
    from cvllm.engine.sampler import Sampler
    from cvllm.sampling_params import SamplingParams

    class Row:
        def __init__(self, i, params):
            self.seq_id, self.sampling_params, self.token_ids, self.num_prompt_tokens = i, params, [1, 2], 2
            self.generator = torch.Generator(device=DEVICE).manual_seed(i) if params.seed is not None else None
            self.min_tokens_stop_ids = []

    logits = torch.randn(4, 3000, generator=generator).to(DEVICE)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=3),
              SamplingParams(temperature=0), SamplingParams(temperature=1.2, top_k=50, seed=9)]
    calls = []
    sampler, reference = Sampler(), Sampler()
    sampler.argmax = lambda t: calls.append(t.shape) or argmax(t)
    got = sampler(logits, [Row(i, p) for i, p in enumerate(params)]).token_ids
    want = reference(logits, [Row(i, p) for i, p in enumerate(params)]).token_ids
    assert torch.equal(got, want) and len(calls) == 2   # the greedy argmax and the race's


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 128256), (256, 151936), (64, 32000), (7, 50)])
def test_argmax_on_the_gpu(generator, dtype, rows, vocab):
    x = awkward_rows(generator, rows, vocab, dtype)
    assert torch.equal(argmax(x), x.argmax(dim=-1))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows,vocab", [(1, 128256), (5, 49152), (256, 151936)])
def test_argmax_reported_on_the_gpu(generator, rows, vocab):
    x = awkward_rows(generator, rows, vocab, torch.bfloat16)
    ids, reported = argmax_reported(x)
    assert torch.equal(ids, x.argmax(dim=-1)) and torch.equal(reported, reported_reference(x))


def test_the_greedy_sampler_uses_the_reported_argmax(generator):
    from cvllm.engine.sampler import Sampler
    from cvllm.sampling_params import SamplingParams

    class Row:
        def __init__(self, params):
            self.sampling_params, self.generator = params, None

    x = awkward_rows(generator, 5, 3 * CHUNK + 17, torch.float32)
    calls = []
    sampler = Sampler(argmax, lambda t: calls.append(t.shape) or argmax_reported(t))
    out = sampler(x, [Row(SamplingParams(temperature=0))] * 5)
    assert calls and torch.equal(out.token_ids, x.argmax(dim=-1)) and torch.equal(out.reported_ids,
                                                                                   reported_reference(x))
    plain = Sampler(argmax)(x, [Row(SamplingParams(temperature=0))] * 5)
    assert torch.equal(plain.reported_ids, out.reported_ids)


@pytest.mark.gpu
@needs_gpu
def test_argmax_in_a_cuda_graph(generator):
    static = torch.randn(16, 128256, generator=generator).to(DEVICE)
    argmax(static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax(static)
    for _ in range(3):
        static.copy_(torch.randn(static.shape, generator=generator).to(DEVICE))
        graph.replay()
        assert torch.equal(out, static.argmax(dim=-1))
