"""Hook implementations only: registering lazy "module:Class" strings imports no model code."""

from cvllm.hookspecs import hookimpl


@hookimpl
def register_architectures(register):
    register("LlamaForCausalLM", "cvllm_llama.llama:LlamaForCausalLM")
    register("MistralForCausalLM", "cvllm_llama.mistral:MistralForCausalLM")


@hookimpl
def register_gguf_architectures(register):
    register("llama", "cvllm_llama.gguf_adapter:LLAMA")
