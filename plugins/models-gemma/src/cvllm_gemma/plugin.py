"""Hook implementations only: registering lazy "module:Class" strings imports no model code."""

from cvllm.hookspecs import hookimpl


@hookimpl
def register_architectures(register):
    register("GemmaForCausalLM", "cvllm_gemma.gemma:GemmaForCausalLM")
    register("Gemma2ForCausalLM", "cvllm_gemma.gemma2:Gemma2ForCausalLM")
    register("Gemma3ForCausalLM", "cvllm_gemma.gemma3:Gemma3ForCausalLM")
    register("Gemma3ForConditionalGeneration", "cvllm_gemma.gemma3:Gemma3ForConditionalGeneration")


@hookimpl
def register_gguf_architectures(register):
    register("gemma", "cvllm_gemma.gguf_adapter:GEMMA")
    register("gemma2", "cvllm_gemma.gguf_adapter:GEMMA2")
    register("gemma3", "cvllm_gemma.gguf_adapter:GEMMA3")
