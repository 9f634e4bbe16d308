"""Step observers: each engine step, as a record of what it ran and where its time went, for whoever registers.

Metrics and the benchmarks (bench/host_timers.py, step_trace.py, step_timeline.py) read records instead of
wrapping the engine's methods. With no observer registered the engine builds no record and times nothing: the
step pays one attribute check. Device timing (events in the device's queue at the step's marks) costs a few
microseconds a step and is taken only when an observer asks for it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from cvllm.engine.scheduler import ScheduledBatch


@dataclass(slots=True)
class StepRecord:
    """One ``LLMEngine.step()``: the batch it launched and the host seconds of its phases.

    ``host`` holds the phases in the order they ran, each summed over the step: "schedule", then the launch's
    "prepare" (the batch's input tensors), "forward" (the forward pass's launches), "sample" (sampling, the
    readback queued), "advance" (the scheduler's bookkeeping), and "wait" (for the device, reading a step's
    tokens back) and "finish" (applying them: stop checks, logprobs) of each launched step read back in this
    one. Under async scheduling a step reads back the previous step's tokens, so its "wait" is for that one.

    ``device``: (mark, host perf_counter, backend event) at "launch" (before the inputs are built), "forward"
    (before the forward pass), "forwarded" (after it) and "sampled" (after the readback was queued), when an
    observer asked for device timing and the backend has events (``Backend.record_event``)."""
    index: int                    # observed steps before this one (a step that raised is counted, not sent)
    device_timing: bool           # take device events at the marks
    num_seqs: int = 0             # sequences in the batch launched (0: the step only read a step back)
    num_decodes: int = 0          # rows that decode one token
    num_prefill_tokens: int = 0   # prompt tokens computed (whole prompts and chunks)
    num_sampled: int = 0          # sequences that sample a token from this batch
    num_outputs: int = 0          # sequences that got a token back in this step (of this batch or the previous)
    lagged: bool = False          # a verify step built a step behind on inputs the device computed (device drafts)
    step_s: float = 0.0           # the whole step on the host
    host: dict[str, float] = field(default_factory=dict)
    device: list[tuple[str, float, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    _last: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        self._last = self.started

    @property
    def mixed(self) -> bool:
        """The batch ran prompt tokens and decodes together."""
        return self.num_prefill_tokens > 0 and self.num_decodes > 0

    def mark(self, phase: str) -> None:
        """The host time since the previous mark (or the step's start) goes to ``phase``."""
        now = time.perf_counter()
        self.host[phase] = self.host.get(phase, 0.0) + now - self._last
        self._last = now

    def device_mark(self, backend, label: str) -> None:
        """An event in ``backend``'s device queue now, if an observer asked for device timing."""
        if self.device_timing:
            event = backend.record_event()
            if event is not None:
                self.device.append((label, time.perf_counter(), event))

    def scheduled(self, batch: ScheduledBatch) -> None:
        self.mark("schedule")
        self.num_seqs, self.num_decodes = len(batch.seqs), batch.num_decodes
        self.num_prefill_tokens, self.num_sampled = batch.num_prefill_tokens, len(batch.sample_indices)
        self.lagged = batch.lagged


class StepObserver(Protocol):
    # True: records carry device events (bench/step_trace.py's GPU time per step); a few microseconds a step
    device_timing: bool

    def on_step(self, record: StepRecord) -> None:
        """Called after each successful step, from the engine's thread; a record is not reused."""


class StepObservers:
    """The observers registered on one engine."""

    def __init__(self):
        self._observers: list[StepObserver] = []
        self.active = False          # any observer: the engine builds records
        self._device_timing = False
        self._sent = 0

    def add(self, observer: StepObserver) -> None:
        self._observers.append(observer)
        self._changed()

    def remove(self, observer: StepObserver) -> None:
        self._observers.remove(observer)
        self._changed()

    @contextmanager
    def observing(self, observer: StepObserver) -> Iterator[StepObserver]:
        """``observer`` registered for the ``with`` block."""
        self.add(observer)
        try:
            yield observer
        finally:
            self.remove(observer)

    def _changed(self) -> None:
        self.active = bool(self._observers)
        self._device_timing = any(getattr(o, "device_timing", False) for o in self._observers)

    def start(self) -> StepRecord:
        record = StepRecord(self._sent, self._device_timing)
        self._sent += 1
        return record

    def send(self, record: StepRecord, num_outputs: int) -> None:
        record.num_outputs = num_outputs
        record.step_s = time.perf_counter() - record.started
        for observer in list(self._observers):
            observer.on_step(record)
