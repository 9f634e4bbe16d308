"""Hook implementations only: registering lazy "module:Class" strings imports no model code."""

from cvllm.hookspecs import hookimpl


@hookimpl
def register_architectures(register):
    register("Qwen2ForCausalLM", "cvllm_qwen.qwen2:Qwen2ForCausalLM")
    register("Qwen3ForCausalLM", "cvllm_qwen.qwen3:Qwen3ForCausalLM")
    register("Qwen2MoeForCausalLM", "cvllm_qwen.qwen2_moe:Qwen2MoeForCausalLM")
    register("Qwen3MoeForCausalLM", "cvllm_qwen.qwen3_moe:Qwen3MoeForCausalLM")


@hookimpl
def register_gguf_architectures(register):
    register("qwen2", "cvllm_qwen.gguf_adapter:QWEN2")
    register("qwen3", "cvllm_qwen.gguf_adapter:QWEN3")
    register("qwen2moe", "cvllm_qwen.gguf_adapter:QWEN2MOE")
    register("qwen3moe", "cvllm_qwen.gguf_adapter:QWEN3MOE")
