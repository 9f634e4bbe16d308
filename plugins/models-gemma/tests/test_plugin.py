"""The plugin registers its architectures through the installed entry point, lazily."""

from __future__ import annotations

import pytest

from cvllm import plugins

ARCHITECTURES = {
    "GemmaForCausalLM": "cvllm_gemma.gemma:GemmaForCausalLM",
    "Gemma2ForCausalLM": "cvllm_gemma.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "cvllm_gemma.gemma3:Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration": "cvllm_gemma.gemma3:Gemma3ForConditionalGeneration",
}
GGUF_ARCHITECTURES = {
    "gemma": "cvllm_gemma.gguf_adapter:GEMMA",
    "gemma2": "cvllm_gemma.gguf_adapter:GEMMA2",
    "gemma3": "cvllm_gemma.gguf_adapter:GEMMA3",
}


@pytest.mark.parametrize(("name", "target"), ARCHITECTURES.items())
def test_architectures_registered(name: str, target: str) -> None:
    registry = plugins.architectures()
    assert registry.spec(name) == target
    assert registry.owner(name) == "gemma"
    module, _, attr = target.partition(":")
    assert registry.get(name).__name__ == attr == name and registry.get(name).__module__ == module


@pytest.mark.parametrize(("name", "target"), GGUF_ARCHITECTURES.items())
def test_gguf_architectures_registered(name: str, target: str) -> None:
    registry = plugins.gguf_architectures()
    assert registry.spec(name) == target  # resolved only when a GGUF file of that family is opened
    assert registry.owner(name) == "gemma"


def test_no_checkpoint_reader_of_its_own() -> None:
    # the multimodal checkpoints are opened by core's reader, as Gemma3ForConditionalGeneration.nested_text_model says
    readers = [impl.plugin_name for impl in plugins.get_plugin_manager().hook.open_checkpoint.get_hookimpls()]
    assert "gemma" not in readers
