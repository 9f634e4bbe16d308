"""The plugin registers its architectures through the installed entry point, lazily."""

from __future__ import annotations

import pytest

from cvllm import plugins

ARCHITECTURES = {
    "GlmForCausalLM": "cvllm_glm.glm:GlmForCausalLM",
    "Glm4ForCausalLM": "cvllm_glm.glm4:Glm4ForCausalLM",
}


@pytest.mark.parametrize(("name", "target"), ARCHITECTURES.items())
def test_architectures_registered(name: str, target: str) -> None:
    registry = plugins.architectures()
    assert registry.spec(name) == target
    assert registry.owner(name) == "glm"
    module, _, attr = target.partition(":")
    assert registry.get(name).__name__ == attr == name and registry.get(name).__module__ == module


def test_gguf_architecture_registered() -> None:
    registry = plugins.gguf_architectures()
    assert registry.spec("glm4") == "cvllm_glm.gguf_adapter:GLM4"  # resolved only when a glm4 file is opened
    assert registry.owner("glm4") == "glm"
