"""Hook implementations only: the lazy "module:Class" string imports no torch.mps code while plugins are discovered."""

from cvllm.hookspecs import hookimpl


@hookimpl
def register_backends(register):
    register("metal", "cvllm_metal.backend:MetalBackend")
