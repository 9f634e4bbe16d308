"""The plugin registers its architecture through the installed entry point, lazily."""

from __future__ import annotations

from cvllm import plugins


def test_architecture_registered() -> None:
    registry = plugins.architectures()
    assert registry.spec("StableLmForCausalLM") == "cvllm_stablelm.stablelm:StableLmForCausalLM"
    assert registry.owner("StableLmForCausalLM") == "stablelm"
    cls = registry.get("StableLmForCausalLM")
    assert cls.__name__ == "StableLmForCausalLM" and cls.__module__ == "cvllm_stablelm.stablelm"


def test_gguf_architecture_registered() -> None:
    registry = plugins.gguf_architectures()
    assert registry.spec("stablelm") == "cvllm_stablelm.gguf_adapter:STABLELM"  # resolved when a file is opened
    assert registry.owner("stablelm") == "stablelm"
