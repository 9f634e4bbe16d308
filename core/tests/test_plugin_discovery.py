"""Plugin discovery through entry points: a fresh process, distributions, the CVLLM_PLUGINS allowlist, broken
or misspelled plugins, and CVLLM_TRACE_HOOKS."""

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pluggy
import pytest

from cvllm import plugins
from cvllm.hookspecs import hookimpl
from cvllm.plugins import get_plugin_manager, reset_plugins
from cvllm.testing.plugins import PLUGIN_ONE, install_two_plugins

pytestmark = pytest.mark.usefixtures("only_builtin_plugins")


# --- entry points, CVLLM_PLUGINS, failures, tracing -------------------------------------------------


def test_fresh_process_discovers_every_installed_plugin_without_importing_targets(site_dir):
    source = PLUGIN_ONE.replace("fake_one_model", "fake_lazy_model")
    site_dir("cvllm-fake-lazy", "1.0", {"fake_lazy": "fake_lazy_plugin"}, {"fake_lazy_plugin": source,
             "fake_lazy_model": "class OneForCausalLM:\n    pass\n"})
    script = textwrap.dedent("""
        import json, sys
        from cvllm import plugins
        registries = [plugins.architectures(), plugins.backends(), plugins.quantizers(),
                      plugins.logits_processors(), plugins.gguf_architectures()]
        plugins.plugin_report()
        targets = [r.spec(name) for r in registries for name in r.names()]
        modules = {t.partition(":")[0] for t in targets if isinstance(t, str)}
        print(json.dumps({"targets": targets, "imported": sorted(m for m in modules if m in sys.modules)}))
    """)
    core_src = Path(plugins.__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("CVLLM_PLUGINS", "CVLLM_TRACE_HOOKS")}
    env["PYTHONPATH"] = os.pathsep.join([str(core_src), str(site_dir.path)])
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                            check=True, timeout=120)
    found = json.loads(result.stdout)
    assert "fake_lazy_model:OneForCausalLM" in found["targets"]
    assert "cvllm.backends.cpu:CpuBackend" in found["targets"]
    assert found["imported"] == []


def test_entry_point_plugins_load_with_their_distribution(site_dir, monkeypatch):
    monkeypatch.delenv("CVLLM_PLUGINS")
    install_two_plugins(site_dir)
    archs = plugins.architectures()
    assert archs.owner("OneForCausalLM") == "fake_one"
    assert archs.owner("TwoForCausalLM") == "fake_two"
    report = {entry["name"]: entry for entry in plugins.plugin_report()}
    assert report["fake_one"]["distribution"] == "cvllm-fake-one"
    assert report["fake_one"]["version"] == "1.2.3"
    assert report["fake_one"]["registered"] == {
        "register_architectures": {"OneForCausalLM": "fake_one_model:OneForCausalLM"}}
    assert report["builtin"]["distribution"] is None and report["builtin"]["builtin"] is True


@pytest.mark.parametrize(("allowlist", "expected"), [
    ("fake_two", ["TwoForCausalLM"]),
    (" fake_one , fake_two ", ["OneForCausalLM", "TwoForCausalLM"]),
    ("", []),
])
def test_cvllm_plugins_is_an_allowlist(site_dir, monkeypatch, allowlist, expected):
    install_two_plugins(site_dir)
    monkeypatch.setenv("CVLLM_PLUGINS", allowlist)
    assert plugins.architectures().names() == expected
    assert plugins.backends().names() == ["cpu"]  # built-ins are always on
    loaded = {name for name, _ in get_plugin_manager().list_name_plugin()}
    assert loaded == {"builtin"} | {"fake_one", "fake_two"} & {n.strip() for n in allowlist.split(",")}


def test_cvllm_plugins_warns_about_names_nobody_provides(site_dir, monkeypatch, caplog):
    install_two_plugins(site_dir)
    monkeypatch.setenv("CVLLM_PLUGINS", "fake_one,nosuchplugin")
    with caplog.at_level(logging.WARNING, logger="cvllm.plugins"):
        assert plugins.architectures().names() == ["OneForCausalLM"]
    assert "CVLLM_PLUGINS names nosuchplugin, but no installed plugin has that name" in caplog.text


def test_broken_entry_point_warns_and_the_others_still_load(site_dir, monkeypatch, caplog):
    monkeypatch.delenv("CVLLM_PLUGINS")
    install_two_plugins(site_dir)
    site_dir("cvllm-fake-broken", "0.1", {"fake_broken": "fake_broken_plugin"},
             {"fake_broken_plugin": "raise ImportError('needs the missing library zzz')\n"})
    with caplog.at_level(logging.WARNING, logger="cvllm.plugins"):
        names = plugins.architectures().names()
    assert {"OneForCausalLM", "TwoForCausalLM"} <= set(names)
    [record] = [r for r in caplog.records if "fake_broken" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "ImportError: needs the missing library zzz" in record.getMessage()
    report = {entry["name"]: entry for entry in plugins.plugin_report()}
    assert report["fake_broken"]["error"] == "ImportError: needs the missing library zzz"
    assert report["fake_broken"]["distribution"] == "cvllm-fake-broken"
    assert not get_plugin_manager().has_plugin("fake_broken")


def test_entry_point_with_a_misspelled_hook_is_skipped_with_a_warning(site_dir, monkeypatch, caplog):
    install_two_plugins(site_dir)
    misspelled = PLUGIN_ONE.replace("def register_architectures", "def register_architecture")
    site_dir("cvllm-fake-typo", "0.1", {"fake_typo": "fake_typo_plugin"}, {"fake_typo_plugin": misspelled})
    monkeypatch.setenv("CVLLM_PLUGINS", "fake_typo,fake_two")
    with caplog.at_level(logging.WARNING, logger="cvllm.plugins"):
        assert plugins.architectures().names() == ["TwoForCausalLM"]
    assert "'fake_typo'" in caplog.text and "unknown hook(s) register_architecture;" in caplog.text
    assert not get_plugin_manager().has_plugin("fake_typo")


def test_registering_a_misspelled_hook_fails_naming_it():
    class Typo:
        @hookimpl
        def register_backend(self, register):
            register("x", "x:X")

    with pytest.raises(pluggy.PluginValidationError, match=r"unknown hook\(s\) register_backend;"):
        get_plugin_manager().register(Typo(), name="typo")
    assert not get_plugin_manager().has_plugin("typo")
    get_plugin_manager().check_pending()  # nothing of the rejected plugin is left behind


def test_cvllm_trace_hooks_logs_each_hook_call(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="cvllm.plugins.trace")
    plugins.backends()
    assert not [r for r in caplog.records if r.name == "cvllm.plugins.trace"]

    monkeypatch.setenv("CVLLM_TRACE_HOOKS", "1")
    reset_plugins()
    plugins.backends()
    traced = [r.getMessage() for r in caplog.records if r.name == "cvllm.plugins.trace"]
    assert traced == ["hook register_backends(register=<register for plugin 'builtin'>) -> plugins [builtin]",
                      "hook register_backends returned []"]
