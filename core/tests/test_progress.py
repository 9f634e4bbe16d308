"""A long phase shows a bar only on a terminal, and always ends in one summary line with the bar's count."""

from __future__ import annotations

import io
import logging

import pytest

from cvllm.progress import Progress

logger = logging.getLogger("cvllm.test_progress")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_phase(items: list[bytes]) -> tuple[list[bytes], int | None]:
    """What the phase yielded, and the count its bar (if any) showed at the end."""
    with Progress(logger, "Loading weights", "loaded", "weights") as progress:
        seen = list(progress.track(items, nbytes=len))
        return seen, None if progress.bar is None else progress.bar.n


@pytest.mark.parametrize("terminal", [False, True])
def test_one_summary_line_with_the_count_and_a_bar_only_on_a_terminal(terminal, monkeypatch, caplog):
    stderr = Terminal() if terminal else io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    items = [b"x" * 2**20, b"y" * 2**20, b"z" * 2**19]
    with caplog.at_level(logging.INFO, logger=logger.name):
        seen, bar_count = run_phase(items)
    assert seen == items
    [summary] = [record.getMessage() for record in caplog.records]
    assert summary.startswith("loaded 3 weights (2.5 MiB) in ") and summary.endswith(" s")
    if terminal:
        assert bar_count == 3 and "Loading weights" in stderr.getvalue()
    else:
        assert bar_count is None and stderr.getvalue() == ""


def test_no_bar_when_info_is_not_shown(monkeypatch, caplog):
    stderr = Terminal()
    monkeypatch.setattr("sys.stderr", stderr)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        run_phase([b"x"])
    assert stderr.getvalue() == "" and not caplog.records


def test_a_failed_phase_logs_no_summary(monkeypatch, caplog):
    monkeypatch.setattr("sys.stderr", Terminal())
    with caplog.at_level(logging.INFO, logger=logger.name), pytest.raises(ValueError):
        with Progress(logger, "Quantizing", "quantized", "layers", total=4) as progress:
            progress.update()
            raise ValueError("bad tensor")
    assert not caplog.records


def test_finish_appends_the_detail(caplog):
    with caplog.at_level(logging.INFO, logger=logger.name):
        progress = Progress(logger, "Quantizing", "quantized", "linear layers", total=2)
        progress.update(2)
        progress.finish(" to Q4_K, 2.0 MiB -> 0.6 MiB")
    [summary] = [record.getMessage() for record in caplog.records]
    assert summary.startswith("quantized 2 linear layers to Q4_K, 2.0 MiB -> 0.6 MiB in ")
