import inspect
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pluggy
import pytest

from cvllm import builtin_plugin, hookspecs, plugins
from cvllm.cli import main
from cvllm.hookspecs import hookimpl
from cvllm.plugins import RegistryError, get_plugin_manager, load_target, reset_plugins

HOOK_NAMES = {name for name, obj in vars(hookspecs).items() if hasattr(obj, "cvllm_spec")}
REGISTRIES = {
    "register_architectures": plugins.architectures,
    "register_backends": plugins.backends,
    "register_quantizers": plugins.quantizers,
    "register_samplers": plugins.samplers,
    "register_gguf_architectures": plugins.gguf_architectures,
}


@pytest.fixture(autouse=True)
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


def registers(hook: str, *pairs: tuple[str, object]) -> object:
    # pluggy finds hook implementations by attribute name; build a class with that one method.
    def method(self, register):
        for name, target in pairs:
            register(name, target)

    method.__name__ = hook
    return type(f"Registers_{hook}", (), {hook: hookimpl(method)})()


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


PLUGIN_ONE = """
    from cvllm.hookspecs import hookimpl

    @hookimpl
    def register_architectures(register):
        register("OneForCausalLM", "fake_one_model:OneForCausalLM")
"""
PLUGIN_TWO = """
    from cvllm.hookspecs import hookimpl

    @hookimpl
    def register_architectures(register):
        register("TwoForCausalLM", "fake_two_model:TwoForCausalLM")
"""


def install_two_plugins(site_dir) -> None:
    site_dir("cvllm-fake-one", "1.2.3", {"fake_one": "fake_one_plugin"}, {"fake_one_plugin": PLUGIN_ONE})
    site_dir("cvllm-fake-two", "0.4", {"fake_two": "fake_two_plugin"}, {"fake_two_plugin": PLUGIN_TWO})


# --- hookspecs -------------------------------------------------------------------------------------


def test_every_hookspec_documents_its_signature():
    assert HOOK_NAMES == {"register_architectures", "register_backends", "register_quantizers",
                          "register_samplers", "register_gguf_architectures", "open_checkpoint"}
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


def test_hook_register_samplers(add_plugin):
    assert plugins.samplers().spec("default") == "cvllm.engine.sampler:Sampler"
    add_plugin(registers("register_samplers", ("json_mode", "json:JSONDecoder")), "jsonplug")
    assert plugins.samplers().get("json_mode") is json.JSONDecoder
    assert plugins.samplers().owner("json_mode") == "jsonplug"


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
    with pytest.raises(RegistryError, match="by plugin 'twice' and by plugin 'twice'"):
        plugins.samplers()


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


def test_fresh_process_discovers_every_installed_plugin_without_importing_targets(site_dir):
    source = PLUGIN_ONE.replace("fake_one_model", "fake_lazy_model")
    site_dir("cvllm-fake-lazy", "1.0", {"fake_lazy": "fake_lazy_plugin"}, {"fake_lazy_plugin": source,
             "fake_lazy_model": "class OneForCausalLM:\n    pass\n"})
    script = textwrap.dedent("""
        import json, sys
        from cvllm import plugins
        registries = [plugins.architectures(), plugins.backends(), plugins.quantizers(),
                      plugins.samplers(), plugins.gguf_architectures()]
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


# --- entry points, CVLLM_PLUGINS, failures, tracing -------------------------------------------------


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


# --- cvllm plugins ---------------------------------------------------------------------------------


def test_cli_plugins_lists_each_plugin_and_what_it_registered(add_plugin, capsys):
    add_plugin(registers("register_architectures", ("MyForCausalLM", "my_pkg.model:MyForCausalLM")), "mine")
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert out == textwrap.dedent("""\
        builtin (built in)
          open_checkpoint
          register_backends
            cpu = cvllm.backends.cpu:CpuBackend
          register_samplers
            default = cvllm.engine.sampler:Sampler
        mine (registered at run time)
          register_architectures
            MyForCausalLM = my_pkg.model:MyForCausalLM
        """)


def test_cli_plugins_json(add_plugin, capsys):
    class Fp8:
        pass

    add_plugin(registers("register_quantizers", ("fp8", Fp8)), "fp8plug")
    assert main(["plugins", "--json"]) == 0
    report = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)}
    assert set(report) == {"builtin", "fp8plug"}
    assert report["builtin"]["hooks"] == ["open_checkpoint", "register_backends", "register_samplers"]
    assert report["builtin"]["registered"] == {
        "register_backends": {"cpu": "cvllm.backends.cpu:CpuBackend"},
        "register_samplers": {"default": "cvllm.engine.sampler:Sampler"}}
    fp8_target = f"{__name__}:test_cli_plugins_json.<locals>.Fp8"
    assert report["fp8plug"]["registered"] == {"register_quantizers": {"fp8": fp8_target}}
    assert report["fp8plug"]["distribution"] is None and report["fp8plug"]["error"] is None


def test_cli_plugins_names_the_distribution_of_entry_point_plugins(site_dir, monkeypatch, capsys):
    install_two_plugins(site_dir)
    monkeypatch.setenv("CVLLM_PLUGINS", "fake_one")
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert ("fake_one (cvllm-fake-one 1.2.3)\n  register_architectures\n"
            "    OneForCausalLM = fake_one_model:OneForCausalLM\n") in out


def test_cli_plugins_exits_1_on_a_name_conflict(add_plugin, capsys):
    add_plugin(registers("register_backends", ("cpu", "other_pkg:Cpu")), "rival")
    assert main(["plugins"]) == 1
    captured = capsys.readouterr()
    assert "rival (registered at run time)\n  register_backends\n    cpu = other_pkg:Cpu\n" in captured.out
    assert captured.err.startswith("error: backend 'cpu' is registered twice:")
    assert "'builtin'" in captured.err and "'rival'" in captured.err


def test_cli_without_a_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "plugins" in capsys.readouterr().err
