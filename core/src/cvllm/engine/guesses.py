"""A guess of a verify step's outcome, on which the next step is launched before it is read back (speculator.py's
async speculative steps), and how often a sequence's guesses have held."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cvllm.engine.sequence import Sequence


@dataclass(slots=True)
class Guess:
    """A sequence's assumed outcome of the in-flight step, on which the next step is launched."""
    seq: Sequence
    expected: list[int | None]   # the tokens assumed: every draft, then the bonus token (None: left on the device)
    base: int                    # its verified tokens (len(token_ids)) when guessed
    num_inflight: int
    generator_state: torch.Tensor | None   # a seeded generator before the next step's draws
    step: object | None = None   # the LaunchedStep launched on the guess

    def holds(self, tokens: list[int]) -> bool:
        return self.matches(self.expected, tokens)

    @staticmethod
    def matches(expected: list[int | None], tokens: list[int]) -> bool:
        return len(tokens) == len(expected) and all(e is None or e == t for e, t in zip(expected, tokens))


# A wrong guess costs a whole device step (its rows are void), a right one saves the host's work between two steps
# that the device would otherwise wait for (a fraction of a step), so a sequence is guessed for only while its
# guesses hold at least this often: on the H200 a void step cost 0.8-1.1 ms on the demo model against 0.1-0.3 ms
# of the device waiting for the host in a synchronous step (docs/benchmarks.md, session 24), a break-even of ~0.8.
# Kept apart for the two kinds of guess, whose odds differ: the token after a step without drafts, and "every draft
# accepted, then the looked-up token" after a verify step (on the demo model 54 of 159 and 75 of 270 held).
GUESS_MIN_RATE = 0.8
GUESS_RATE_WEIGHT = 0.25   # the latest outcome's weight in a sequence's running rates (Sequence.spec_guess_rates)


def score_guess(seq: Sequence, after_verify: bool, held: bool) -> None:
    rates = seq.spec_guess_rates
    rates[after_verify] += GUESS_RATE_WEIGHT * (held - rates[after_verify])
