import gguf
import pytest

from cvllm_gguf.quant_types import FORMATS, GGMLType, UnsupportedQuantType, block_format, resolve_qtype, row_bytes


@pytest.mark.parametrize("qtype", list(GGMLType), ids=lambda t: t.name)
def test_block_sizes_equal_ggml(qtype):
    reference = gguf.GGMLQuantizationType[qtype.name]
    assert int(qtype) == int(reference)
    assert (FORMATS[qtype].block_size, FORMATS[qtype].type_size) == gguf.GGML_QUANT_SIZES[reference]


def test_resolves_ids_enums_and_names():
    assert resolve_qtype(3) is GGMLType.Q4_1
    assert resolve_qtype(gguf.GGMLQuantizationType.Q6_K) is GGMLType.Q6_K
    assert resolve_qtype("Q4_K") is GGMLType.Q4_K
    assert resolve_qtype("q4k") is GGMLType.Q4_K
    assert resolve_qtype("bf16") is GGMLType.BF16
    assert block_format("Q8_0").type_size == 34


@pytest.mark.parametrize("qtype, name", [(16, "IQ2_XXS"), (15, "Q8_K"), (9, "Q8_1"), (39, "MXFP4")])
def test_other_ggml_types_are_an_error_naming_type_and_tensor(qtype, name):
    with pytest.raises(UnsupportedQuantType, match=rf"{name} \(GGML type {qtype}\) in tensor 'blk.3.ffn_up.weight'"):
        resolve_qtype(qtype, "blk.3.ffn_up.weight")
    with pytest.raises(UnsupportedQuantType, match=name):
        block_format(gguf.GGMLQuantizationType(qtype))


def test_unknown_ids_and_names_are_errors():
    with pytest.raises(UnsupportedQuantType, match="GGML type 999"):
        resolve_qtype(999)
    with pytest.raises(UnsupportedQuantType, match="'q3_x'.*Q4_0"):
        resolve_qtype("q3_x")


def test_row_bytes():
    assert row_bytes("Q4_1", 576) == 18 * 20
    assert row_bytes("Q6_K", 1536) == 6 * 210
    assert row_bytes("F16", 7) == 14
    with pytest.raises(ValueError, match="'w': rows of 576 elements do not split into Q4_K blocks of 256"):
        row_bytes("Q4_K", 576, "w")
