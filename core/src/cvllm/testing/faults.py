"""Fault injection for tests: make a healthy model fail where and how a test chooses, so the failure paths (a step's
requests fail, a request with non-finite logits fails alone, the engine core dies or hangs and is replaced) run on a
tiny checkpoint on the CPU.

The seam is ``EngineConfig.fault_injector``. It travels inside the config to a spawned engine core (so everything here
is picklable), and the engine calls it with each scheduled batch; a ``FaultPlan`` also has ``install(engine)``, which
the engine core calls once the engine is built to reach the forward pass and sampling, and ``wrap_choices``, which the
server's API process calls for each request to reach detokenization. A live server (testing/server.py) takes a plan as
JSON: a list of ``Fault`` fields.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cvllm.engine.scheduler import ScheduledBatch

STAGES = ("schedule", "forward", "sample", "detokenize")
ACTIONS = ("raise", "device_error", "crash", "hang", "sleep", "nan", "inf")


@dataclass(frozen=True)
class FailStepOnPromptToken:
    """A step that schedules a sequence whose prompt holds ``token`` raises."""
    token: int

    def __call__(self, batch: ScheduledBatch) -> None:
        if any(self.token in seq.token_ids[:seq.num_prompt_tokens] for seq in batch.seqs):
            raise RuntimeError(f"injected step failure (a prompt holds token {self.token})")


@dataclass(frozen=True)
class Fault:
    """One thing that goes wrong.

    ``stage``: where. "schedule" (a step was scheduled), "forward" (the model's forward pass), "sample" (sampling),
    "detokenize" (the API process turns a token into text).
    ``action``: what. "raise" (a RuntimeError: that step's requests fail, or at "detokenize" that request),
    "device_error" (an error that poisons a device context: the engine core dies), "crash" (the core process kills
    itself with SIGKILL), "hang" (the step never returns), "sleep" (``seconds``, then the step goes on), "nan" /
    "inf" (the logits of the matching requests, at "sample").
    ``prompt_token``: only steps that hold a sequence whose prompt holds this token, and only those sequences' logits
    (None: every step, every sequence).
    """
    stage: str
    action: str = "raise"
    prompt_token: int | None = None
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"stage must be one of {', '.join(STAGES)}, got {self.stage!r}")
        if self.action not in ACTIONS:
            raise ValueError(f"action must be one of {', '.join(ACTIONS)}, got {self.action!r}")
        if self.action in ("nan", "inf") and self.stage != "sample":
            raise ValueError("nan and inf logits are a sample-stage fault")

    def matches(self, prompt_token_ids: Iterable[int]) -> bool:
        return self.prompt_token is None or self.prompt_token in prompt_token_ids

    def matches_seq(self, seq) -> bool:
        return self.prompt_token is None or self.prompt_token in seq.token_ids[:seq.num_prompt_tokens]

    def strike(self, where: str) -> None:
        """Do the action (those that act on the whole step)."""
        if self.action == "raise":
            raise RuntimeError(f"injected fault in {where}")
        if self.action == "device_error":
            raise RuntimeError(f"CUDA error: injected device fault in {where}")
        if self.action == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action == "hang":
            threading.Event().wait()
        if self.action == "sleep":
            time.sleep(self.seconds)


@dataclass(frozen=True)
class FaultPlan:
    """The faults of one test; each acts wherever its stage comes up and its request matches."""
    faults: tuple[Fault, ...]

    @classmethod
    def of(cls, *faults: Fault | dict[str, Any]) -> FaultPlan:
        """From ``Fault``s or their fields as dicts (a live server's JSON)."""
        return cls(tuple(f if isinstance(f, Fault) else Fault(**f) for f in faults))

    def at(self, stage: str) -> list[Fault]:
        return [fault for fault in self.faults if fault.stage == stage]

    def __call__(self, batch: ScheduledBatch) -> None:
        """``EngineConfig.fault_injector``'s call: a batch was scheduled."""
        self._strike("schedule", batch.seqs)

    def _strike(self, stage: str, seqs) -> None:
        for fault in self.at(stage):
            if fault.action not in ("nan", "inf") and any(fault.matches_seq(seq) for seq in seqs):
                fault.strike(stage)

    def install(self, engine) -> None:
        """Reach the engine's forward pass and sampling: wrap its executor's ``forward`` and ``sample``."""
        executor = engine.executor
        forward, sample = executor.forward, executor.sample
        poisoned = [fault for fault in self.at("sample") if fault.action in ("nan", "inf")]

        def faulty_forward(batch, previous, record=None):
            self._strike("forward", batch.seqs)
            return forward(batch, previous, record)

        def faulty_sample(step, allowed, record=None):
            self._strike("sample", step.sampling)
            if poisoned:
                step.logits = poison_logits(step, poisoned)
            return sample(step, allowed, record)

        if self.at("forward"):
            executor.forward = faulty_forward
        if self.at("sample"):
            executor.sample = faulty_sample

    def wrap_choices(self, prompt_token_ids: list[int], choices) -> None:
        """Reach a request's detokenization in the API process (server/lifecycle.py calls this)."""
        for fault in self.at("detokenize"):
            if fault.matches(prompt_token_ids):
                for choice in choices:
                    if choice.detokenizer is not None:
                        choice.detokenizer.update = _failing_update(fault, choice.detokenizer.update)


def poison_logits(step, faults: list[Fault]):
    """The step's logits with the rows of the matching sequences (all 1 + drafts rows of a speculating one) set to
    NaN or +inf."""
    logits = step.logits.clone()
    row = 0
    for j, seq in enumerate(step.sampling):
        rows = 1 + step.num_drafts[j] if step.num_drafts else 1
        for fault in faults:
            if fault.matches_seq(seq):
                logits[row:row + rows] = float("nan") if fault.action == "nan" else float("inf")
        row += rows
    return logits


def _failing_update(fault: Fault, update):
    def failing(token_id: int):
        if fault.action == "raise":
            raise RuntimeError("injected fault in detokenization")
        fault.strike("detokenization")
        return update(token_id)
    return failing
