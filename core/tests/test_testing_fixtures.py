"""The test fixtures themselves: tiny tokenizer, tiny checkpoints, and the transformers oracle helpers.

The oracle tests of every model plugin trust these, so they are checked against transformers here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from cvllm.testing import (
    CHATML_TEMPLATE,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    VARIANTS,
    build_tiny_tokenizer,
    greedy_margins,
    hf_greedy,
    hf_logits,
    make_checkpoint,
    write_tiny_tokenizer,
)

TEXTS = [
    "Hello, world!",
    "The paged cache keeps keys and values in blocks.",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "Café naïve — 日本語 🙂🚀 ¿Dónde?",
    "def f(x):\n    return x ** 2  # 42",
    "Words never seen in training: xylophone quizzically zephyr.",
]


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _arch(variant: str) -> str:
    return "mistral" if variant == "sliding" else "llama"


# ---- tokenizer ----


def test_tokenizer_files_are_deterministic(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path / "a")
    write_tiny_tokenizer(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_tokenizer_special_tokens_and_size() -> None:
    tokenizer = build_tiny_tokenizer()
    assert tokenizer.get_vocab_size() == 512
    assert [tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    # Special tokens in text are single ids, not split into bytes.
    assert tokenizer.encode("<|im_start|>user").ids[0] == 1
    assert tokenizer.encode("hi<|im_end|>").ids[-1] == 2


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips(text: str) -> None:
    tokenizer = build_tiny_tokenizer()
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text
    # BPE merges were learnt: common text takes fewer tokens than bytes.
    if text.isascii() and len(text) > 10:
        assert len(ids) < len(text.encode())


def test_autotokenizer_loads_it(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = build_tiny_tokenizer()
    assert len(hf) == 512
    assert (hf.eos_token, hf.eos_token_id) == ("<|im_end|>", EOS_TOKEN_ID)
    assert (hf.pad_token, hf.pad_token_id) == ("<|endoftext|>", PAD_TOKEN_ID)
    assert hf.bos_token is None
    assert hf.model_max_length == 256
    for text in TEXTS:
        assert hf(text)["input_ids"] == ours.encode(text).ids  # no BOS added
        assert hf.decode(ours.encode(text).ids) == text


def test_chat_template_renders_chatml(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert hf.chat_template == CHATML_TEMPLATE
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert ids == build_tiny_tokenizer().encode(text).ids
    assert ids[0] == 1 and ids.count(2) == 2


# ---- checkpoints ----


def test_published_spelling(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "default", spelling="published")
    config = json.loads((tmp_path / "default" / "config.json").read_text())
    assert "rope_parameters" not in config and "dtype" not in config
    assert config["rope_theta"] == 10000.0
    assert config["rope_scaling"] is None
    assert config["torch_dtype"] == "float32"
    assert config["architectures"] == ["LlamaForCausalLM"]

    make_checkpoint(tmp_path / "llama3", spelling="published", **VARIANTS["llama3_rope"])
    config = json.loads((tmp_path / "llama3" / "config.json").read_text())
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    # transformers reads the published spelling back to the same rope parameters.
    reread = transformers.AutoConfig.from_pretrained(tmp_path / "llama3")
    assert reread.rope_parameters == VARIANTS["llama3_rope"]["rope_parameters"]


def test_v5_spelling(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, spelling="v5", **VARIANTS["llama3_rope"])
    config = json.loads((tmp_path / "config.json").read_text())
    assert "rope_theta" not in config and "rope_scaling" not in config and "torch_dtype" not in config
    assert config["rope_parameters"] == VARIANTS["llama3_rope"]["rope_parameters"]
    assert config["dtype"] == "float32"


def test_checkpoint_files(tmp_path: Path) -> None:
    make_checkpoint(tmp_path)
    names = {p.name for p in tmp_path.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    config = json.loads((tmp_path / "config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"] == EOS_TOKEN_ID
    assert config["vocab_size"] == 512 and config["max_position_embeddings"] == 256


def _safetensors_keys(path: Path) -> set[str]:
    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


def test_sharded_index_lists_all_tensors(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path, shards=3)
    files = sorted(tmp_path.glob("model-*.safetensors"))
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (tmp_path / "model.safetensors").exists()
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    in_files: dict[str, str] = {}
    for f in files:
        for key in _safetensors_keys(f):
            assert key not in in_files, f"{key} in two shards"
            in_files[key] = f.name
    assert weight_map == in_files
    assert set(weight_map) == set(model.state_dict())


@pytest.mark.parametrize(
    ("variant", "spelling", "shards"),
    [
        ("gqa", "published", 1),
        ("llama3_rope", "published", 2),
        ("tied", "v5", 2),
        ("sliding", "published", 1),
    ],
)
def test_saved_checkpoint_is_the_returned_model(
    tmp_path: Path, variant: str, spelling: str, shards: int
) -> None:
    """The oracle compares the engine (loading the files) against the returned model: they must agree."""
    model = make_checkpoint(tmp_path, _arch(variant), spelling=spelling, shards=shards, **VARIANTS[variant])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = _prompt(40, seed=1)
    assert torch.equal(hf_logits(model, ids), hf_logits(reloaded, ids))


def test_checkpoint_is_deterministic_in_seed(tmp_path: Path) -> None:
    a = make_checkpoint(tmp_path / "a", seed=3)
    b = make_checkpoint(tmp_path / "b", seed=3)
    c = make_checkpoint(tmp_path / "c", seed=4)
    weights = [(tmp_path / name / "model.safetensors").read_bytes() for name in ("a", "b")]
    assert weights[0] == weights[1]
    ids = _prompt(10, seed=0)
    assert torch.equal(hf_logits(a, ids), hf_logits(b, ids))
    assert not torch.allclose(hf_logits(a, ids), hf_logits(c, ids))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_build(tmp_path: Path, variant: str) -> None:
    model = make_checkpoint(tmp_path, _arch(variant), **VARIANTS[variant])
    config = model.config
    attn = model.model.layers[0].self_attn
    stored = _safetensors_keys(tmp_path / "model.safetensors")
    # Norm weights and biases are random, so a loader that skips them cannot pass the oracle tests.
    assert not torch.allclose(model.model.norm.weight, torch.ones(64))
    assert torch.isfinite(hf_logits(model, _prompt(20, seed=0))).all()
    if variant == "gqa":
        assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
        assert attn.k_proj.weight.shape == (32, 64)
    elif variant == "mha":
        assert attn.k_proj.weight.shape == (64, 64)
    elif variant == "tied":
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert "lm_head.weight" not in stored
    elif variant == "bias":
        for name in ("self_attn.q_proj.bias", "self_attn.o_proj.bias", "mlp.down_proj.bias"):
            assert f"model.layers.0.{name}" in stored
        assert attn.q_proj.bias.abs().max() > 0.05
    elif variant == "llama3_rope":
        assert config.rope_parameters["rope_type"] == "llama3"
    elif variant == "head_dim":
        assert config.head_dim == 32 != config.hidden_size // config.num_attention_heads
        assert attn.q_proj.weight.shape == (128, 64) and attn.o_proj.weight.shape == (64, 128)
    elif variant == "sliding":
        assert config.model_type == "mistral" and config.sliding_window == 16
    if variant != "tied":
        assert "lm_head.weight" in stored


def test_sliding_window_is_honoured_by_the_oracle(tmp_path: Path) -> None:
    """transformers' eager Mistral attends j from i when i - j < W, in prefill and in cached decode."""
    window, ids = 16, _prompt(40, seed=7)
    sliding = make_checkpoint(tmp_path / "w", "mistral", sliding_window=window, num_hidden_layers=1)
    full = make_checkpoint(tmp_path / "f", "mistral", sliding_window=None, num_hidden_layers=1)
    logits, logits_full = hf_logits(sliding, ids), hf_logits(full, ids)
    assert torch.equal(logits[:window], logits_full[:window])
    assert (logits[window:] - logits_full[window:]).abs().amax(dim=-1).min() > 1e-2
    # With one layer, position i sees exactly tokens i-W+1..i: rotary makes scores depend only on the
    # distance, so running that window alone at its true positions gives the same logits.
    with torch.no_grad():
        for i in range(window, len(ids)):
            start = i - window + 1
            alone = sliding(torch.tensor([ids[start : i + 1]]), position_ids=torch.arange(start, i + 1)[None])
            torch.testing.assert_close(alone.logits[0, -1], logits[i], rtol=0, atol=1e-5)
    # generate (sliding-window KV cache) agrees with full recomputation at every step.
    generated = hf_greedy(sliding, [ids], 30)[0]
    sequence = list(ids)
    for _ in range(30):
        sequence.append(int(hf_logits(sliding, sequence)[-1].argmax()))
    assert generated == sequence[len(ids) :]


# ---- oracle helpers ----


def test_hf_greedy_matches_argmax_of_hf_logits(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path)
    prompts = [_prompt(5, seed=1), _prompt(23, seed=2)]
    outputs = hf_greedy(model, prompts, 12)
    for prompt, output in zip(prompts, outputs):
        assert len(output) == 12
        logits = hf_logits(model, prompt + output)
        assert logits[len(prompt) - 1 : -1].argmax(dim=-1).tolist() == output
        assert min(greedy_margins(model, prompt, output)) > 0


def test_hf_greedy_eos_handling(tmp_path: Path) -> None:
    """Default: EOS is generated and does not stop (ignore_eos); suppress_eos masks it (min_tokens)."""
    model = make_checkpoint(tmp_path)
    prompt = _prompt(9, seed=5)
    plain = hf_greedy(model, [prompt], 16)[0]
    assert EOS_TOKEN_ID not in plain
    with torch.no_grad():  # make EOS win wherever plain[3] won, by a clear margin
        model.lm_head.weight[EOS_TOKEN_ID] = 1.05 * model.lm_head.weight[plain[3]]
    ignoring = hf_greedy(model, [prompt], 16)[0]
    assert ignoring[:4] == plain[:3] + [EOS_TOKEN_ID] and len(ignoring) == 16
    suppressed = hf_greedy(model, [prompt], 16, suppress_eos=True)[0]
    assert EOS_TOKEN_ID not in suppressed and len(suppressed) == 16
    assert suppressed[:4] == plain[:4]
