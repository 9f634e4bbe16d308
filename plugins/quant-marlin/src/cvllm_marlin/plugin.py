"""Hook implementations only: registering lazy "module:Attribute" strings imports no quantizer code.

The names are the ``quant_method`` that config.json's ``quantization_config`` gives (core's HF directory reader
copies it into ``Checkpoint.quant_method``)."""

from cvllm.hookspecs import hookimpl


@hookimpl
def register_quantizers(register):
    register("gptq", "cvllm_marlin.quantizer:gptq_linear_methods")
    register("awq", "cvllm_marlin.quantizer:awq_linear_methods")
