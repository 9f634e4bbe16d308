"""Hook implementations only: the lazy "module:Class" string imports neither torch.cuda nor triton."""

from cvllm.hookspecs import hookimpl


@hookimpl
def register_backends(register):
    register("cuda", "cvllm_cuda.backend:CudaBackend")
