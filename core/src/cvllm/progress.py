"""Progress of a long phase (loading weights, quantizing): a bar while it runs, if stderr is a terminal, and
one summary line when it ends, e.g. ``loaded 272 weights (140.1 MiB) in 1.3 s``.

A log file gets only the summary line: a bar redraws itself with carriage returns, which turn a log into
one unreadable line. The summary counts what the bar counted, so the two never disagree.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def bars_shown(logger: logging.Logger) -> bool:
    """Bars only on a terminal, and only where the phase's INFO summary would be shown too."""
    return sys.stderr.isatty() and logger.isEnabledFor(logging.INFO)


class Progress:
    """One phase: ``update()`` as work finishes, then ``finish()`` logs
    ``"{verb} {count} {noun} ({size}){detail} in {seconds} s"``. As a context manager it finishes on
    success; a failed phase closes its bar and logs nothing (the error says what happened)."""

    def __init__(self, logger: logging.Logger, title: str, verb: str, noun: str, total: int | None = None):
        self.logger, self.verb, self.noun = logger, verb, noun
        self.count = 0
        self.nbytes = 0
        self.started = time.perf_counter()
        self.bar = None  # the tqdm bar, on a terminal only
        if bars_shown(logger):
            from tqdm import tqdm  # only a terminal needs it

            self.bar = tqdm(total=total, desc=title, unit=f" {noun}", leave=False)

    def update(self, n: int = 1, nbytes: int = 0) -> None:
        self.count += n
        self.nbytes += nbytes
        if self.bar is not None:
            self.bar.update(n)

    def track(self, items: Iterable[T], nbytes: Callable[[T], int] | None = None) -> Iterator[T]:
        """Yield ``items``, counting each (and its ``nbytes``) once the consumer is done with it."""
        for item in items:
            yield item
            self.update(1, nbytes(item) if nbytes is not None else 0)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def finish(self, detail: str = "") -> None:
        self.close()
        size = f" ({self.nbytes / 2**20:.1f} MiB)" if self.nbytes else ""
        self.logger.info("%s %d %s%s%s in %.1f s", self.verb, self.count, self.noun, size, detail,
                         time.perf_counter() - self.started)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.close()
