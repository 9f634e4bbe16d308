"""What core itself provides, registered through the same hooks as any plugin (always loaded).

Hook implementations only: everything is a lazy "module:Class" string, so loading this module
imports no backend or checkpoint code. (The sampler is the engine's own; plugins add logits processors.)
"""

import os

from cvllm.hookspecs import hookimpl


@hookimpl
def register_backends(register):
    register("cpu", "cvllm.backends.cpu:CpuBackend")


@hookimpl
def register_tool_parsers(register):
    register("hermes", "cvllm.server.tool_calls:TaggedParser")
    register("mistral", "cvllm.server.tool_calls:MistralParser")
    register("llama3_json", "cvllm.server.tool_calls:Llama3JsonParser")
    register("deepseek_v3", "cvllm.server.tool_calls:DeepSeekParser")


@hookimpl(trylast=True)
def open_checkpoint(path):
    # trylast: a plugin that recognises its own layout (or a directory holding a .gguf) goes first.
    if not os.path.isdir(path):
        return None
    from cvllm.checkpoint.hf_dir import open_hf_checkpoint

    return open_hf_checkpoint(path)
