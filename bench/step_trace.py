"""Where a whole offline run's GPU time goes, step by step: CUDA events at each step's launch and after its
sampling, with the step's make-up (prompt tokens, decode rows), summed by phase: the steps that prefill
(mixed with the decodes of the sequences already running), the decode steps at the full batch, and the tail
of decode steps with fewer rows as sequences finish. Also the GPU's idle time before each step's work.
Used by ``bench/serving.py``'s offline run (CUDA only). A step observer (cvllm/engine/observers.py): the
engine's records carry the events it asks for."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class StepTrace:
    device_timing = True   # records carry backend events at the step's marks

    def __init__(self, engine):
        self.engine = engine
        # per sampled step: prompt tokens, decode rows, CUDA events at its launch and after its sampling. A step
        # that samples nothing (only prompt chunks) has no readback: it is counted into the next one that does.
        self.steps: list[tuple[int, int, torch.cuda.Event, torch.cuda.Event]] = []
        self._pending: list | None = None   # [prompt tokens, decode rows, start event] since the last readback
        self.wall_s = 0.0

    def on_step(self, record) -> None:
        events = {label: event for label, _, event in record.device}
        if not record.num_seqs or "launch" not in events:   # nothing launched, or a backend without events
            return
        if self._pending is None:
            self._pending = [0, 0, events["launch"]]
        self._pending[0] += record.num_prefill_tokens
        self._pending[1] += record.num_decodes
        if record.num_sampled:
            prompt, rows, start = self._pending
            self.steps.append((prompt, rows, start, events["sampled"]))
            self._pending = None

    @contextmanager
    def installed(self):
        began = time.perf_counter()
        try:
            with self.engine.observers.observing(self):
                yield self
        finally:
            torch.cuda.synchronize()
            self.wall_s = time.perf_counter() - began

    def phases(self) -> dict:
        """{phase: {steps, gpu_s, idle_s, prompt_tokens, decode_rows}} and the run's totals."""
        if not self.steps:
            return {}
        full = max((rows for prompt, rows, _, _ in self.steps if not prompt), default=0)
        phases: dict[str, dict] = {}
        previous_end = None
        for prompt, rows, start, end in self.steps:
            name = "prefill (mixed)" if prompt else ("decode, full batch" if rows == full else "decode, fewer rows")
            phase = phases.setdefault(name, {"steps": 0, "gpu_s": 0.0, "idle_s": 0.0, "prompt_tokens": 0,
                                             "decode_rows": 0})
            busy_from = start if previous_end is None else previous_end
            # the GPU's time from the previous step's end (or this step's first mark) to this step's end, and
            # the part of it before this step's first operation reached the GPU
            phase["gpu_s"] += busy_from.elapsed_time(end) / 1e3
            if previous_end is not None:
                phase["idle_s"] += max(0.0, previous_end.elapsed_time(start) / 1e3)
            phase["steps"] += 1
            phase["prompt_tokens"] += prompt
            phase["decode_rows"] += rows
            previous_end = end
        for phase in phases.values():
            phase["ms_per_step"] = phase["gpu_s"] / phase["steps"] * 1e3
        return {"phases": phases, "steps": len(self.steps), "wall_s": self.wall_s,
                "gpu_span_s": self.steps[0][2].elapsed_time(self.steps[-1][3]) / 1e3, "full_batch": full}


def phase_table(trace: dict) -> str:
    lines = [f"offline run by phase: {trace['steps']} steps, {trace['wall_s']:.2f} s wall, GPU span "
             f"{trace['gpu_span_s']:.2f} s",
             f"  {'phase':20s} {'steps':>6s} {'GPU s':>7s} {'ms/step':>8s} {'idle ms':>8s} {'prompt tok':>11s} "
             f"{'decode rows':>11s}"]
    for name, p in trace["phases"].items():
        lines.append(f"  {name:20s} {p['steps']:6d} {p['gpu_s']:7.2f} {p['ms_per_step']:8.2f} "
                     f"{p['idle_s'] * 1e3:8.1f} {p['prompt_tokens']:11d} {p['decode_rows']:11d}")
    return "\n".join(lines)
