"""Makes the tests' reference (marlin_reference.py) importable and keeps torch to one thread on tiny tensors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from cvllm.testing.threads import one_torch_thread as single_torch_thread  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    with single_torch_thread():
        yield
