"""The tensor-parallel watch (engine/tensor_parallel/watchdog.py) over plain processes: a worker that makes no progress
while a step waits for it is named and killed, a busy one never is, waiting between steps is no hang, a dead one is
named with how it ended, and the limit comes from CVLLM_TP_STALL_TIMEOUT_S."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time

import pytest

from cvllm.engine.errors import EngineBrokenError
from cvllm.engine.tensor_parallel.watchdog import STALL_TIMEOUT_ENV, WorkerWatch, stall_timeout_s

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="progress is read from /proc")


def spin() -> None:
    while True:
        pass


def start(target, *args):
    process = multiprocessing.get_context("fork").Process(target=target, args=args, daemon=True)
    process.start()
    return process


def wait_for_failure(watch: WorkerWatch, within: float) -> None:
    deadline = time.monotonic() + within
    while watch.failure is None and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.fixture
def processes():
    started = []
    yield started
    for process in started:
        process.kill()
        process.join()


def test_a_stopped_worker_fails_the_step_and_every_worker_is_killed(processes):
    processes += [start(time.sleep, 60), start(time.sleep, 60)]
    stopped = processes[1]
    watch = WorkerWatch(processes, stall_s=0.5)
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        start_time = time.monotonic()
        with watch.step():
            wait_for_failure(watch, 5)
        assert 0.5 <= time.monotonic() - start_time < 3
        # both are idle in this step (the other as a rank waiting on the stopped one would be): both are named
        assert f"2 (pid {stopped.pid}, stopped)" in watch.failure
        assert "made no progress for 0.5 s while a step waited" in watch.failure
        assert STALL_TIMEOUT_ENV in watch.failure
        for process in processes:   # killed, so that rank 0's collective fails at once
            process.join(5)
            assert process.exitcode == -signal.SIGKILL
        with pytest.raises(EngineBrokenError, match=r"pid \d+, stopped\) made no progress"):
            watch.check()
    finally:
        watch.close()


def test_a_busy_worker_is_no_hang_however_long_the_step(processes):
    processes.append(start(spin))
    watch = WorkerWatch(processes, stall_s=0.4)
    try:
        with watch.step():
            time.sleep(1.5)
        assert watch.failure is None
        watch.check()
    finally:
        watch.close()


def test_waiting_between_steps_is_no_hang_but_idling_during_one_is(processes):
    processes.append(start(time.sleep, 60))
    watch = WorkerWatch(processes, stall_s=0.3)
    try:
        for _ in range(20):   # short steps, and time between them: the worker sleeps throughout
            with watch.step():
                time.sleep(0.01)
            time.sleep(0.05)
        assert watch.failure is None
        with watch.step():
            wait_for_failure(watch, 3)
        assert f"1 (pid {processes[0].pid}, sleeping)" in watch.failure
    finally:
        watch.close()


def test_dead_workers_are_named_with_how_they_ended(processes):
    processes += [start(os._exit, 3), start(time.sleep, 60)]
    watch = WorkerWatch(processes, stall_s=None)   # no thread: deaths are still reported
    try:
        processes[1].kill()
        for process in processes:
            process.join(5)
        with pytest.raises(EngineBrokenError) as raised:
            watch.check()
        assert str(raised.value) == (f"tensor-parallel workers 1 (pid {processes[0].pid}, exit code 3), 2 (pid "
                                     f"{processes[1].pid}, killed by SIGKILL) died; the engine cannot run steps any "
                                     "more")
    finally:
        watch.close()


def test_the_stall_limit_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(STALL_TIMEOUT_ENV, raising=False)
    assert stall_timeout_s() == 30
    for text, value in [("2.5", 2.5), (" 10 ", 10), ("0", None)]:
        monkeypatch.setenv(STALL_TIMEOUT_ENV, text)
        assert stall_timeout_s() == value
    for text in ["soon", "-1", "nan", "inf"]:
        monkeypatch.setenv(STALL_TIMEOUT_ENV, text)
        with pytest.raises(ValueError, match=f"{STALL_TIMEOUT_ENV}='{text}': expected a number of seconds"):
            stall_timeout_s()
