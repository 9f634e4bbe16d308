"""Fixtures shared by the core tests, and the plugin helpers of the test_plugin_*.py / test_cli_plugins.py files."""

import sys
import textwrap
from pathlib import Path

import pytest

from cvllm.plugins import get_plugin_manager, reset_plugins
from cvllm.testing.threads import one_torch_thread as _one_torch_thread
from cvllm.testing.tokenizer import write_tiny_tokenizer
from cvllm.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def one_torch_thread():
    with _one_torch_thread():
        yield


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A directory cvserve's flags accept as a model (its config.json is empty: nothing is loaded)."""
    path = tmp_path / "my-model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    """The tests' tiny byte-level BPE tokenizer, written and loaded as a checkpoint's would be."""
    path = tmp_path_factory.mktemp("tokenizer")
    write_tiny_tokenizer(path)
    return Tokenizer.from_dir(path)


# --- plugins: a manager with only the built-in plugin, inline plugins, fake installed distributions ------
# The plugin test modules use only_builtin_plugins on every test (pytestmark); the plain helpers are in
# cvllm.testing.plugins.


@pytest.fixture
def only_builtin_plugins(monkeypatch):
    # Installed entry-point plugins stay out unless a test asks for them.
    monkeypatch.setenv("CVLLM_PLUGINS", "")
    monkeypatch.delenv("CVLLM_TRACE_HOOKS", raising=False)
    reset_plugins()
    yield
    reset_plugins()


@pytest.fixture
def add_plugin():
    """Register inline plugin objects on the current manager; unregister them afterwards."""
    added = []

    def add(plugin: object, name: str) -> object:
        pm = get_plugin_manager()
        pm.register(plugin, name=name)
        added.append((pm, plugin))
        return plugin

    try:
        yield add
    finally:
        for pm, plugin in added:
            if pm.is_registered(plugin):
                pm.unregister(plugin)


@pytest.fixture
def site_dir(tmp_path, monkeypatch):
    """A directory on sys.path where tests install fake distributions with cvllm entry points."""
    monkeypatch.syspath_prepend(str(tmp_path))
    modules: list[str] = []

    def install(dist: str, version: str, entry_points: dict[str, str], sources: dict[str, str]) -> None:
        info = tmp_path / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = "".join(f"{name} = {module}\n" for name, module in entry_points.items())
        (info / "entry_points.txt").write_text(f"[cvllm]\n{lines}")
        for module, source in sources.items():
            (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
            modules.append(module)

    install.path = tmp_path
    yield install
    for module in modules:
        sys.modules.pop(module, None)
