"""The plugin hookspecs (each documents its signature, in docs/plugins.md too) and one test per hook."""

import inspect
import json
import os
from pathlib import Path

import pytest

from cvllm import builtin_plugin, hookspecs, plugins
from cvllm.hookspecs import hookimpl
from cvllm.plugins import RegistryError, get_plugin_manager
from cvllm.testing.plugins import registers

HOOK_NAMES = {name for name, obj in vars(hookspecs).items() if hasattr(obj, "cvllm_spec")}

pytestmark = pytest.mark.usefixtures("only_builtin_plugins")


# --- hookspecs -------------------------------------------------------------------------------------


def test_every_hookspec_documents_its_signature():
    assert HOOK_NAMES == {"register_architectures", "register_backends", "register_quantizers",
                          "register_samplers", "register_gguf_architectures", "register_converters",
                          "register_tool_parsers", "open_checkpoint"}
    for name in HOOK_NAMES:
        spec = getattr(hookspecs, name)
        assert spec.__doc__, name
        assert spec.__doc__.strip().splitlines()[0] == f"{name}{inspect.signature(spec)}"


def test_every_hook_has_a_test():
    assert {f"test_hook_{name}" for name in HOOK_NAMES} <= set(globals())


def test_plugin_docs_give_every_hook_signature():
    docs = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
    if not docs.exists():
        pytest.skip("docs/ is not part of this checkout")
    text = docs.read_text()
    for name in HOOK_NAMES:
        assert f"{name}{inspect.signature(getattr(hookspecs, name))}" in text, name


# --- one test per hook -----------------------------------------------------------------------------


def test_hook_register_architectures(add_plugin):
    add_plugin(registers("register_architectures", ("LlamaForCausalLM", "pkg.llama:LlamaForCausalLM"),
                         ("MistralForCausalLM", "pkg.llama:LlamaForCausalLM")), "llamas")
    archs = plugins.architectures()
    assert archs.names() == ["LlamaForCausalLM", "MistralForCausalLM"]
    assert archs.spec("MistralForCausalLM") == "pkg.llama:LlamaForCausalLM"
    assert archs.owner("LlamaForCausalLM") == "llamas"
    assert "LlamaForCausalLM" in archs and "FooForCausalLM" not in archs
    with pytest.raises(RegistryError) as excinfo:
        archs.get("FooForCausalLM")
    assert str(excinfo.value) == ("unknown architecture 'FooForCausalLM'; registered: LlamaForCausalLM, "
                                  "MistralForCausalLM (install a plugin that provides it)")


def test_hook_register_backends(add_plugin):
    assert plugins.backends().names() == ["cpu"]
    assert plugins.backends().spec("cpu") == "cvllm.backends.cpu:CpuBackend"
    assert plugins.backends().owner("cpu") == "builtin"
    add_plugin(registers("register_backends", ("fake", "fake_backend:FakeBackend")), "fakebackend")
    assert plugins.backends().names() == ["cpu", "fake"]
    assert plugins.backends().owner("fake") == "fakebackend"


def test_hook_register_quantizers(add_plugin):
    assert plugins.quantizers().names() == []

    class Gptq:
        pass

    add_plugin(registers("register_quantizers", ("gptq", Gptq), ("awq", "q_pkg.awq:Awq")), "quant")
    assert plugins.quantizers().names() == ["awq", "gptq"]
    # An object registered directly (not as a string) is returned as is, without importing anything.
    assert plugins.quantizers().get("gptq") is Gptq
    assert plugins.quantizers().spec("awq") == "q_pkg.awq:Awq"


def test_hook_register_converters(add_plugin, tmp_path, capsys):
    from cvllm.cli import main

    assert plugins.converters().names() == []
    seen = []

    def convert(src, out, options):
        seen.append((src, out, options))
        if options["bits"] == 3:
            raise ValueError("3 bits? no")

    add_plugin(registers("register_converters", ("toy", convert)), "conv")
    assert plugins.converters().names() == ["toy"]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text("{}")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--to", "toy", "--asym"]) == 0
    assert seen == [(tmp_path / "src", tmp_path / "out", {"bits": None, "group_size": None, "sym": False})]
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--to", "toy", "--bits", "3"]) == 1
    assert "3 bits? no" in capsys.readouterr().err


def test_hook_register_samplers(add_plugin):
    assert plugins.logits_processors().names() == []   # the sampler is core's own; plugins add logits processors
    add_plugin(registers("register_samplers", ("json_mode", "json:JSONDecoder")), "jsonplug")
    assert plugins.logits_processors().get("json_mode") is json.JSONDecoder
    assert plugins.logits_processors().owner("json_mode") == "jsonplug"


def test_hook_register_tool_parsers(add_plugin):
    from cvllm.server.tool_calls import tool_parser

    assert plugins.tool_parsers().names() == ["deepseek_v3", "hermes", "llama3_json", "mistral"]   # core's
    add_plugin(registers("register_tool_parsers", ("xml_calls", "json:JSONDecoder")), "xmlplug")
    assert tool_parser("xml_calls") is json.JSONDecoder
    assert plugins.tool_parsers().owner("xml_calls") == "xmlplug"


def test_hook_register_gguf_architectures(add_plugin):
    add_plugin(registers("register_gguf_architectures", ("llama", "pkg.gguf:LlamaAdapter")), "ggufmap")
    assert plugins.gguf_architectures().names() == ["llama"]
    assert plugins.gguf_architectures().owner("llama") == "ggufmap"
    with pytest.raises(RegistryError, match=r"unknown gguf architecture 'qwen2'; registered: llama "):
        plugins.gguf_architectures().get("qwen2")


def test_hook_open_checkpoint(add_plugin, tmp_path):
    gguf_file = tmp_path / "model.gguf"
    gguf_file.write_bytes(b"GGUF")
    other_file = tmp_path / "model.bin"
    other_file.write_bytes(b"?")
    claimed = []

    class GgufReader:
        @hookimpl
        def open_checkpoint(self, path):
            claimed.append(path)
            return ("gguf checkpoint", path) if path.endswith(".gguf") else None

    add_plugin(GgufReader(), "gguf")
    assert plugins.open_checkpoint(gguf_file) == ("gguf checkpoint", str(gguf_file))
    assert claimed == [str(gguf_file)]  # the hook receives a str even when given a Path

    # The built-in reader takes only directories, and runs after every other reader.
    assert builtin_plugin.open_checkpoint(path=str(gguf_file)) is None
    impls = get_plugin_manager().hook.open_checkpoint.get_hookimpls()
    builtin_impl = next(impl for impl in impls if impl.plugin_name == "builtin")
    assert builtin_impl.trylast
    assert impls[0] is builtin_impl  # pluggy calls the list back to front: first in list = last called

    with pytest.raises(ValueError, match=r"no plugin can open '.*model\.bin'; checkpoint readers installed: "
                                         r"builtin, gguf$"):
        plugins.open_checkpoint(other_file)
    with pytest.raises(FileNotFoundError, match=r"no plugin can open '.*missing\.bin': no such file"):
        plugins.open_checkpoint(tmp_path / "missing.bin")


def test_open_checkpoint_asks_plugins_before_the_builtin_directory_reader(add_plugin, tmp_path):
    class ClaimsDirectories:
        @hookimpl
        def open_checkpoint(self, path):
            return "own layout" if os.path.isdir(path) else None

    add_plugin(ClaimsDirectories(), "dirs")
    assert plugins.open_checkpoint(tmp_path) == "own layout"
