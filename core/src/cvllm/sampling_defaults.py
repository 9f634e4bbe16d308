"""Where a request's sampling settings come from when it leaves them out: one precedence for both front-ends.

Weakest first: ``SamplingParams``' own defaults; the model's (its generation_config.json, or a GGUF's
general.sampling.* over llama.cpp's defaults) unless ``LLM(generation_config="vllm")`` / ``cvserve
--generation-config vllm``; then cvserve's sampling flags (``--temperature`` ...); a request's own fields win
over all of them.
"""

from __future__ import annotations

from typing import Any

# vLLM's generation_config values: "auto" samples with the model's defaults where a request gives none,
# "vllm" with SamplingParams' own
GENERATION_CONFIG_MODES = ("auto", "vllm")
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def check_generation_config_mode(mode: str) -> None:
    if mode not in GENERATION_CONFIG_MODES:
        raise ValueError(f"generation_config must be one of {', '.join(GENERATION_CONFIG_MODES)}, got {mode!r}")


def model_sampling_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields a checkpoint's generation config sets (``do_sample: false`` means greedy)."""
    defaults = {k: generation_config[k] for k in GENERATION_CONFIG_KEYS if generation_config.get(k) is not None}
    if generation_config.get("do_sample") is False:
        defaults["temperature"] = 0.0
    return defaults


def sampling_defaults(generation_config: dict[str, Any], mode: str = "auto",
                      overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The defaults a request starts from: the model's (``mode`` "auto"), then ``overrides`` that are set (the
    server's flags; they may hold max_tokens, which is no generation-config key)."""
    check_generation_config_mode(mode)   # a misspelt mode must not drop the model's defaults silently
    model = model_sampling_defaults(generation_config) if mode == "auto" else {}
    return {**model, **{k: v for k, v in (overrides or {}).items() if v is not None}}
