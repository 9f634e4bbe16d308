"""For the chat page's tests: a model directory the engine serves with fake steps (a real tokenizer and config, no
real weights), a headless Chromium driven through Selenium and the system chromedriver, and the server's
metrics as numbers.

The browser is the system's (Debian's ``chromium`` and ``chromium-driver``; .ci/run installs them): nothing is
downloaded at run time. Where it is missing the browser test skips and says why, unless
``CVLLM_REQUIRE_BROWSER=1`` (set by .ci/run once it installed them) makes that an error.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from cvllm.testing.checkpoints import BASE_CONFIG
from cvllm.testing.tokenizer import write_tiny_tokenizer

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def fake_model_dir(parent: Path, context: int = 4096) -> Path:
    """A Llama-shaped checkpoint directory for ``fake_step_ms`` serving: config, tokenizer (its ChatML template)
    and one placeholder tensor; the fake runner never reads weights."""
    path = parent / "tiny-chat"
    path.mkdir(parents=True, exist_ok=True)
    write_tiny_tokenizer(path)
    config = {**BASE_CONFIG, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "max_position_embeddings": context}
    (path / "config.json").write_text(json.dumps(config))
    save_file({"placeholder": torch.zeros(1)}, str(path / "model.safetensors"))
    return path


def _missing(reason: str):
    print(f"\nbrowser test: {reason}")
    if os.environ.get("CVLLM_REQUIRE_BROWSER", "") == "1":
        pytest.fail(f"{reason} (CVLLM_REQUIRE_BROWSER=1: a missing browser is an error, not a skip)", pytrace=False)
    pytest.skip(reason)


def headless_chromium(window: tuple[int, int] = (1280, 860)) -> Any:
    """A Selenium driver of the system's headless Chromium, or a skip saying what is missing."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as exc:
        _missing(f"selenium is not installed ({exc}); pip install selenium")
    browser = next((found for name in CHROMIUM_NAMES if (found := shutil.which(name))), None)
    driver = shutil.which("chromedriver") or ("/usr/lib/chromium/chromedriver"
                                              if os.path.exists("/usr/lib/chromium/chromedriver") else None)
    if browser is None or driver is None:
        _missing("no chromium and chromedriver on PATH (Debian: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                 "--disable-extensions", "--disable-background-networking", f"--window-size={window[0]},{window[1]}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # both paths given: selenium-manager, which would look for a browser on the network, is never run
    return webdriver.Chrome(options=options, service=Service(executable_path=driver))


def metric(url: str, name: str, **labels: str) -> float:
    """The value of one sample of ``url``'s /metrics (0 when absent)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(found.get(key) == value for key, value in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def save_artifact(source: Path) -> None:
    """Copy a file the test made (a screenshot) to $CVLLM_TEST_ARTIFACTS, where CI keeps such files."""
    target = os.environ.get("CVLLM_TEST_ARTIFACTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(source, Path(target) / source.name)


def until(check, what: str, timeout: float = 10.0):
    """Poll ``check`` until it returns something true (returned), or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
    return value
