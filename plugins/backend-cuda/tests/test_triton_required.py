"""Under CI (CI=true) the Triton kernel tests fail, not skip, when triton cannot be imported: a CI run that
skipped them would pass without having run a kernel (cvllm.testing.requirements)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_ci_fails_without_triton(tmp_path):
    # a triton package that cannot be imported, first on the path: as if triton were not installed
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text('raise ImportError("no triton here")\n')
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    test_file = Path(__file__).with_name("test_kernels_interpret.py")
    command = [sys.executable, "-m", "pytest", str(test_file), "-p", "no:cacheprovider"]
    ci = subprocess.run(command, cwd=REPO, env={**os.environ, "CI": "true", "PYTHONPATH": path},
                        capture_output=True, text=True, timeout=300)
    assert ci.returncode != 0, ci.stdout + ci.stderr
    assert "Failed: cannot import triton (no triton here) (CI=true" in ci.stdout
    local = subprocess.run(command, cwd=REPO, env={**os.environ, "CI": "", "PYTHONPATH": path},
                           capture_output=True, text=True, timeout=300)
    assert "1 skipped" in local.stdout and "error" not in local.stdout, local.stdout + local.stderr
    assert "SKIPPED [1]" in local.stdout and "cannot import triton (no triton here)" in local.stdout
