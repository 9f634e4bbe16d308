"""A sentence-transformers model directory: its pooling, and its weights under the causal-LM names.

sentence-transformers lists a model's stages in ``modules.json`` (a Transformer at the root, then a Pooling
module whose ``config.json`` names the mode, then an optional Normalize). Qwen3-Embedding is one: last-token
pooling, normalised. Its Transformer stage is saved with ``AutoModel``, so the tensors are named as the base model's
(``layers.0...``, ``embed_tokens.weight``) with no LM head; cvllm builds the ``...ForCausalLM`` class the config
names, so they are read under ``model.`` here, and a missing untied head is tied to the embedding so the model
builds (the head is only used for generation, which such a checkpoint was not made for).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

from cvllm.checkpoint.base import CheckpointError
from cvllm.pooling import PoolingConfig

logger = logging.getLogger(__name__)

MODULES_FILE = "modules.json"
# sentence-transformers' Pooling config keys, and newer versions' single "pooling_mode" values, for the modes cvllm
# pools; max, mean_sqrt_len and weightedmean are refused by name
_MODE_KEYS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_MODE_NAMES = {"lasttoken": "last", "mean": "mean", "mean_tokens": "mean", "cls": "cls", "cls_token": "cls"}
_STAGES_RUN = ("Transformer", "Pooling", "Normalize")
# the first name component of a base model's tensors (DecoderStack's attributes): read under "model."
_BASE_MODEL_PARTS = ("embed_tokens", "layers", "norm")


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found, though {MODULES_FILE} lists it") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def read_pooling(path: Path) -> PoolingConfig | None:
    """The pooling a sentence-transformers directory declares; None where there is no modules.json. A
    configuration cvllm cannot reproduce (a Dense stage, max pooling ...) raises CheckpointError saying which."""
    modules_file = path / MODULES_FILE
    if not modules_file.is_file():
        return None
    modules = _read(modules_file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise CheckpointError(f"{modules_file}: expected a list of modules")
    stages = [(str(m.get("type", "")).rsplit(".", 1)[-1], m) for m in modules]
    others = [name for name, _ in stages if name not in _STAGES_RUN]
    if others:
        raise CheckpointError(f"{modules_file}: the {', '.join(others)} stage(s) are not run by cvllm, which runs "
                              f"only {', '.join(_STAGES_RUN)}")
    pooling = next((m for name, m in stages if name == "Pooling"), None)
    if pooling is None:
        raise CheckpointError(f"{modules_file}: no Pooling module")
    config_file = path / str(pooling.get("path") or "") / "config.json"
    config = _read(config_file)
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object")
    if isinstance(config.get("pooling_mode"), str):
        wanted = [config["pooling_mode"]]
        modes = [_MODE_NAMES[m] for m in wanted if m in _MODE_NAMES]
    else:
        wanted = [key for key, value in config.items() if key.startswith("pooling_mode") and value is True]
        modes = [_MODE_KEYS[key] for key in wanted if key in _MODE_KEYS]
    if len(wanted) != 1 or len(modes) != 1:
        raise CheckpointError(f"{config_file}: pooling {', '.join(wanted) or 'none'}; cvllm pools with exactly one "
                              f"of last-token, mean and CLS")
    if config.get("include_prompt") is False:
        raise CheckpointError(f"{config_file}: include_prompt false (pooling without the instruction's tokens) is "
                              f"not supported")
    normalize = any(name == "Normalize" for name, _ in stages)
    return PoolingConfig(method=modes[0], normalize=normalize, source=f"{path.name}/{MODULES_FILE}")


def read_declared_pooling(path: Path) -> PoolingConfig | None:
    """``read_pooling``, with a configuration cvllm cannot follow logged, not raised: the checkpoint still serves
    generation, and ``--task embed`` its default pooling."""
    try:
        return read_pooling(path)
    except (CheckpointError, OSError) as e:
        logger.warning("%s; embeddings are not served from this declaration", e)
        return None


def is_base_model(names: Iterable[str]) -> bool:
    """The tensors are a bare base model's (``layers.0...``, no ``model.`` prefix)."""
    firsts = {name.split(".", 1)[0] for name in names}
    return bool(firsts) and "model" not in firsts and "layers" in firsts


def causal_lm_names(weights: Callable[[], Iterator[tuple[str, Any]]]) -> Iterator[tuple[str, Any]]:
    """The tensors of ``weights()`` with base-model names read under ``model.`` (what ``...ForCausalLM`` loads).
    Module-level, used through ``partial``: a tensor-parallel worker gets the checkpoint pickled."""
    for name, tensor in weights():
        yield (f"model.{name}" if name.split(".", 1)[0] in _BASE_MODEL_PARTS else name), tensor


def adapt_base_model(config, names: Iterable[str], weights, source: Path):
    """The weight iterator to load a sentence-transformers directory with: as it is, or a base model's tensors
    under the causal-LM names, its config's head tied to the embedding when the checkpoint has no head."""
    names = list(names)
    if not is_base_model(names):
        return weights
    if "lm_head.weight" not in names and not config.get("tie_word_embeddings", False):
        logger.info("%s: a base model without an LM head; its head is tied to the token embedding so that the "
                    "model builds (what it generates means nothing: serve it for embeddings)", source)
        config.tie_word_embeddings = True
    return partial(causal_lm_names, weights)
