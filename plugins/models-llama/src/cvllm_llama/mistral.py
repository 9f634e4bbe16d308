"""Mistral: Llama's architecture with sliding-window attention."""

from __future__ import annotations

from cvllm.config import ModelConfig
from cvllm_llama.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config, sliding_window=config.get("sliding_window"))
