"""Hook implementations only: registering lazy "module:Class" strings imports no model code."""

from cvllm.hookspecs import hookimpl


@hookimpl
def register_architectures(register):
    register("GemmaForCausalLM", "cvllm_gemma.gemma:GemmaForCausalLM")
    register("Gemma2ForCausalLM", "cvllm_gemma.gemma2:Gemma2ForCausalLM")
    register("Gemma3ForCausalLM", "cvllm_gemma.gemma3:Gemma3ForCausalLM")
    register("Gemma3ForConditionalGeneration", "cvllm_gemma.gemma3:Gemma3ForConditionalGeneration")


@hookimpl
def open_checkpoint(path):
    # Gemma 3's multimodal directories, opened with their config flattened to the text model's (the engine reads
    # vocab_size and the context length at the top level); anything else is left to the other readers
    from cvllm_gemma.multimodal import open_text_checkpoint

    return open_text_checkpoint(path)


@hookimpl
def register_gguf_architectures(register):
    register("gemma", "cvllm_gemma.gguf_adapter:GEMMA")
    register("gemma2", "cvllm_gemma.gguf_adapter:GEMMA2")
    register("gemma3", "cvllm_gemma.gguf_adapter:GEMMA3")
