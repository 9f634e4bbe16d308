"""The registries the hooks fill: name conflicts, plugins added and removed later, malformed or unloadable
targets, load_target, and targets imported only on get()."""

import os
import sys

import pytest

from cvllm import plugins
from cvllm.plugins import RegistryError, get_plugin_manager, load_target
from cvllm.testing.plugins import registers

REGISTRIES = {
    "register_architectures": plugins.architectures,
    "register_backends": plugins.backends,
    "register_quantizers": plugins.quantizers,
    "register_samplers": plugins.logits_processors,
    "register_gguf_architectures": plugins.gguf_architectures,
}

pytestmark = pytest.mark.usefixtures("only_builtin_plugins")


# --- registries ------------------------------------------------------------------------------------


def test_same_name_from_two_plugins_is_an_error_naming_both(add_plugin):
    add_plugin(registers("register_architectures", ("DupForCausalLM", "a_pkg:Dup")), "alpha")
    add_plugin(registers("register_architectures", ("DupForCausalLM", "b_pkg:Dup")), "beta")
    with pytest.raises(RegistryError) as excinfo:
        plugins.architectures()
    message = str(excinfo.value)
    assert "architecture 'DupForCausalLM' is registered twice" in message
    assert "'alpha'" in message and "'beta'" in message


def test_same_name_twice_from_one_plugin_is_an_error(add_plugin):
    add_plugin(registers("register_backends", ("cpu", "solo_pkg:Cpu")), "solo")
    with pytest.raises(RegistryError, match=r"backend 'cpu' is registered twice: by plugin '(builtin|solo)' "
                                            r"and by plugin '(builtin|solo)'"):
        plugins.backends()
    get_plugin_manager().unregister(name="solo")
    add_plugin(registers("register_samplers", ("greedy", "x:Greedy"), ("greedy", "x:Greedy2")), "twice")
    with pytest.raises(RegistryError, match="logits processor 'greedy' is registered twice: by plugin 'twice' and "
                                            "by plugin 'twice'"):
        plugins.logits_processors()


def test_registries_follow_plugins_registered_and_unregistered_later(add_plugin):
    assert "LateForCausalLM" not in plugins.architectures()
    plugin = add_plugin(registers("register_architectures", ("LateForCausalLM", "late:Late")), "late")
    assert "LateForCausalLM" in plugins.architectures()
    get_plugin_manager().unregister(plugin)
    assert "LateForCausalLM" not in plugins.architectures()


def test_malformed_target_is_rejected_naming_the_plugin(add_plugin):
    add_plugin(registers("register_backends", ("tpu", "no_colon_here")), "sloppy")
    with pytest.raises(RegistryError, match=r"plugin 'sloppy' \(register_backends\) registered 'tpu' as "
                                            r"'no_colon_here'; expected 'package.module:Attribute'"):
        plugins.backends()


def test_load_target():
    assert load_target("os.path:join") is os.path.join
    assert load_target("os:path.join") is os.path.join  # dotted attribute path
    marker = object()
    assert load_target(marker) is marker
    with pytest.raises(ImportError, match=r"cannot import 'no_such_module_xyz:Thing': No module named"):
        load_target("no_such_module_xyz:Thing")
    with pytest.raises(ImportError, match=r"cannot import 'os.path:nope': module 'os.path' has no attribute"):
        load_target("os.path:nope")
    with pytest.raises(ValueError, match="expected 'package.module:Attribute'"):
        load_target("os.path.join")


def test_registry_get_failure_names_entry_and_plugin(add_plugin):
    add_plugin(registers("register_backends", ("npu", "no_such_module_xyz:Npu")), "npuplug")
    with pytest.raises(ImportError, match=r"backend 'npu' from plugin 'npuplug' cannot be loaded: "
                                          r"cannot import 'no_such_module_xyz:Npu'"):
        plugins.backends().get("npu")


def test_discovery_imports_no_target_until_get(add_plugin, tmp_path, monkeypatch):
    (tmp_path / "lazy_target_model.py").write_text("class LazyForCausalLM: ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazy_target_model", raising=False)
    add_plugin(registers("register_architectures", ("LazyForCausalLM", "lazy_target_model:LazyForCausalLM")),
               "lazy")
    for build in REGISTRIES.values():
        build()
    plugins.plugin_report()
    assert "lazy_target_model" not in sys.modules
    cls = plugins.architectures().get("LazyForCausalLM")
    module = sys.modules["lazy_target_model"]
    assert cls is module.LazyForCausalLM
    sys.modules.pop("lazy_target_model")
    # The registry keeps what it loaded: a second get() neither imports again nor returns a new object.
    assert plugins.architectures().get("LazyForCausalLM") is cls
    assert "lazy_target_model" not in sys.modules
