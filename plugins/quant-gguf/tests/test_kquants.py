"""K-quant quantization equals llama.cpp's ggml_quantize_chunk byte for byte (tests/data/kquant_golden.npz,
made by tools/make_kquant_golden.py), and the blocks decode back close to the input."""

from pathlib import Path

import numpy as np
import pytest
import torch

from cvllm_gguf import kquants
from cvllm_gguf.dequant import dequantize
from cvllm_gguf.quant_types import FORMATS, resolve_qtype
from cvllm_gguf.quantize import quantize

GOLDEN = Path(__file__).parent / "data" / "kquant_golden.npz"
K_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# the same bytes on a GPU: every step is an IEEE float32 operation there too (see kquants._divide)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    with np.load(GOLDEN) as data:
        return {key: data[key] for key in data.files}


def test_golden_file_records_its_source(golden):
    assert str(golden["llama_cpp_python_version"]).count(".") == 2
    names = list(golden["case_names"])
    assert {"normal", "special", "tiny", "integer_grid", "sqrt_sensitive", "refine_sensitive"} <= set(names)
    for name in names:
        assert golden[f"x/{name}"].shape == (8, 512)
        for qtype in K_TYPES:
            assert golden[f"{qtype}/{name}"].shape == (8, 2 * FORMATS[resolve_qtype(qtype)].type_size)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", K_TYPES)
def test_bytes_equal_llama_cpp(golden, qtype, device):
    for name in golden["case_names"]:
        x, expected = golden[f"x/{name}"], golden[f"{qtype}/{name}"]
        ours = quantize(torch.from_numpy(x).to(device), qtype)
        assert ours.dtype == torch.uint8 and ours.device.type == device
        mismatched = int((ours.cpu().numpy() != expected).sum())
        assert mismatched == 0, f"{qtype} {name}: {mismatched} of {expected.size} bytes differ"


@pytest.mark.parametrize("qtype", K_TYPES)
def test_rows_are_quantized_independently_of_the_leading_shape(golden, qtype):
    x, expected = golden["x/normal"], golden[f"{qtype}/normal"]
    ours = quantize(torch.from_numpy(x).reshape(2, 4, 512), qtype)
    assert np.array_equal(ours.numpy(), expected.reshape(2, 4, -1))
    # one super-block at a time gives the same bytes: nothing couples blocks
    single = torch.cat([quantize(torch.from_numpy(x[:, i:i + 256]), qtype) for i in (0, 256)], dim=1)
    assert np.array_equal(single.numpy(), expected)


# error of N(0, 1) data after a round trip: RMS, and the worst error of a super-block relative to its
# largest value. Measured: RMS 0.30, 0.15, 0.072, 0.036, 0.018 and worst 0.38, 0.17, 0.073, 0.037, 0.016;
# each extra bit halves both
@pytest.mark.parametrize("qtype, rms_bound, worst_bound", [
    ("Q2_K", 0.33, 0.45), ("Q3_K", 0.17, 0.2), ("Q4_K", 0.08, 0.09), ("Q5_K", 0.04, 0.045), ("Q6_K", 0.02, 0.02)])
def test_round_trip_error_shrinks_with_the_bits(qtype, rms_bound, worst_bound):
    x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(5))
    back = dequantize(quantize(x, qtype), qtype, x.shape)
    rms = float((back - x).pow(2).mean().sqrt())
    assert rms_bound / 2.5 < rms < rms_bound
    worst = (back - x).abs().view(-1, 256).amax(-1)
    assert (worst < x.view(-1, 256).abs().amax(-1) * worst_bound).all()


@pytest.mark.parametrize("qtype", K_TYPES)
def test_zero_and_constant_rows_survive(qtype):
    x = torch.zeros(3, 256)
    x[1] = 0.75
    x[2, :128] = -2.0
    back = dequantize(quantize(x, qtype), qtype, x.shape)
    assert torch.equal(back[0], torch.zeros(256))
    assert torch.allclose(back[1:], x[1:], rtol=0, atol=1e-3)  # only the f16 rounding of the scales is lost
    assert torch.equal(quantize(torch.zeros(2, 256), qtype), torch.zeros(2, FORMATS[resolve_qtype(qtype)].type_size,
                                                                          dtype=torch.uint8))


@pytest.mark.parametrize("qtype", K_TYPES)
def test_rows_must_hold_whole_super_blocks(qtype):
    with pytest.raises(ValueError, match=rf"{qtype}: rows must be a multiple of 256 elements \(row length 320\)"):
        quantize(torch.randn(4, 320), qtype)
    with pytest.raises(ValueError, match=f"{qtype} quantizes super-blocks of 256 values"):
        kquants.quantize_k(torch.randn(4, 32), qtype)


def test_nearest_int_rounds_half_to_even_like_ggml():
    values = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, 2.5000002, -3.7, 4194303.0, 1e-30])
    expected = [0, 2, 2, 0, -2, -2, 0, 3, -4, 4194303, 0]
    assert kquants._nearest_int(values).tolist() == expected
    many = torch.randn(100_000) * 1000
    assert np.array_equal(kquants._nearest_int(many).numpy(), np.rint(many.numpy()).astype(np.int32))


def test_sqrt_is_correctly_rounded():
    # torch's vectorised float32 sqrt is sometimes one ulp off; ggml's sqrtf never is, and one ulp in the
    # Q4_K/Q5_K weights flips the scale search of some blocks (the golden "sqrt_sensitive" rows)
    values = torch.rand(200_000, generator=torch.Generator().manual_seed(1)) * 100
    assert np.array_equal(kquants._sqrt(values).numpy(), np.sqrt(values.numpy()))


def test_running_sum_keeps_c_loop_order():
    terms = torch.tensor([[1e8, 1.0, -1e8, 1.0]], dtype=torch.float32)
    # ((1e8 + 1) - 1e8) + 1 = 0 + 1 in float32, while an exact or pairwise sum gives 2
    assert kquants._running_sum(terms).tolist() == [1.0]
