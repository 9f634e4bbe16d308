"""cvllm.layers.rotary against transformers' rope formulas (ROPE_INIT_FUNCTIONS and Llama's default rope)."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.phi.modeling_phi import PhiRotaryEmbedding

from cvllm.layers.rotary import get_rope

HEAD_DIM = 64
NUM_HEADS, NUM_KV_HEADS = 4, 2
MAX_POSITION = 2048
TOL = {"rtol": 1e-6, "atol": 1e-6}


pytestmark = pytest.mark.usefixtures("one_torch_thread")

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512}

CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "default_theta_1e6": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": LLAMA3,
    "yarn": YARN,
    "yarn_mscale": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5},
    "yarn_equal_mscale": {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
    "yarn_no_truncate": {**YARN, "truncate": False, "beta_fast": 16, "beta_slow": 2},
    "yarn_attention_factor": {**YARN, "attention_factor": 0.8},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
}


def hf_config(params: dict, max_position: int = MAX_POSITION) -> LlamaConfig:
    return LlamaConfig(hidden_size=HEAD_DIM * NUM_HEADS, num_attention_heads=NUM_HEADS,
                       num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                       max_position_embeddings=max_position, rope_parameters=dict(params))


def hf_inv_freq(params: dict, max_position: int = MAX_POSITION, **kwargs) -> tuple[torch.Tensor, float]:
    config = hf_config(params, max_position)
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        # Llama's default ignores partial_rotary_factor; Phi's is the same formula and honours it
        return PhiRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, **kwargs)


def cos_sin_from(inv_freq: torch.Tensor, attention_factor: float, positions: torch.Tensor) -> torch.Tensor:
    """HF's forward (positions * inv_freq, cos/sin times attention_factor), as cvllm's cos ‖ sin half-table."""
    freqs = positions[:, None].float() * inv_freq[None, :].float()
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)


@pytest.mark.parametrize("name", CASES)
def test_cos_sin_table_matches_transformers(name):
    params = CASES[name]
    ours = get_rope(HEAD_DIM, MAX_POSITION, params).cos_sin
    inv_freq, attention_factor = hf_inv_freq(params)
    expected = cos_sin_from(inv_freq, attention_factor, torch.arange(MAX_POSITION))
    assert ours.dtype == torch.float32
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, **TOL)


@pytest.mark.parametrize("name", [n for n in CASES if n not in ("default", "dynamic")])
def test_scaled_cases_really_differ_from_default(name):
    # Guards the comparison above: a scaling that silently fell back to plain rope would match nothing here.
    ours = get_rope(HEAD_DIM, MAX_POSITION, CASES[name]).cos_sin
    plain = get_rope(HEAD_DIM, MAX_POSITION, CASES["default"]).cos_sin
    assert (ours - plain).abs().max() > 1e-2


def test_yarn_attention_factor_scales_cos_and_sin():
    _, expected_factor = hf_inv_freq(CASES["yarn_mscale"])
    assert expected_factor != pytest.approx(1.0)
    row0 = get_rope(HEAD_DIM, MAX_POSITION, CASES["yarn_mscale"]).cos_sin[0]
    # position 0: cos = attention_factor, sin = 0
    torch.testing.assert_close(row0[: HEAD_DIM // 2], torch.full((HEAD_DIM // 2,), expected_factor), **TOL)
    assert row0[HEAD_DIM // 2:].abs().max() == 0
    _, explicit = hf_inv_freq(CASES["yarn_attention_factor"])
    assert explicit == 0.8
    assert get_rope(HEAD_DIM, MAX_POSITION, CASES["yarn_attention_factor"]).cos_sin[0, 0].item() == pytest.approx(0.8)


@pytest.mark.parametrize("name", ["default", "linear", "llama3", "yarn"])
def test_partial_rotary_table(name):
    params = {**CASES[name], "partial_rotary_factor": 0.5}
    rope = get_rope(HEAD_DIM, MAX_POSITION, params)
    assert rope.rotary_dim == HEAD_DIM // 2
    inv_freq, attention_factor = hf_inv_freq(params)
    assert inv_freq.numel() == HEAD_DIM // 4
    torch.testing.assert_close(rope.cos_sin, cos_sin_from(inv_freq, attention_factor, torch.arange(MAX_POSITION)),
                               **TOL)


def hf_rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H*D] inputs through transformers' apply_rotary_pos_emb, partial rotary as Phi does it."""
    T = q.shape[0]
    q4 = q.view(T, -1, HEAD_DIM).transpose(0, 1)[None]  # [1, H, T, D]
    k4 = k.view(T, -1, HEAD_DIM).transpose(0, 1)[None]
    q_rot, k_rot = apply_rotary_pos_emb(q4[..., :rotary_dim], k4[..., :rotary_dim], cos[None], sin[None])
    q4 = torch.cat([q_rot, q4[..., rotary_dim:]], dim=-1)
    k4 = torch.cat([k_rot, k4[..., rotary_dim:]], dim=-1)
    return q4[0].transpose(0, 1).reshape(T, -1), k4[0].transpose(0, 1).reshape(T, -1)


@pytest.mark.parametrize("name", ["default", "linear", "llama3", "yarn_mscale", "dynamic"])
def test_rotation_matches_llama_rotary_embedding(name):
    # End to end through HF's LlamaRotaryEmbedding module (its default rope and the dynamic-update decorator).
    gen = torch.Generator().manual_seed(0)
    T = 37
    positions = torch.randint(0, MAX_POSITION, (T,), generator=gen)
    q = torch.randn(T, NUM_HEADS * HEAD_DIM, generator=gen)
    k = torch.randn(T, NUM_KV_HEADS * HEAD_DIM, generator=gen)

    ours_q, ours_k = get_rope(HEAD_DIM, MAX_POSITION, CASES[name])(positions, q, k)
    hf_rope = LlamaRotaryEmbedding(hf_config(CASES[name]))
    cos, sin = hf_rope(q, positions[None])
    ref_q, ref_k = hf_rotate(q, k, cos[0], sin[0], HEAD_DIM)
    torch.testing.assert_close(ours_q, ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_k, ref_k, rtol=1e-5, atol=1e-5)
    assert (ours_q - q).abs().max() > 1e-1  # the rotation did something


@pytest.mark.parametrize("name", ["default", "yarn"])
def test_partial_rotation_leaves_the_tail_alone(name):
    params = {**CASES[name], "partial_rotary_factor": 0.5}
    rotary_dim = HEAD_DIM // 2
    gen = torch.Generator().manual_seed(1)
    T = 11
    positions = torch.randint(0, MAX_POSITION, (T,), generator=gen)
    q = torch.randn(T, NUM_HEADS * HEAD_DIM, generator=gen)
    k = torch.randn(T, NUM_KV_HEADS * HEAD_DIM, generator=gen)

    ours_q, ours_k = get_rope(HEAD_DIM, MAX_POSITION, params)(positions, q, k)
    inv_freq, attention_factor = hf_inv_freq(params)
    freqs = positions[:, None].float() * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    ref_q, ref_k = hf_rotate(q, k, emb.cos() * attention_factor, emb.sin() * attention_factor, rotary_dim)
    torch.testing.assert_close(ours_q, ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_k, ref_k, rtol=1e-5, atol=1e-5)
    tail = ours_q.view(T, NUM_HEADS, HEAD_DIM)[..., rotary_dim:]
    assert torch.equal(tail, q.view(T, NUM_HEADS, HEAD_DIM)[..., rotary_dim:])


def test_rotation_in_bfloat16_matches_transformers():
    gen = torch.Generator().manual_seed(2)
    T = 9
    positions = torch.randint(0, MAX_POSITION, (T,), generator=gen)
    q = torch.randn(T, NUM_HEADS * HEAD_DIM, generator=gen).bfloat16()
    k = torch.randn(T, NUM_KV_HEADS * HEAD_DIM, generator=gen).bfloat16()
    ours_q, ours_k = get_rope(HEAD_DIM, MAX_POSITION, CASES["llama3"])(positions, q, k)
    cos, sin = LlamaRotaryEmbedding(hf_config(CASES["llama3"]))(q, positions[None])
    ref_q, ref_k = hf_rotate(q, k, cos[0], sin[0], HEAD_DIM)
    assert ours_q.dtype == torch.bfloat16
    torch.testing.assert_close(ours_q, ref_q, rtol=0, atol=0)
    torch.testing.assert_close(ours_k, ref_k, rtol=0, atol=0)


# -- dynamic NTK beyond the original context ------------------------------------------------------

ORIGINAL = 256
LONG = 1024


def test_dynamic_beyond_the_original_context():
    """Inside the original context both are plain rope. Beyond it, HF rescales every position of a
    sequence of length S with seq_len=S, while cvllm tabulates position p once, with seq_len=p + 1
    (the length of the first sequence that reaches p): the values agree only at p = S - 1."""
    params = CASES["dynamic"]
    ours = get_rope(HEAD_DIM, LONG, {**params, "_max_position_embeddings": ORIGINAL}).cos_sin
    positions = torch.arange(LONG)

    plain, _ = hf_inv_freq(params, ORIGINAL)  # seq_len None → max_position_embeddings → unscaled base
    torch.testing.assert_close(ours[:ORIGINAL], cos_sin_from(plain, 1.0, positions[:ORIGINAL]), **TOL)
    default, _ = hf_inv_freq(CASES["default"], ORIGINAL)
    torch.testing.assert_close(plain, default, rtol=0, atol=0)

    # What cvllm does beyond: row p uses the base for seq_len = p + 1.
    for p in (ORIGINAL, ORIGINAL + 1, 600, LONG - 1):
        inv_freq, _ = hf_inv_freq(params, ORIGINAL, seq_len=p + 1)
        torch.testing.assert_close(ours[p], cos_sin_from(inv_freq, 1.0, torch.tensor([p]))[0], rtol=1e-5, atol=1e-5)

    # What HF does for one sequence of length LONG: every position with seq_len = LONG.
    hf_rope = LlamaRotaryEmbedding(hf_config(params, ORIGINAL))
    cos, sin = hf_rope(torch.zeros(1), positions[None])
    hf_table = torch.cat([cos[0, :, : HEAD_DIM // 2], sin[0, :, : HEAD_DIM // 2]], dim=-1)
    torch.testing.assert_close(ours[LONG - 1], hf_table[LONG - 1], rtol=1e-5, atol=1e-5)
    # The intended difference: earlier positions of that long sequence are rotated differently.
    assert (ours[ORIGINAL] - hf_table[ORIGINAL]).abs().max() > 1e-2
    assert (ours[: ORIGINAL] - hf_table[: ORIGINAL]).abs().max() > 1e-2


def test_unknown_rope_type_is_rejected():
    with pytest.raises(ValueError, match="unsupported rope_type 'bogus'"):
        get_rope(HEAD_DIM, 16, {"rope_type": "bogus", "rope_theta": 10000.0})
