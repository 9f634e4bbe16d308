"""LongRoPE's per-position table against transformers' rope functions and Phi3RotaryEmbedding.

cvllm picks short factors for positions below original_max_position_embeddings and long factors from there on;
transformers picks one set per forward pass (long once the pass reaches past the original context). The two agree
on a pass that stays below the switch and on one that lies entirely beyond it, which is what is compared here.
"""

import math

import pytest
import torch
from transformers import Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from cvllm.layers.rotary import get_rope

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HEAD_DIM = 32
NUM_HEADS = 4
ORIGINAL = 64
MAX_POSITION = 512
TOL = {"rtol": 1e-6, "atol": 1e-6}


def longrope_params(rotary_dim: int, **extra) -> dict:
    half = rotary_dim // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "long_factor": [1.0 + 1.5 * i for i in range(half)],
            "original_max_position_embeddings": ORIGINAL, **extra}


def hf_config(params: dict) -> Phi3Config:
    # max_position_embeddings / original is transformers' factor (and attention factor) when the params give none
    return Phi3Config(hidden_size=HEAD_DIM * NUM_HEADS, num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_HEADS,
                      max_position_embeddings=MAX_POSITION, original_max_position_embeddings=ORIGINAL,
                      rope_parameters=dict(params))


def hf_table(config: Phi3Config, positions: torch.Tensor) -> torch.Tensor:
    """One forward pass of transformers' Phi3RotaryEmbedding over ``positions``, as cvllm's cos ‖ sin rows."""
    cos, sin = Phi3RotaryEmbedding(config)(torch.zeros(1), positions[None])
    half = cos.shape[-1] // 2
    return torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1)


CASES = {
    "full": {},
    "partial": {"partial_rotary_factor": 0.75},             # Phi-4-mini
    "attention_factor": {"attention_factor": 1.3},
    "factor": {"factor": 4.0},                              # instead of max_position / original
}


def case_params(name: str) -> tuple[dict, int]:
    extra = CASES[name]
    rotary_dim = int(HEAD_DIM * extra.get("partial_rotary_factor", 1.0))
    return longrope_params(rotary_dim, **extra), rotary_dim


@pytest.mark.parametrize("name", CASES)
def test_both_sides_of_the_switch_match_transformers(name):
    params, rotary_dim = case_params(name)
    ours = get_rope(HEAD_DIM, MAX_POSITION, params)
    assert ours.rotary_dim == rotary_dim
    table = ours.cos_sin
    config = hf_config(params)
    # a pass that stays inside the original context: short factors
    torch.testing.assert_close(table[:ORIGINAL], hf_table(config, torch.arange(ORIGINAL)), **TOL)
    # a pass that lies entirely beyond it (as decode steps there do): long factors
    beyond = torch.arange(ORIGINAL, MAX_POSITION)
    torch.testing.assert_close(table[ORIGINAL:], hf_table(config, beyond), **TOL)


@pytest.mark.parametrize("name", CASES)
def test_rows_are_transformers_inv_freqs_per_position(name):
    params, _ = case_params(name)
    table = get_rope(HEAD_DIM, MAX_POSITION, params).cos_sin
    config = hf_config(params)
    short, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](config)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=ORIGINAL + 1)
    assert (short - long).abs().max() > 1e-2
    for p in (0, 1, ORIGINAL - 1, ORIGINAL, ORIGINAL + 1, MAX_POSITION - 1):
        inv_freq = short if p < ORIGINAL else long
        angles = p * inv_freq
        expected = torch.cat([angles.cos(), angles.sin()]) * attention_factor
        torch.testing.assert_close(table[p], expected, **TOL)


def test_attention_factor_defaults_to_transformers():
    params, _ = case_params("full")
    _, expected = ROPE_INIT_FUNCTIONS["longrope"](hf_config(params))
    factor = MAX_POSITION / ORIGINAL
    assert expected == pytest.approx(math.sqrt(1 + math.log(factor) / math.log(ORIGINAL)))
    row0 = get_rope(HEAD_DIM, MAX_POSITION, params).cos_sin[0]
    torch.testing.assert_close(row0[: HEAD_DIM // 2], torch.full((HEAD_DIM // 2,), expected), **TOL)


def test_one_pass_across_the_switch_differs_from_transformers():
    """The documented difference: transformers rotates every position of a pass longer than the original context
    with the long factors; cvllm keeps the short ones below the switch. The last position agrees."""
    params, _ = case_params("full")
    table = get_rope(HEAD_DIM, MAX_POSITION, params).cos_sin
    whole = hf_table(hf_config(params), torch.arange(ORIGINAL + 8))
    torch.testing.assert_close(table[ORIGINAL: ORIGINAL + 8], whole[ORIGINAL:], **TOL)
    assert (table[1:ORIGINAL] - whole[1:ORIGINAL]).abs().max() > 1e-2


def test_swapped_factors_would_be_caught():
    params, _ = case_params("full")
    swapped = {**params, "short_factor": params["long_factor"], "long_factor": params["short_factor"]}
    ours = get_rope(HEAD_DIM, MAX_POSITION, params).cos_sin
    wrong = get_rope(HEAD_DIM, MAX_POSITION, swapped).cos_sin
    assert (ours[1:ORIGINAL] - wrong[1:ORIGINAL]).abs().max() > 1e-2
    assert (ours[ORIGINAL:] - wrong[ORIGINAL:]).abs().max() > 1e-2


def test_factor_lists_of_the_wrong_length_are_rejected():
    params, _ = case_params("full")
    with pytest.raises(ValueError, match="need 16 values each"):
        get_rope(HEAD_DIM, MAX_POSITION, {**params, "long_factor": [1.0] * 3})
