"""The plugin registers its architectures as lazy strings, and the installed entry point names it "phi"."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from cvllm import plugins

ARCHITECTURES = {
    "PhiForCausalLM": "cvllm_phi.phi:PhiForCausalLM",
    "Phi3ForCausalLM": "cvllm_phi.phi3:Phi3ForCausalLM",
}


@pytest.mark.parametrize(("name", "target"), ARCHITECTURES.items())
def test_architectures_registered(name: str, target: str) -> None:
    registry = plugins.architectures()
    assert registry.spec(name) == target
    assert registry.owner(name) == "phi"
    module, _, attr = target.partition(":")
    assert registry.get(name).__name__ == attr == name and registry.get(name).__module__ == module


def test_entry_point() -> None:
    (point,) = [p for p in entry_points(group="cvllm") if p.name == "phi"]
    assert point.value == "cvllm_phi.plugin"


@pytest.mark.parametrize(("name", "target"), [("phi2", "cvllm_phi.gguf_adapter:PHI2"),
                                              ("phi3", "cvllm_phi.gguf_adapter:PHI3")])
def test_gguf_architectures_registered(name: str, target: str) -> None:
    registry = plugins.gguf_architectures()
    assert registry.spec(name) == target   # resolved only when a GGUF file of that family is opened
    assert registry.owner(name) == "phi"
