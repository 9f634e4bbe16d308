"""Where a decode step's boundary goes, from CUDA events and host timestamps at four points of each step (the
start of input preparation, the graph replay's start and end, the queued readback): how long the GPU waits
before a step's first operation, how long its pre-graph copies take on the GPU, and how far ahead of the GPU
the host launches. Unlike the torch profiler, it slows the host by a few microseconds a step only.
Used by ``bench/profile_decode.py --timeline`` (CUDA only; benchmarks only: it wraps the engine's objects)."""

from __future__ import annotations

import statistics
import time

import torch


class _MarkedGraph:
    """A captured graph whose replay records a mark before and after."""

    def __init__(self, graph, mark):
        self.graph, self.mark = graph, mark

    def replay(self) -> None:
        self.mark("replay")
        self.graph.replay()
        self.mark("replayed")


def step_timeline(engine, steps: int = 30) -> str:
    marks: list[tuple[str, float, torch.cuda.Event]] = []

    def mark(label: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((label, time.perf_counter(), event))

    runner, backend = engine.runner, engine.backend
    graphs = getattr(runner.decode_forward, "graphs", None)
    if not graphs:
        return "step timeline: no CUDA graphs to time (eager decode steps)"
    saved_graphs, prepare, readback = dict(graphs), runner.prepare, backend.start_readback

    def marked_prepare(*args, **kwargs):
        mark("prepare")
        return prepare(*args, **kwargs)

    def marked_readback(tensors):
        wait = readback(tensors)
        mark("readback")
        return wait

    graphs.update({size: (_MarkedGraph(graph, mark), out) for size, (graph, out) in saved_graphs.items()})
    runner.prepare, backend.start_readback = marked_prepare, marked_readback
    try:
        torch.cuda.synchronize()
        reference = torch.cuda.Event(enable_timing=True)
        reference.record()
        reference.synchronize()
        host_zero = time.perf_counter()
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - started) / steps * 1e3
    finally:
        graphs.update(saved_graphs)
        del runner.prepare, backend.start_readback   # the instance attributes go: the methods show again

    def gpu_time(event) -> float:   # on the host's clock, from the reference event
        return host_zero + reference.elapsed_time(event) / 1e3

    per_step, current = [], {}
    for label, host, event in marks:
        if label == "prepare" and current:
            per_step.append(current)
            current = {}
        current[label] = (host, gpu_time(event))
    per_step.append(current)
    rows = {"GPU idle before a step's first operation (us)": [],
            "GPU time of the pre-graph operations (us)": [],
            "graph on the GPU (us)": [],
            "host starts the next step this long before the GPU ends this one (us)": []}
    for last, step in zip(per_step, per_step[1:]):
        if not {"readback"} <= last.keys() or not {"prepare", "replay", "replayed"} <= step.keys():
            continue   # a step without a graph (eager) or without sampling
        rows["GPU idle before a step's first operation (us)"].append(
            (step["prepare"][1] - last["readback"][1]) * 1e6)
        rows["GPU time of the pre-graph operations (us)"].append((step["replay"][1] - step["prepare"][1]) * 1e6)
        rows["graph on the GPU (us)"].append((step["replayed"][1] - step["replay"][1]) * 1e6)
        rows["host starts the next step this long before the GPU ends this one (us)"].append(
            (last["readback"][1] - step["prepare"][0]) * 1e6)
    lines = [f"step timeline over {steps} steps: engine step {wall_ms:.2f} ms (median, max)"]
    for name, values in rows.items():
        if values:
            lines.append(f"  {name:72s} {statistics.median(values):10.1f} {max(values):10.1f}")
    return "\n".join(lines)
