"""What the benchmark scripts share: the commit they ran at, and starting and stopping `cvserve`."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx


def git_commit() -> str | None:
    """The short hash of the checkout the script runs from (None outside a git checkout). CVLLM_BENCH_COMMIT
    overrides it: the GPU machine's copy of the tree carries a .git that need not be at the copied commit."""
    if os.environ.get("CVLLM_BENCH_COMMIT"):
        return os.environ["CVLLM_BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent)
    except OSError:
        return None
    return out.stdout.strip() or None


def command_line(argv: list[str] | None = None) -> str:
    """The command as a result file records it: ``python`` and the script's arguments (``sys.argv``), with the GPU
    machine's output folder written as ``$OUT`` (bench/device/README.md) and this checkout's own path left out, so
    that no machine's paths go into committed results."""
    out = os.environ.get("OUT", "").rstrip("/")
    root = str(Path(__file__).resolve().parent.parent) + os.sep
    args = []
    for arg in sys.argv if argv is None else argv:
        if out:
            arg = arg.replace(out + "/", "$OUT/")
        args.append(arg.replace(root, ""))
    return "python " + " ".join(args)


def graph_replay_ms(engine, batch: int) -> float | None:
    """GPU time of one decode step of ``batch`` sequences: the CUDA graph captured for that batch (padded up
    the ladder) replayed alone, timed with CUDA events. None where no graph exists (eager, CPU)."""
    graphs = getattr(engine.runner.decode_forward, "graphs", None)
    sizes = sorted(size for size, q in graphs or () if q == 1 and size >= batch)   # keys (batch size, queries)
    if not sizes:
        return None
    graph, _ = graphs[sizes[0], 1]
    return replay_ms(graph)


def replay_ms(graph, reps: int = 20, warmup: int = 5) -> float:
    """Median milliseconds of one replay of a captured CUDA graph, timed with CUDA events."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def captured_us(run, per: int = 1) -> float:
    """``run()`` (GPU work, no host syncs) captured in one CUDA graph: median microseconds of a replay / ``per``
    (e.g. per layer of a stack). Warmed up on a side stream first, as capture requires."""
    import torch

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return replay_ms(graph) * 1e3 / per


def process_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) so far of process ``pid`` itself and of all its descendants together, from
    /proc (Linux; (0, 0) elsewhere): for a cvserve process, its API process and its engine core."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    parents, cpu = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:   # the process ended meanwhile
            continue
        child = int(stat.parent.name)
        parents[child] = int(fields[1])
        cpu[child] = (int(fields[11]) + int(fields[12])) / tick   # utime, stime
    descendants, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - descendants
        descendants |= frontier
    return cpu.get(pid, 0.0), sum(cpu[child] for child in descendants)


class GpuSampler:
    """GPU 0's SM clock, power and throttle reasons every 200 ms (nvidia-smi, in the background) while the
    ``with`` block runs; ``summary`` then holds their medians and the share of samples at the power cap. Under a
    sustained load an H200 sits at its board power limit and lowers its clocks, so compute-bound kernels run
    slower there than alone (2026-12-02: ~695 W, SM clock median 1,695 MHz against 1,980 idle). Empty where
    nvidia-smi is missing (CPU rehearsals)."""

    POWER_CAP = 0x4   # nvidia-smi's clocks_throttle_reasons bit: software power cap

    def __init__(self) -> None:
        self.summary: dict[str, float] = {}
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> GpuSampler:
        if shutil.which("nvidia-smi"):
            self._proc = subprocess.Popen(
                ["nvidia-smi", "-i", "0", "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
                 "--format=csv,noheader,nounits", "-lms", "200"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        out, _ = self._proc.communicate()
        samples = []
        for line in out.splitlines():
            try:
                clock, power, reasons = (field.strip() for field in line.split(","))
                samples.append((float(clock), float(power), int(reasons, 16)))
            except ValueError:   # a header, a cut last line, "[N/A]"
                continue
        if samples:
            self.summary = {"gpu_sm_clock_mhz_p50": statistics.median(s[0] for s in samples),
                            "gpu_power_w_p50": statistics.median(s[1] for s in samples),
                            "gpu_power_capped_share": sum(bool(s[2] & self.POWER_CAP) for s in samples) / len(samples)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cvserve(flags: list[str], port: int, log_path: Path, timeout: float) -> subprocess.Popen:
    """``python -m cvllm.server.cli --p PORT FLAGS`` in its own process session (so stopping it reaches its
    engine-core child too), once /health answers; its output goes to ``log_path``."""
    command = [sys.executable, "-m", "cvllm.server.cli", "--p", str(port), *flags]
    with log_path.open("w") as log_file:
        server = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"cvserve exited with {server.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_cvserve(server)
    raise RuntimeError(f"cvserve was not healthy within {timeout} s:\n{log_path.read_text()[-4000:]}")


def stop_cvserve(server: subprocess.Popen) -> None:
    """SIGTERM (cvserve drains and exits), then SIGKILL to the whole session after a minute."""
    if server.poll() is not None:
        return
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
