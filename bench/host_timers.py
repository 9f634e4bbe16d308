"""Where the host's time goes inside engine steps: wall time per section (schedule, input preparation,
forward launch, sampling launch, waiting for the GPU, applying tokens), summed over the steps run while
installed. Wraps the engine's methods in place (benchmarks only: the engine itself carries no timers).

If the GPU is the bottleneck the host spends its spare time in "wait"; if "wait" is near zero while the
GPU idles between steps, host work is what bounds the step."""

from __future__ import annotations

import collections
import gc
import time
from contextlib import contextmanager


class HostTimers:
    def __init__(self, engine):
        self.engine = engine
        self.totals: collections.Counter[str] = collections.Counter()
        self.steps = 0
        self._undo: list[tuple[object, str, object]] = []

    def _wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)
        totals = self.totals

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - started

        self._undo.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, timed)

    @contextmanager
    def installed(self):
        engine = self.engine
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.runner, "prepare", "prepare")
        self._wrap(engine.runner, "run", "run")   # prepare + the forward pass's launches (shown less prepare)
        self._wrap(engine, "sampler", "sample")
        self._wrap(engine.scheduler, "advance", "advance")
        start_readback = engine.backend.start_readback
        totals = self.totals

        def timed_readback(tensors):
            wait = start_readback(tensors)

            def timed_wait():
                started = time.perf_counter()
                try:
                    return wait()
                finally:
                    totals["wait for GPU"] += time.perf_counter() - started
            return timed_wait

        self._undo.append((engine.backend, "start_readback", engine.backend.__dict__.get("start_readback")))
        engine.backend.start_readback = timed_readback
        self._wrap(engine, "step", "step (all)")
        gc_started = [0.0]

        def gc_timer(phase: str, info: dict) -> None:   # Python's collections pause whatever section they hit
            if phase == "start":
                gc_started[0] = time.perf_counter()
            else:
                totals["gc pauses (inside the above)"] += time.perf_counter() - gc_started[0]
                totals[f"gc collections of generation {info['generation']}"] += 1

        gc.callbacks.append(gc_timer)
        try:
            yield self
        finally:
            gc.callbacks.remove(gc_timer)
            for owner, name, previous in reversed(self._undo):
                if previous is None:
                    delattr(owner, name)
                else:
                    setattr(owner, name, previous)
            self._undo.clear()

    def table(self, steps: int) -> str:
        total = self.totals["step (all)"]
        parts = {k: v for k, v in self.totals.items() if k not in ("step (all)", "run") and not k.startswith("gc ")}
        parts["forward"] = self.totals["run"] - self.totals["prepare"]
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
