"""The one-launch ``advance_ngram`` kernel (cvllm_cuda.kernels.ngram) against the torch reference
(cvllm.engine.ngram_device.advance_ngram, run on the CPU), bit for bit: the next step's ids and positions, the updated
lengths and histories. Random batches over tiny vocabularies (matches everywhere, of every n), rows out of order and
not covering the history, junk past each row's length, lengths up to the width's limit; in Triton's interpreter here
(conftest.py), on the GPU in the ``gpu`` test, and compiled for sm_90 on the CPU (sm90.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")  # a skip locally, an error under CI=true

import sm90  # noqa: E402

from cvllm.engine.ngram_device import advance_ngram as reference_advance_ngram  # noqa: E402
from cvllm_cuda.kernels import ngram  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(slots=True)
class Case:
    samples: torch.Tensor          # [S, K + 1]
    drafts: torch.Tensor           # [S, K]
    first_positions: torch.Tensor  # [S]
    rows: torch.Tensor             # [S]
    history: torch.Tensor          # [R, H]
    lengths: torch.Tensor          # [R]
    min_n: int
    max_n: int

    def to(self, device: str) -> Case:
        return Case(*(t.to(device) for t in (self.samples, self.drafts, self.first_positions, self.rows,
                                              self.history, self.lengths)), self.min_n, self.max_n)


def randint(generator: torch.Generator, low: int, high: int) -> int:
    """A random int in [low, high]."""
    return int(torch.randint(low, high + 1, (), generator=generator))


def random_case(generator: torch.Generator, max_width: int = 300) -> Case:
    vocab = randint(generator, 2, 6)
    num_seqs, k = randint(generator, 1, 5), randint(generator, 1, 8)
    min_n = randint(generator, 1, 8 if randint(generator, 0, 3) == 0 else 3)   # mostly small: most lookups find one
    max_n = min_n if randint(generator, 0, 3) == 0 else randint(generator, min_n, 8)
    width = randint(generator, 2, 24) if randint(generator, 0, 2) == 0 else randint(generator, 25, max_width)
    num_rows = num_seqs + randint(generator, 0, 3)
    # junk everywhere (a few values outside the vocabulary): reading past a length or from another row shows
    history = torch.randint(0, vocab + 3, (num_rows, width), generator=generator)
    lengths = torch.randint(1, width, (num_rows,), generator=generator)
    rows = torch.randperm(num_rows, generator=generator)[:num_seqs]
    samples = torch.randint(0, vocab, (num_seqs, k + 1), generator=generator)
    # each sequence's drafts: the samples up to the first rejected one, random after it
    drafts = torch.randint(0, vocab, (num_seqs, k), generator=generator)
    for i in range(num_seqs):
        accepted = randint(generator, 0, min(k, width - 2))   # the new length must fit: old + accepted + 1 <= width
        drafts[i, :accepted] = samples[i, :accepted]
        if accepted < k:
            drafts[i, accepted] = (samples[i, accepted] + randint(generator, 1, vocab - 1)) % vocab
        kind = randint(generator, 0, 3)
        if kind == 0:     # the new length at the width's limit (the writes past it clamped to its last position)
            length = width - 1 - accepted
        elif kind == 1:   # every sample written within the row, up to its last position
            length = max(1, width - 1 - k)
        else:
            length = randint(generator, 1, width - 1 - accepted)
        lengths[rows[i]] = length
        if randint(generator, 0, 1) == 0:   # a repeating pattern with some noise: long n-grams recur
            period = randint(generator, 1, 9)
            pattern = torch.randint(0, vocab, (period,), generator=generator)
            tokens = pattern.repeat(-(-length // period))[:length]
            noise = torch.rand(length, generator=generator) < 0.05
            tokens[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=generator)
            history[rows[i], :length] = tokens
        else:
            history[rows[i], :length] = torch.randint(0, vocab, (length,), generator=generator)
    first_positions = torch.randint(0, 10_000, (num_seqs,), generator=generator)
    return Case(samples, drafts, first_positions, rows, history, lengths, min_n, max_n)


def check(case: Case, device: str) -> tuple[torch.Tensor, ...]:
    """The kernel on ``device`` against the reference on the CPU, both updating copies of the case's history and
    lengths; returns the kernel's (ids, positions, history, lengths), on the CPU."""
    ref = case.to("cpu")
    ref.history, ref.lengths = ref.history.clone(), ref.lengths.clone()
    ref_ids, ref_positions = reference_advance_ngram(ref.samples, ref.drafts, ref.first_positions, ref.rows,
                                                     ref.history, ref.lengths, ref.min_n, ref.max_n)
    out = case.to(device)
    out.history, out.lengths = out.history.clone(), out.lengths.clone()
    # as the executor passes them: views of a verify step's input ids and positions, [S, K + 1] each
    k1 = case.samples.shape[1]
    step_ids = torch.cat([torch.zeros_like(out.drafts[:, :1]), out.drafts], 1)
    step_positions = out.first_positions[:, None] + torch.arange(k1, device=device)
    ids, positions = ngram.advance_ngram(out.samples, step_ids[:, 1:], step_positions[:, 0], out.rows, out.history,
                                         out.lengths, out.min_n, out.max_n)
    assert ids.dtype == positions.dtype == torch.int64
    assert torch.equal(ids.cpu(), ref_ids), (ids, ref_ids)
    assert torch.equal(positions.cpu(), ref_positions), (positions, ref_positions)
    assert torch.equal(out.lengths.cpu(), ref.lengths), (out.lengths, ref.lengths)
    history, width = out.history.cpu(), case.history.shape[1]
    touched = set(case.rows.tolist())
    for row in range(case.history.shape[0]):
        if row not in touched:   # rows of other sequences: untouched
            assert torch.equal(history[row], case.history[row]), row
            continue
        new_len = int(ref.lengths[row])
        assert torch.equal(history[row, :new_len], ref.history[row, :new_len]), (row, history[row], ref.history[row])
        # nothing written past the samples
        end = min(int(case.lengths[row]) + k1, width)
        assert torch.equal(history[row, end:], case.history[row, end:]), row
    return ids.cpu(), positions.cpu(), history, out.lengths.cpu()


def test_worked_example():
    """[1 2 3 1] with the chunk's first token last; drafts [2 9] against samples [2 3 4]: one accepted, bonus 3,
    the sequence [1 2 3 1 2 3] whose suffix [1 2 3] recurs at 0, so the drafts are the tokens after it, [1 2]."""
    history = torch.tensor([[7, 7, 7, 7, 7, 7, 7, 7], [1, 2, 3, 1, 7, 7, 7, 7]])
    case = Case(samples=torch.tensor([[2, 3, 4]]), drafts=torch.tensor([[2, 9]]), first_positions=torch.tensor([3]),
                rows=torch.tensor([1]), history=history, lengths=torch.tensor([5, 4]), min_n=1, max_n=3)
    if not INTERPRETED and not torch.cuda.is_available():
        pytest.skip("compiled Triton without a GPU")
    ids, positions, history, lengths = check(case, "cpu" if INTERPRETED else "cuda")
    assert ids.tolist() == [[3, 1, 2]] and positions.tolist() == [[5, 6, 7]]
    assert history[1, :6].tolist() == [1, 2, 3, 1, 2, 3] and lengths.tolist() == [5, 6]


interpreted = pytest.mark.skipif(not INTERPRETED, reason="on a GPU: test_matches_the_reference_on_the_gpu")


@interpreted
@pytest.mark.parametrize("case", range(100))
def test_matches_the_reference(generator, case):
    check(random_case(generator), "cpu")


@interpreted
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("case", range(25))
def test_matches_the_reference_over_several_blocks(monkeypatch, generator, block, case):
    """Blocks smaller than the history: the scan's latest match and the n-grams that straddle two blocks."""
    monkeypatch.setattr(ngram, "BLOCK", block)
    check(random_case(generator, max_width=120), "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED,
                    reason="needs a CUDA device and compiled (not interpreted) Triton")
@pytest.mark.parametrize("block", [None, 16])
def test_matches_the_reference_on_the_gpu(monkeypatch, generator, block):
    if block is not None:
        monkeypatch.setattr(ngram, "BLOCK", block)
    for _ in range(200):
        check(random_case(generator), "cuda")
    # a long history (several default blocks), its rows at various lengths
    case = random_case(generator)
    width = 32768
    history = torch.randint(0, 3, (case.history.shape[0], width), generator=generator)
    lengths = torch.randint(width - 4000, width - case.samples.shape[1], (history.shape[0],), generator=generator)
    check(Case(case.samples, case.drafts, case.first_positions, case.rows, history, lengths, case.min_n, case.max_n),
          "cuda")


# Compiled for sm_90: under the interpreter the kernel is no compilable object, so a child pytest compiles it with the
# interpreter off (test_sm90_compile.py does the same for other kernels); no GPU is needed to compile.
@pytest.mark.skipif(not INTERPRETED, reason="test_kernel_compiles_for_hopper runs here directly")
def test_compiles_for_hopper_in_a_child():
    child = subprocess.run([sys.executable, "-m", "pytest", f"{__file__}::test_kernel_compiles_for_hopper",
                            "-p", "no:cacheprovider", "-o", "addopts=", "-q"],
                           env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    assert re.search(r"\b6 passed in ", child.stdout), child.stdout[-2000:]


@pytest.mark.skipif(INTERPRETED, reason="run by test_compiles_for_hopper_in_a_child, interpreter off")
@pytest.mark.parametrize("k,min_n,max_n", [(1, 1, 1), (4, 1, 8), (16, 2, 8)])
@pytest.mark.parametrize("width", [100, 32768])
def test_kernel_compiles_for_hopper(monkeypatch, k, min_n, max_n, width):
    """Compiles (the interpreter does not type-check) with no register spills, at the engine's extremes of K and n."""
    recorder = sm90.LaunchRecorder(ngram._advance_ngram_kernel)
    monkeypatch.setattr(ngram, "_advance_ngram_kernel", recorder)
    num_seqs = 16
    ngram.advance_ngram(torch.zeros(num_seqs, k + 1, dtype=torch.int64), torch.zeros(num_seqs, k, dtype=torch.int64),
                        torch.zeros(num_seqs, dtype=torch.int64), torch.arange(num_seqs),
                        torch.zeros(num_seqs, width, dtype=torch.int64), torch.ones(num_seqs, dtype=torch.int64),
                        min_n, max_n)
    assert len(recorder.launches) == 1
    kernel = sm90.compile_launch(recorder.fn, *recorder.launches[0])
    usage = sm90.resource_usage(kernel)
    assert usage["STACK"] == 0, usage
