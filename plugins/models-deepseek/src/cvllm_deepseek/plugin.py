"""Hook implementations only: registering lazy "module:Class" strings imports no model code."""

from cvllm.hookspecs import hookimpl


@hookimpl
def register_architectures(register):
    register("DeepseekV2ForCausalLM", "cvllm_deepseek.deepseek_v2:DeepseekV2ForCausalLM")
    register("DeepseekV3ForCausalLM", "cvllm_deepseek.deepseek_v2:DeepseekV3ForCausalLM")


@hookimpl
def register_gguf_architectures(register):
    register("deepseek2", "cvllm_deepseek.gguf_adapter:DEEPSEEK2")
