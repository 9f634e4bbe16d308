"""Rank 0's watch over its tensor-parallel workers: a worker that died is named with how it ended, and one that hangs
while a step waits for it fails the engine within ``CVLLM_TP_STALL_TIMEOUT_S`` seconds instead of after gloo's
collective timeout (600 s, which start-up needs).

A hang is judged by progress, not by a step deadline: a long prefill on the CPU can legitimately take minutes, but
then every rank is burning CPU. A worker that a step is waiting for and that has used no CPU time and read nothing
for the whole limit is stopped (SIGSTOP, a debugger), stuck in the kernel (a dead network mount) or deadlocked.
Gloo waits without spinning, so the ranks waiting on a hung one are idle too; every idle one is named, each with its
process state. A worker that spins in a loop is not caught here (gloo's own timeout remains). Progress is read from
/proc; without it (not Linux) only deaths are detected.

When the watch gives up on a step it kills every worker: rank 0's collective then fails at once (the peers' sockets
close) and the step raises the watch's reason rather than gloo's "connection reset". It never reaps a process: only
rank 0's main thread does (``Process.is_alive``), so the two threads do not race for an exit status.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from pathlib import Path

from cvllm.engine.errors import EngineBrokenError

logger = logging.getLogger(__name__)

STALL_TIMEOUT_ENV = "CVLLM_TP_STALL_TIMEOUT_S"
DEFAULT_STALL_TIMEOUT_S = 30.0
# After a failed collective: how long to wait for a worker's death to become visible. A killed process's sockets
# close (rank 0's collective fails) a moment before it becomes a zombie that is_alive() reports.
DEATH_GRACE_S = 2.0
STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped", "t": "stopped by a debugger",
          "Z": "exited"}


def stall_timeout_s() -> float | None:
    """``CVLLM_TP_STALL_TIMEOUT_S`` in seconds (default 30); None when it is 0 (hangs then wait for gloo's timeout)."""
    text = os.environ.get(STALL_TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_STALL_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{STALL_TIMEOUT_ENV}={text!r}: expected a number of seconds (0 turns the check off)")
    return value or None


def how_it_ended(exit_code: int | None) -> str:
    if exit_code is None:
        return "exit code unknown"
    if exit_code < 0:
        try:
            return f"killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"killed by signal {-exit_code}"
    return f"exit code {exit_code}"


def _sample(pid: int) -> tuple[str, tuple[int, ...]] | None:
    """(process state, progress counters: CPU ticks, bytes read), or None if /proc has no such process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    counters = [int(fields[11]) + int(fields[12])]   # utime + stime, every thread's
    try:   # reads count too: a worker paging in mapped weights or receiving a large broadcast is not hung
        io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
        counters += [int(io["rchar"]), int(io["read_bytes"])]
    except (OSError, KeyError, ValueError):
        pass
    return fields[0], tuple(counters)


class WorkerWatch:
    """Deaths (``check``) and hangs during a step (a thread, armed by ``step``) of the worker ``processes`` (rank r
    is ``processes[r - 1]``). ``stall_s``: None for no hang detection."""

    def __init__(self, processes: Sequence[BaseProcess], stall_s: float | None):
        self.processes = list(processes)
        self.stall_s = stall_s
        self.poll_s = min(1.0, stall_s / 4) if stall_s else 0.0
        self.failure: str | None = None   # why the watch gave up, once it has
        self._step = 0                    # counts armed steps: the thread starts afresh on each
        self._armed = threading.Event()
        self._closed = threading.Event()
        self._thread = None
        if stall_s:
            self._thread = threading.Thread(target=self._run, name="cvllm-tp-watchdog", daemon=True)
            self._thread.start()

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around what waits on the workers (the step's broadcast and the forward's collectives). Costs an event's
        set and clear; the thread samples at most every ``poll_s`` and blocks, using no CPU, while nothing is armed."""
        self._step += 1
        self._armed.set()
        try:
            yield
        finally:
            self._armed.clear()

    def sentinels(self) -> list[int]:
        """Handles that become ready when a worker ends (``multiprocessing.connection.wait``)."""
        return [process.sentinel for process in self.processes]

    def check(self, grace_s: float = 0.0) -> None:
        """Raise EngineBrokenError if the watch gave up on a step or a worker has died; after a failed collective,
        ``grace_s`` is how long to wait for the cause to show."""
        deadline = time.monotonic() + grace_s
        while True:
            if self.failure is not None:
                raise EngineBrokenError(self.failure)
            dead = [f"{rank} (pid {process.pid}, {how_it_ended(process.exitcode)})"
                    for rank, process in enumerate(self.processes, start=1) if not process.is_alive()]
            if dead:
                raise EngineBrokenError(f"tensor-parallel worker{'s' if len(dead) > 1 else ''} {', '.join(dead)} "
                                        "died; the engine cannot run steps any more")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.02)

    def close(self) -> None:
        self._closed.set()
        self._armed.set()   # wakes the thread to see it
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        progress: dict[int, tuple[tuple[int, ...], float]] = {}   # rank: (counters, when they last changed)
        last_step, last_poll = -1, 0.0
        while True:
            self._armed.wait()
            if self._closed.wait(self.poll_s):
                return
            if not self._armed.is_set():
                continue   # that step ended
            now = time.monotonic()
            # a new step starts afresh; so does a poll far later than asked (this process was stopped or the host
            # suspended: nobody ran, so nobody is to blame)
            if self._step != last_step or now - last_poll > 2 * self.poll_s + 1.0:
                progress.clear()
            last_step, last_poll = self._step, now
            stalled = []
            for rank, process in enumerate(self.processes, start=1):
                sample = _sample(process.pid)
                if sample is None or sample[0] == "Z":
                    continue   # it exited: rank 0's collective fails and check() names it
                state, counters = sample
                seen = progress.get(rank)
                if seen is None or seen[0] != counters:
                    progress[rank] = (counters, now)
                elif now - seen[1] >= self.stall_s:
                    stalled.append(f"{rank} (pid {process.pid}, {STATES.get(state, state)})")
            if stalled:
                self._give_up(stalled)
                return

    def _give_up(self, stalled: list[str]) -> None:
        self.failure = (f"tensor-parallel worker{'s' if len(stalled) > 1 else ''} {', '.join(stalled)} made no "
                        f"progress for {self.stall_s:g} s while a step waited for it (hung); the engine ended its "
                        f"workers ({STALL_TIMEOUT_ENV} sets this limit)")
        logger.error("%s", self.failure)
        for process in self.processes:
            try:
                os.kill(process.pid, signal.SIGKILL)   # not Process.kill: that may reap, which is the main thread's
            except ProcessLookupError:
                pass
