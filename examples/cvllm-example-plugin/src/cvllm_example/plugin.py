"""Hook implementations only: registering a lazy "module:Class" string imports no model code."""

from cvllm.hookspecs import hookimpl


@hookimpl
def register_architectures(register):
    # The key is the name in config.json's "architectures" list.
    register("TinyGPTForCausalLM", "cvllm_example.model:TinyGPTForCausalLM")
