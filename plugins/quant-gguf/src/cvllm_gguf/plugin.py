"""Hook implementations only: registering lazy "module:Attribute" strings imports no GGUF code."""

import os

from cvllm.hookspecs import hookimpl


@hookimpl
def open_checkpoint(path):
    # a .gguf file, or the first file of a split set (name-00001-of-00003.gguf); a missing path is
    # left to core, which reports it
    if not path.lower().endswith(".gguf") or not os.path.isfile(path):
        return None
    from cvllm_gguf.checkpoint import open_gguf_checkpoint

    return open_gguf_checkpoint(path)


@hookimpl
def register_quantizers(register):
    register("gguf", "cvllm_gguf.checkpoint:gguf_linear_methods")
    register("isq", "cvllm_gguf.isq:isq_linear_methods")  # in-situ quantization (--isq q4k)
