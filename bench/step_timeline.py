"""Where a decode step's boundary goes, from CUDA events and host timestamps at four points of each step (the
start of input preparation, the forward pass's start and end, the queued readback): how long the GPU waits
before a step's first operation, how long the inputs' copies take on the GPU, and how far ahead of the GPU the
host launches. Unlike the torch profiler, it slows the host by a few microseconds a step only.
Used by ``bench/profile_decode.py --timeline`` (CUDA only). A step observer (cvllm/engine/observers.py) asking
for device timing: the engine records the events at its marks."""

from __future__ import annotations

import statistics
import time

import torch

# StepRecord.device marks: inputs built from here, forward pass from/to, readback queued
MARKS = ("launch", "forward", "forwarded", "sampled")


class Records:
    """A step observer that keeps every record, with device events at the marks."""
    device_timing = True

    def __init__(self):
        self.records = []

    def on_step(self, record) -> None:
        self.records.append(record)


def step_timeline(engine, steps: int = 30) -> str:
    graphs = getattr(engine.runner.decode_forward, "graphs", None)
    if not graphs:
        return "step timeline: no CUDA graphs to time (eager decode steps)"
    largest = max(size for size, q in graphs if q == 1)
    observed = Records()
    torch.cuda.synchronize()
    reference = torch.cuda.Event(enable_timing=True)
    reference.record()
    reference.synchronize()
    host_zero = time.perf_counter()
    started = time.perf_counter()
    with engine.observers.observing(observed):
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - started) / steps * 1e3

    def gpu_time(event) -> float:   # on the host's clock, from the reference event
        return host_zero + reference.elapsed_time(event) / 1e3

    per_step = []
    for record in observed.records:
        marks = {label: (host, gpu_time(event)) for label, host, event in record.device}
        # a step whose forward pass replays a graph: decode rows only, each sampling, no more than captured
        graphed = not record.num_prefill_tokens and record.num_sampled == record.num_seqs and \
            0 < record.num_seqs <= largest
        per_step.append(marks if graphed and set(MARKS) <= marks.keys() else None)
    rows = {"GPU idle before a step's first operation (us)": [],
            "GPU time of the inputs' upload before the graph (us)": [],
            "graph on the GPU, its input copies included (us)": [],
            "host starts the next step this long before the GPU ends this one (us)": []}
    for last, step in zip(per_step, per_step[1:]):
        if last is None or step is None:
            continue   # a step without a graph (eager) or without sampling
        rows["GPU idle before a step's first operation (us)"].append((step["launch"][1] - last["sampled"][1]) * 1e6)
        rows["GPU time of the inputs' upload before the graph (us)"].append(
            (step["forward"][1] - step["launch"][1]) * 1e6)
        rows["graph on the GPU, its input copies included (us)"].append(
            (step["forwarded"][1] - step["forward"][1]) * 1e6)
        rows["host starts the next step this long before the GPU ends this one (us)"].append(
            (last["sampled"][1] - step["launch"][0]) * 1e6)
    lines = [f"step timeline over {steps} steps: engine step {wall_ms:.2f} ms (median, max)"]
    for name, values in rows.items():
        if values:
            lines.append(f"  {name:72s} {statistics.median(values):10.1f} {max(values):10.1f}")
    return "\n".join(lines)
