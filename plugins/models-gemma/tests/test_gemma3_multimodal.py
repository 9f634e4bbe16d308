"""Gemma 3's multimodal checkpoints served as text, through core's ``NestedTextModel`` (the class's
``nested_text_model``): the sparse hub text_config read as transformers reads it, the checkpoint opened by core's
reader with the text model's config (what the engine reads at the top level), the language model's tensors picked
out under either layout and the vision tower's left unread (never read at all), without a warning.

(The oracle comparisons of their logits and greedy tokens are in test_gemma_vs_transformers.py.)
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from safetensors import safe_open

from cvllm import plugins
from cvllm.config import model_config_from_dict
from cvllm.testing.checkpoints import EOS_TOKEN_ID
from cvllm_gemma import plugin
from cvllm_gemma.gemma2 import layer_types
from cvllm_gemma.gemma3 import Gemma3ForConditionalGeneration, rope_by_layer_type, sliding_window_pattern
from cvllm_gemma.multimodal import GEMMA3_TEXT

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# in the shape of gemma-3-4b-it's config.json: transformers 4 wrote the text_config's differences from the defaults
HUB_CONFIG: dict[str, Any] = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
    "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}
TEXT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "hidden_activation", "max_position_embeddings", "rms_norm_eps",
             "query_pre_attn_scalar", "sliding_window", "final_logit_softcapping", "attn_logit_softcapping",
             "tie_word_embeddings")


@pytest.fixture
def gemma_plugin_only(monkeypatch):
    monkeypatch.setenv("CVLLM_PLUGINS", "")  # no installed entry points
    plugins.reset_plugins()
    plugins.get_plugin_manager().register(plugin, name="gemma")
    yield
    plugins.reset_plugins()


def test_hub_text_config_read_as_transformers_reads_it() -> None:
    import transformers

    theirs = transformers.Gemma3Config(**HUB_CONFIG).text_config
    ours = GEMMA3_TEXT.text_config(model_config_from_dict(HUB_CONFIG))
    assert {k: ours.get(k) for k in TEXT_KEYS} == {k: getattr(theirs, k) for k in TEXT_KEYS}
    assert layer_types(ours, sliding_window_pattern(ours)) == theirs.layer_types
    assert rope_by_layer_type(ours) == theirs.rope_parameters
    assert ours.architectures == ["Gemma3ForConditionalGeneration"]
    assert ours.eos_token_id == [1, 106] and ours.dtype == "bfloat16"
    assert ours.raw_config == HUB_CONFIG and ours.get("text_config") is None
    assert GEMMA3_TEXT.text_config(ours) is ours  # flat already


def test_the_class_declares_where_its_text_model_is() -> None:
    assert Gemma3ForConditionalGeneration.nested_text_model is GEMMA3_TEXT
    assert GEMMA3_TEXT.config_key == "text_config" and GEMMA3_TEXT.holds(HUB_CONFIG)


def test_weight_names() -> None:
    text_weight_name = GEMMA3_TEXT.weight_name
    layer = "layers.0.self_attn.q_proj.weight"
    assert text_weight_name(f"language_model.model.{layer}") == f"model.{layer}"
    assert text_weight_name(f"model.language_model.{layer}") == f"model.{layer}"
    assert text_weight_name("language_model.lm_head.weight") == "lm_head.weight"
    assert text_weight_name("lm_head.weight") == "lm_head.weight"
    for tower in ("vision_tower.vision_model.post_layernorm.weight", "multi_modal_projector.mm_input_projection_weight",
                  "model.vision_tower.vision_model.embeddings.patch_embedding.weight",
                  "model.multi_modal_projector.mm_soft_emb_norm.weight"):
        assert text_weight_name(tower) is None


def test_checkpoint_opens_with_the_text_config(gemma_checkpoint, gemma_plugin_only) -> None:
    checkpoint = gemma_checkpoint("gemma3_multimodal")
    opened = plugins.open_checkpoint(str(checkpoint.path))
    assert opened.architecture == "Gemma3ForConditionalGeneration"
    text = checkpoint.model.config.text_config
    assert (opened.config.vocab_size, opened.config.max_position_embeddings) == (512, 256)
    assert opened.config.num_attention_heads == text.num_attention_heads
    assert opened.eos_token_ids() == {EOS_TOKEN_ID}
    assert "text_config" not in opened.config.to_dict()


def test_text_only_checkpoints_opened_as_they_are(gemma_checkpoint, gemma_plugin_only) -> None:
    text_only = gemma_checkpoint("gemma3", spelling="v5")
    opened = plugins.open_checkpoint(str(text_only.path))
    assert opened.config.get("text_config") is None and opened.architecture == "Gemma3ForCausalLM"
    names = [name for name, _ in opened.weights(lazy=True)]
    assert names and all(name.startswith(("model.", "lm_head.")) for name in names)


def test_other_towers_never_read(gemma_checkpoint, gemma_plugin_only) -> None:
    # the vision tower's tensors are dropped by name, before anything reads them
    from cvllm.checkpoint import LazyTensor

    opened = plugins.open_checkpoint(str(gemma_checkpoint("gemma3_multimodal").path))
    weights = list(opened.weights(lazy=True))
    assert weights and all(name.startswith(("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head."))
                           for name, _ in weights)
    assert all(isinstance(tensor, LazyTensor) for _, tensor in weights)


@pytest.mark.parametrize("layout", ["saved", "v5"])
def test_vision_tower_left_unread_quietly(gemma_checkpoint, harness, caplog, layout: str) -> None:
    checkpoint = gemma_checkpoint("gemma3_multimodal", layout=layout, spelling=layout)
    with safe_open(str(checkpoint.path / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any("vision_tower" in n for n in names) and any("multi_modal_projector" in n for n in names)
    assert any(n.startswith("model.language_model." if layout == "v5" else "language_model.model.") for n in names)
    with caplog.at_level(logging.WARNING, logger="cvllm"):
        llm = harness.llm(checkpoint)
    assert not [r for r in caplog.records if "ignoring checkpoint tensor" in r.getMessage()]
    model = llm.llm_engine.runner.model
    assert not [n for n, _ in model.named_parameters() if "vision" in n or "projector" in n]
    assert model.lm_head.weight is model.model.embed_tokens.weight
