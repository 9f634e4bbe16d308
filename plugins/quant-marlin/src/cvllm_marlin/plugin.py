"""Hook implementations only: registering lazy "module:Attribute" strings imports no quantizer code.

The names are the ``quant_method`` that config.json's ``quantization_config`` gives (core's HF directory reader
copies it into ``Checkpoint.quant_method``)."""

from cvllm.hookspecs import hookimpl


@hookimpl
def register_quantizers(register):
    register("gptq", "cvllm_marlin.quantizer:gptq_linear_methods")
    register("awq", "cvllm_marlin.quantizer:awq_linear_methods")
    # in-situ quantization to GPTQ's form (--isq gptq / --isq marlin): core picks "isq-<type>" over the general "isq"
    register("isq-gptq", "cvllm_marlin.isq:isq_gptq_linear_methods")
    register("isq-marlin", "cvllm_marlin.isq:isq_gptq_linear_methods")


@hookimpl
def register_converters(register):
    register("gptq", "cvllm_marlin.convert:convert_to_gptq")
