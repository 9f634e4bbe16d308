"""Where the host's time goes inside engine steps: wall time per section (schedule, input preparation,
forward launch, sampling launch, waiting for the GPU, applying tokens), summed over the steps run while
installed. Reads the engine's step records (cvllm/engine/observers.py): the engine itself carries no timers,
and builds no record when nobody observes.

If the GPU is the bottleneck the host spends its spare time in "wait"; if "wait" is near zero while the
GPU idles between steps, host work is what bounds the step."""

from __future__ import annotations

import collections
import gc
import time
from contextlib import contextmanager

# StepRecord.host phases -> the table's labels; the record's "finish" is shown as "other" with the glue between
LABELS = {"schedule": "schedule", "prepare": "prepare", "forward": "forward", "sample": "sample",
          "advance": "advance", "wait": "wait for GPU"}


class HostTimers:
    device_timing = False   # a step observer that needs host clocks only

    def __init__(self, engine):
        self.engine = engine
        self.totals: collections.Counter[str] = collections.Counter()
        self.steps = 0

    def on_step(self, record) -> None:
        for phase, seconds in record.host.items():
            if phase in LABELS:
                self.totals[LABELS[phase]] += seconds
        self.totals["step (all)"] += record.step_s
        self.steps += 1

    @contextmanager
    def installed(self):
        totals = self.totals
        gc_started = [0.0]

        def gc_timer(phase: str, info: dict) -> None:   # Python's collections pause whatever section they hit
            if phase == "start":
                gc_started[0] = time.perf_counter()
            else:
                totals["gc pauses (inside the above)"] += time.perf_counter() - gc_started[0]
                totals[f"gc collections of generation {info['generation']}"] += 1

        gc.callbacks.append(gc_timer)
        try:
            with self.engine.observers.observing(self):
                yield self
        finally:
            gc.callbacks.remove(gc_timer)

    def table(self, steps: int) -> str:
        total = self.totals["step (all)"]
        parts = {label: self.totals[label] for label in LABELS.values()}
        other = total - sum(parts.values())
        lines = [f"host time per step over {steps} steps (ms):"]
        for label, seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {label:14s} {seconds / steps * 1e3:8.3f}")
        lines.append(f"  {'other':14s} {other / steps * 1e3:8.3f}   (finish: tokens applied, stop checks)")
        lines.append(f"  {'step (all)':14s} {total / steps * 1e3:8.3f}")
        lines.append(f"  {'gc pauses':14s} {self.totals['gc pauses (inside the above)'] / steps * 1e3:8.3f}   "
                     f"(inside the sections above; collections by generation: "
                     f"{[int(self.totals[f'gc collections of generation {g}']) for g in range(3)]})")
        return "\n".join(lines)
