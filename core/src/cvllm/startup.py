"""The start-up breakdown: how long each phase of bringing an engine up took, logged as one line."""

from __future__ import annotations

import os
import time


def process_age() -> float | None:
    """Seconds since this process started (Linux), or None where that cannot be read. Taken as an engine is
    created in a fresh process (the engine core), it is what the imports cost."""
    try:
        with open("/proc/self/stat") as f:
            # field 22, after the parenthesised command name (which may hold spaces): start time in clock ticks
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return max(0.0, float(f.read().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return None


class StartupPhases:
    """``mark(name)`` at the end of each phase; ``summary()`` the one line, e.g.
    ``3.1 s: imports 1.2 s, checkpoint 0.3 s, weights 1.4 s, KV cache 0.0 s, graphs 0.2 s``."""

    def __init__(self, imports: float | None = None):
        self.phases: list[tuple[str, float]] = [] if imports is None else [("imports", imports)]
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases.append((name, now - self._last))
        self._last = now

    def summary(self) -> str:
        total = sum(seconds for _, seconds in self.phases)
        return f"{total:.1f} s: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases)
