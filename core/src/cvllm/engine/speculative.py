"""Speculative decoding: draft tokens proposed cheaply, verified in one target forward. Two proposers: n-gram (prompt
lookup: drafts copied from earlier in the sequence) and a draft model (a small model with the same tokenizer, run
greedily: draft_model.py).

A sequence's K drafts are appended to its tokens before scheduling, so the scheduler gives it a chunk of 1 + K
tokens (its last real token and the drafts) and the forward pass writes their KV like any chunk. The sampler then
samples every one of the K + 1 positions as it would a decode (``DraftPosition`` rows: the same parameters and
generator, the prefix up to that position). Position i's sample t_i is the target's token after the prefix that
ends in draft i; drafts are accepted while draft i+1 == t_i, and the first t_i that differs (or t_K when all are
accepted) is the bonus token. So a step yields 1..K+1 tokens, each sampled from the target's own distribution
given what precedes it: greedy output is the same token for token, and sampled output has the target's
distribution exactly (a deterministic draft, which both proposers make, is accepted with probability p(draft), the
standard rejection rule with a one-hot draft, and a rejected position's sample is p conditioned on not being the
draft). The KV slots of rejected drafts are rolled back by lowering ``num_computed_tokens`` (they are overwritten
later); prefix-cache blocks are registered only over accepted tokens.

The engine's side (proposing, fitting, verifying, and with async scheduling launching the next step on a guess of
this one's outcome) is speculator.py. Rows with penalties, logits processors, grammars or a pending ``min_tokens``
are not speculated (their processing depends on the tokens before each position in ways the per-position rows do
not carry).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

METHODS = ("ngram", "draft_model")


@dataclass(slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    # draft_model: the draft's checkpoint (a directory or GGUF file, opened as the target is; or a Checkpoint)
    model: Any = None
    prompt_lookup_max: int = 4           # the longest suffix looked up earlier in the sequence
    prompt_lookup_min: int = 1
    # no speculation in a step with more running sequences than this (then the batch fills the device by itself)
    disable_by_batch_size: int = 8
    # a sequence stops speculating once its drafts, after at least MIN_PROPOSALS, are accepted below this rate
    min_acceptance_rate: float = 0.1

    @classmethod
    def from_dict(cls, spec: dict | None) -> SpeculativeConfig | None:
        if not spec:
            return None
        spec = dict(spec)
        # (vLLM's rule: a config naming a model and no method means a draft model)
        method = spec.setdefault("method", "draft_model" if spec.get("model") is not None else "ngram")
        if method not in METHODS:
            raise ValueError(f"speculative_config: unknown method {method!r}; known: {', '.join(METHODS)}")
        if (method == "draft_model") != (spec.get("model") is not None):
            raise ValueError("speculative_config: the draft_model method needs \"model\" (the draft's checkpoint) "
                             "and the ngram method takes none")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known))}")
        config = cls(**spec)
        if not 1 <= config.num_speculative_tokens <= 16:
            raise ValueError(f"speculative_config: num_speculative_tokens must be in [1, 16], got "
                             f"{config.num_speculative_tokens}")
        if not 1 <= config.prompt_lookup_min <= config.prompt_lookup_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        return config


MIN_PROPOSALS = 16


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the sequence's last n tokens (the longest
    n in [min_n, max_n] that occurs), or [] when none does. One pass over the sequence (the earlier places of its
    last token), then at most ``max_n`` comparisons per such place: a few hundred microseconds at 32k tokens."""
    length = len(tokens)
    if length < min_n + 1:
        return []
    array = np.asarray(tokens, dtype=np.int64)
    starts = np.flatnonzero(array[:length - 1] == array[-1])   # earlier places of the last token
    if not starts.size:
        return []
    # how far back each place matches the sequence's end, up to max_n tokens
    matched = np.ones(starts.size, dtype=np.int64)
    alive = np.ones(starts.size, dtype=bool)
    for back in range(1, min(max_n, length - 1)):
        ok = (starts - back >= 0) & (array[np.maximum(starts - back, 0)] == array[length - 1 - back])
        alive &= ok
        matched += alive
    best = int(matched.max())
    if best < min_n:
        return []
    start = int(starts[np.flatnonzero(matched == best)[-1]]) + 1   # the latest place of the longest match
    return array[start:start + k].tolist()


class DraftPosition:
    """One of a speculating sequence's K + 1 sampled positions, as the sampler reads a row (SamplerRow): the
    sequence's parameters and generator, its tokens up to this position."""

    __slots__ = ("seq", "num_tokens")
    grammar = None          # (grammar rows do not speculate)
    num_drafts = 0

    def __init__(self, seq, num_tokens: int):
        self.seq, self.num_tokens = seq, num_tokens

    @property
    def is_finished(self) -> bool:
        return self.seq.is_finished

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id

    @property
    def sampling_params(self):
        return self.seq.sampling_params

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[:self.num_tokens]

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    @property
    def generator(self):
        return self.seq.generator

    @property
    def min_tokens_stop_ids(self) -> list[int]:
        return self.seq.min_tokens_stop_ids


def sampler_rows(sampling, num_drafts: list[int]) -> list:
    """The sampler's rows for a step's sampling sequences, whose drafts are still at the end of their tokens: one
    with ``num_drafts`` K gives K + 1."""
    rows = []
    for seq, k in zip(sampling, num_drafts):
        if not k:
            rows.append(seq)
        else:
            total = len(seq.token_ids)
            rows.extend(DraftPosition(seq, total - k + j) for j in range(k + 1))
    return rows


def accepted(drafts: list[int], targets: list[int]) -> int:
    """How many leading drafts the target's samples confirm (targets has one more entry than drafts)."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a
