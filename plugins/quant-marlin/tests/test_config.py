"""quantization_config parsing: what loads, and errors that name the field for what does not."""

from __future__ import annotations

import pytest

from cvllm import plugins
from cvllm_marlin.config import AWQConfig, GPTQConfig, QuantConfigError, parse_awq_config, parse_gptq_config


def test_quantizers_are_registered_as_lazy_strings():
    assert plugins.quantizers().spec("gptq") == "cvllm_marlin.quantizer:gptq_linear_methods"
    assert plugins.quantizers().spec("awq") == "cvllm_marlin.quantizer:awq_linear_methods"


def test_gptq_fields():
    config = parse_gptq_config({"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": False,
                                "desc_act": True})
    assert config == GPTQConfig(bits=8, group_size=-1, sym=False, desc_act=True, zero_offset=1)
    assert config.pack == 4
    v2 = parse_gptq_config({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"})
    assert v2.zero_offset == 0 and v2.sym and not v2.desc_act


def test_awq_fields():
    assert parse_awq_config({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
                             "version": "GEMM"}) == AWQConfig(bits=4, group_size=64)
    assert parse_awq_config({"quant_method": "awq", "w_bit": 4, "q_group_size": 128}).group_size == 128


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits 3 is not supported"),
    ({"quant_method": "gptq", "bits": 2, "group_size": 128}, "bits 2 is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size 0 is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "checkpoint_format 'marlin' is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True}, "is_marlin_format"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"-:.*mlp.*": {}}}, "dynamic"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, "lm_head true"),
])
def test_gptq_refusals_name_the_field(config, message):
    with pytest.raises(QuantConfigError, match=message):
        parse_gptq_config(config)


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv' is not supported"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "bits 8 is not supported"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point false"),
])
def test_awq_refusals_name_the_field(config, message):
    with pytest.raises(QuantConfigError, match=message):
        parse_awq_config(config)
