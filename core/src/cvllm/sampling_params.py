"""Per-request sampling settings, with vLLM's names, defaults and validation.

A msgspec Struct, as vLLM's is: the engine-core transport sends it as it is (engine_process/messages.py), and
decoding it in the core runs ``__post_init__``, so the rules below are the only ones, wherever it is built.
"""

from __future__ import annotations

import math
from typing import NoReturn

import msgspec

from cvllm.structured_output.params import StructuredOutputsParams

# Below this temperature a request is treated as greedy (argmax), as vLLM does.
GREEDY_TEMPERATURE = 1e-5
MAX_N = 128  # completions per request: more is a mistake, or an attempt to exhaust a server
# The bound of token ids, token counts and top_k: far past any vocabulary or context, and an int32 on the device.
MAX_INT32 = 2**31 - 1
# What torch.Generator.manual_seed takes (a negative seed wraps to its uint64), and what msgpack carries to the core.
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
FLOAT32_MAX = 3.4028234663852886e38
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `seed=True` or `n=True` is a caller's mistake.
    return isinstance(value, int) and not isinstance(value, bool)


def _int_in(value: object, low: int, high: int) -> bool:
    return _is_int(value) and low <= value <= high


def _finite(value: object) -> bool:
    """A number that is neither NaN nor infinite, and stays finite as the float32 the device computes with
    (1e999 in JSON is inf; a temperature or penalty of 1e300 would turn into inf there, and 0 * inf into NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value) and abs(value) <= FLOAT32_MAX
    except OverflowError:  # an int past float's range
        return False


class SamplingParamError(ValueError):
    """A sampling parameter out of its range; ``param`` names it (the server's 400 reports it as ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class SamplingParams(msgspec.Struct, omit_defaults=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: up to the context limit
    stop: str | list[str] | None = None  # normalised to list[str]
    stop_token_ids: list[int] | None = None  # normalised to list[int]
    seed: int | None = None
    logprobs: int | None = None  # top logprobs to return; 0: only the sampled token's
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (disables prefix hits)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id → added to its logit (OpenAI: within [-100, 100])
    logits_processors: list[str] | None = None  # registered logits processors (register_samplers), in order
    # the output follows a JSON schema, regex, choice or grammar (structured_output/; a dict is taken as its fields)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        self.logits_processors = _normalise_logits_processors(self.logits_processors)
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:   # a field it does not have
                raise SamplingParamError("structured_outputs", f"structured_outputs: {e}") from None
        self._validate()
        # an int is a fine number, but the engine core's transport carries 10**30 only as a float
        for name in FLOAT_FIELDS:
            setattr(self, name, float(getattr(self, name)))
        if self.logit_bias is not None:
            self.logit_bias = {token_id: float(bias) for token_id, bias in self.logit_bias.items()}

    def _validate(self) -> None:
        if not _int_in(self.n, 1, MAX_N):
            _reject("n", f"must be an integer in [1, {MAX_N}]", self.n)
        if not (_finite(self.temperature) and self.temperature >= 0.0):
            _reject("temperature", "must be >= 0 and finite", self.temperature)
        if not (_finite(self.top_p) and 0.0 < self.top_p <= 1.0):
            _reject("top_p", "must be in (0, 1]", self.top_p)
        if not _int_in(self.top_k, -1, MAX_INT32):
            _reject("top_k", "must be an integer in [-1, 2**31 - 1] (0 or -1 disables it)", self.top_k)
        if not (_finite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            _reject("min_p", "must be in [0, 1]", self.min_p)
        if self.max_tokens is not None and not _int_in(self.max_tokens, 1, MAX_INT32):
            _reject("max_tokens", "must be an integer in [1, 2**31 - 1] or None", self.max_tokens)
        for name in ("presence_penalty", "frequency_penalty"):
            if not (_finite(getattr(self, name)) and -2.0 <= getattr(self, name) <= 2.0):
                _reject(name, "must be in [-2, 2]", getattr(self, name))
        if not (_finite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            _reject("repetition_penalty", "must be > 0 and finite", self.repetition_penalty)
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                if not _int_in(token_id, 0, MAX_INT32):
                    _reject("logit_bias", "keys must be token ids in [0, 2**31 - 1]", token_id)
                if not (_finite(bias) and -100.0 <= bias <= 100.0):
                    raise SamplingParamError("logit_bias", f"logit_bias values must be in [-100, 100], got {bias!r} "
                                                           f"for token {token_id}")
        if not _int_in(self.min_tokens, 0, MAX_INT32):
            _reject("min_tokens", "must be an integer in [0, 2**31 - 1]", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamError("min_tokens", f"min_tokens must be <= max_tokens, got "
                                                   f"min_tokens={self.min_tokens} and max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not _int_in(getattr(self, name), 0, MAX_INT32):
                _reject(name, "must be an integer in [0, 2**31 - 1] or None", getattr(self, name))
        if self.seed is not None and not _int_in(self.seed, MIN_SEED, MAX_SEED):
            _reject("seed", "must be an integer in [-2**63, 2**64 - 1] or None", self.seed)
        for name in BOOL_FIELDS:   # the core's transport carries them as booleans, and only as such
            if not isinstance(getattr(self, name), bool):
                _reject(name, "must be true or false", getattr(self, name))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _normalise_stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else list(stop)
    for s in stop:
        if not isinstance(s, str):
            _reject("stop", "must be a string or a list of strings", s, "an item ")
    # An empty stop string would match everywhere and end every request at once.
    if any(s == "" for s in stop):
        raise SamplingParamError("stop", "stop must not contain an empty string")
    return stop


def _normalise_stop_token_ids(ids: list[int] | None) -> list[int]:
    if ids is None:
        return []
    ids = list(ids)
    for token_id in ids:
        if not _int_in(token_id, 0, MAX_INT32):
            _reject("stop_token_ids", "must hold token ids in [0, 2**31 - 1]", token_id, "an item ")
    return ids


def _normalise_logits_processors(names: list[str] | None) -> list[str] | None:
    if names is None:
        return None
    if isinstance(names, str) or not isinstance(names, (list, tuple)):
        _reject("logits_processors", "must be a list of names", names)
    names = list(names)
    for name in names:
        if not isinstance(name, str):
            _reject("logits_processors", "must be a list of names", name, "an item ")
    if names:   # the registry is built (plugins discovered) only when a request names a processor
        from cvllm import plugins

        registry = plugins.logits_processors()
        for name in names:
            if name not in registry:
                raise SamplingParamError("logits_processors", f"logits_processors names {name!r}, which no plugin "
                                         f"registered; registered: {', '.join(registry.names()) or 'none'}")
    return names


def _reject(param: str, rule: str, got: object, what: str = "") -> NoReturn:
    raise SamplingParamError(param, f"{param} {rule}, got {what}{got!r}")
