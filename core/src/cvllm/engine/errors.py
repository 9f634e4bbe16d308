"""Errors that mean the engine itself is finished, not just the step that raised them."""

from __future__ import annotations


class EngineBrokenError(RuntimeError):
    """The engine cannot run another step: a tensor-parallel worker died or hung, or a step failed part-way and left
    the ranks out of step. Unlike an ordinary step failure (which fails only that step's requests), the engine core
    reports itself dead on this one (``/health`` 503, every open stream gets the error), since every later step would
    fail the same way or wait forever in a collective."""
