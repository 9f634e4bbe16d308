"""The `cvllm plugins` command: its text and --json reports, entry-point distributions, exit codes."""

import json
import textwrap

import pytest

from cvllm.cli import main
from cvllm.testing.plugins import install_two_plugins, registers

pytestmark = pytest.mark.usefixtures("only_builtin_plugins")


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
          register_tool_parsers
            hermes = cvllm.server.tool_calls:TaggedParser
            mistral = cvllm.server.tool_calls:MistralParser
            llama3_json = cvllm.server.tool_calls:Llama3JsonParser
            deepseek_v3 = cvllm.server.tool_calls:DeepSeekParser
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
    assert report["builtin"]["hooks"] == ["open_checkpoint", "register_backends", "register_tool_parsers"]
    assert report["builtin"]["registered"]["register_backends"] == {"cpu": "cvllm.backends.cpu:CpuBackend"}
    assert "hermes" in report["builtin"]["registered"]["register_tool_parsers"]
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
