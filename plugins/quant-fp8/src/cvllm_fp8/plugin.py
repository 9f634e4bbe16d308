"""Hook implementations only: registering lazy "module:Attribute" strings imports no quantizer code.

"fp8" is the ``quant_method`` of Hugging Face's FP8 checkpoints (DeepSeek-V3/R1, Qwen3 FP8: 128x128 scale blocks;
AutoFP8: one scale per tensor); "compressed-tensors" is llm-compressor's (its FP8 weight schemes only); "isq-fp8"
serves ``--isq fp8``."""

from cvllm.hookspecs import hookimpl


@hookimpl
def register_quantizers(register):
    register("fp8", "cvllm_fp8.quantizer:fp8_linear_methods")
    register("compressed-tensors", "cvllm_fp8.quantizer:compressed_tensors_linear_methods")
    register("isq-fp8", "cvllm_fp8.quantizer:isq_fp8_linear_methods")
