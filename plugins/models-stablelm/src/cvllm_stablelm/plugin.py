"""Hook implementations only: registering lazy "module:Class" strings imports no model code."""

from cvllm.hookspecs import hookimpl


@hookimpl
def register_architectures(register):
    register("StableLmForCausalLM", "cvllm_stablelm.stablelm:StableLmForCausalLM")


@hookimpl
def register_gguf_architectures(register):
    register("stablelm", "cvllm_stablelm.gguf_adapter:STABLELM")
