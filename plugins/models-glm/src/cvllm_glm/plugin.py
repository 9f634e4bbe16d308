"""Hook implementations only: registering lazy "module:Class" strings imports no model code."""

from cvllm.hookspecs import hookimpl


@hookimpl
def register_architectures(register):
    register("GlmForCausalLM", "cvllm_glm.glm:GlmForCausalLM")
    register("Glm4ForCausalLM", "cvllm_glm.glm4:Glm4ForCausalLM")


@hookimpl
def register_gguf_architectures(register):
    register("glm4", "cvllm_glm.gguf_adapter:GLM4")
