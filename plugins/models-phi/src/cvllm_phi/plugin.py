"""Hook implementations only: registering lazy "module:Class" strings imports no model code."""

from cvllm.hookspecs import hookimpl


@hookimpl
def register_architectures(register):
    register("PhiForCausalLM", "cvllm_phi.phi:PhiForCausalLM")
    register("Phi3ForCausalLM", "cvllm_phi.phi3:Phi3ForCausalLM")


@hookimpl
def register_gguf_architectures(register):
    register("phi2", "cvllm_phi.gguf_adapter:PHI2")
    register("phi3", "cvllm_phi.gguf_adapter:PHI3")
