"""Helpers for tests of plugin machinery: an inline plugin that registers names under one hook, and two fake
installed plugin distributions (their modules written by the tests' ``site_dir`` fixture)."""

from __future__ import annotations

from cvllm.hookspecs import hookimpl


def registers(hook: str, *pairs: tuple[str, object]) -> object:
    """A plugin object whose ``hook`` (a register_* hookspec) registers each (name, target) of ``pairs``."""
    # pluggy finds hook implementations by attribute name; build a class with that one method.
    def method(self, register):
        for name, target in pairs:
            register(name, target)

    method.__name__ = hook
    return type(f"Registers_{hook}", (), {hook: hookimpl(method)})()


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
    """Install cvllm-fake-one 1.2.3 and cvllm-fake-two 0.4 with ``site_dir(dist, version, entry_points, sources)``."""
    site_dir("cvllm-fake-one", "1.2.3", {"fake_one": "fake_one_plugin"}, {"fake_one_plugin": PLUGIN_ONE})
    site_dir("cvllm-fake-two", "0.4", {"fake_two": "fake_two_plugin"}, {"fake_two_plugin": PLUGIN_TWO})
