"""The plugin registers its architectures through the installed entry point, lazily."""

from __future__ import annotations

import pytest

from cvllm import plugins

ARCHITECTURES = {
    "Qwen2ForCausalLM": "cvllm_qwen.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "cvllm_qwen.qwen3:Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM": "cvllm_qwen.qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "cvllm_qwen.qwen3_moe:Qwen3MoeForCausalLM",
}
GGUF_ARCHITECTURES = {
    "qwen2": "cvllm_qwen.gguf_adapter:QWEN2",
    "qwen3": "cvllm_qwen.gguf_adapter:QWEN3",
    "qwen2moe": "cvllm_qwen.gguf_adapter:QWEN2MOE",
    "qwen3moe": "cvllm_qwen.gguf_adapter:QWEN3MOE",
}


@pytest.mark.parametrize(("name", "target"), ARCHITECTURES.items())
def test_architectures_registered(name: str, target: str) -> None:
    registry = plugins.architectures()
    assert registry.spec(name) == target
    assert registry.owner(name) == "qwen"
    module, _, attr = target.partition(":")
    assert registry.get(name).__name__ == attr == name and registry.get(name).__module__ == module


@pytest.mark.parametrize(("name", "target"), GGUF_ARCHITECTURES.items())
def test_gguf_architectures_registered(name: str, target: str) -> None:
    registry = plugins.gguf_architectures()
    assert registry.spec(name) == target  # resolved only when a GGUF file of that family is opened
    assert registry.owner(name) == "qwen"
