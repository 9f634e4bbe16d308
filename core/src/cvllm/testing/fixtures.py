"""pytest fixtures the model plugins' oracle tests share. A conftest imports the ones its tests use by name: pytest
finds a fixture among a conftest's names. This module imports pytest, so cvllm.testing's ``__init__`` leaves it out."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cvllm.testing.oracle import Harness
from cvllm.testing.threads import one_torch_thread as _one_torch_thread


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models are all per-op overhead: a second OpenMP thread only spins (5x slower on a busy machine)."""
    with _one_torch_thread():
        yield


@pytest.fixture(scope="session")
def harness() -> Harness:
    """The oracle tests' helpers with cvllm.testing's numbers; a plugin that needs others defines its own
    ``harness`` returning a subclass."""
    return Harness()
