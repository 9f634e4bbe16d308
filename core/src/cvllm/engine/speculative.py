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

import array
from dataclasses import dataclass
from typing import Any

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
    # what one draft adds to a step's time, as a fraction of a decode step: sets how many drafts a sequence verifies
    # (draft_length); None: the backend's figure (Backend.draft_token_cost), 0: always num_speculative_tokens
    draft_token_cost: float | None = None
    # n-gram drafts looked up on the device, so that with async scheduling a verify step is launched before the one
    # before it is read back (ngram_device.py); None: the backend's default (Backend.device_drafts)
    device_drafts: bool | None = None

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
        if config.draft_token_cost is not None and not 0 <= config.draft_token_cost <= 10:
            raise ValueError(f"speculative_config: draft_token_cost must be in [0, 10], got {config.draft_token_cost}")
        return config


MIN_PROPOSALS = 16
# a sequence whose drafts fell below min_acceptance_rate (after MIN_PROPOSALS) stops drafting for this many tokens,
# then tries again with a fresh record: text that copies after a stretch that does not (a chat that then quotes,
# code after prose) is speculated again, for a few verify steps every REPROBE_TOKENS tokens where it never copies
REPROBE_TOKENS = 64
TOKEN_BYTES = 8   # token_bytes: int64
# draft_length's prior on a draft's chance to be accepted, as pseudo-counts (accepted, rejected): 0.75 before any
# verify step, so that a sequence starts with the drafts a copy deserves, and its own record outweighs it within a
# few steps
PRIOR_ACCEPTED, PRIOR_REJECTED = 3, 1


def draft_length(accepted: int, rejections: int, cost: float, most: int) -> int:
    """How many drafts (1..``most``) a sequence verifies next: the k that maximises tokens a step over the step's
    cost. A verify step's drafts are accepted in order until the first that is wrong; with each accepted with
    probability p, its expected tokens are 1 + p + ... + p^k (the target's own token always counts), and its cost
    1 + ``cost`` * k decode steps. p is estimated from the sequence's record: ``accepted`` drafts and ``rejections``
    (verify steps that rejected one), the geometric law's estimate under PRIOR_ACCEPTED / PRIOR_REJECTED.

    Where a draft costs little against a step (a large model on a GPU: ~0.04) that is ``most`` unless nearly every
    draft is rejected; where it costs much (the CPU: ~0.2, each draft a row of every matmul) fewer drafts pay more
    (docs/speculative.md, "How many drafts"). Exactness does not depend on it: any k gives the same tokens."""
    if most <= 1 or cost <= 0:
        return most
    p = (accepted + PRIOR_ACCEPTED) / (accepted + rejections + PRIOR_ACCEPTED + PRIOR_REJECTED)
    best_k, best, tokens, term = 1, 0.0, 1.0, 1.0
    for k in range(1, most + 1):
        term *= p
        tokens += term
        value = tokens / (1 + cost * k)
        if value > best:
            best_k, best = k, value
    return best_k


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the sequence's last n tokens (the longest
    n in [min_n, max_n] that occurs), or [] when none does."""
    return lookup_ngram(token_bytes(tokens), k, min_n, max_n)


def token_bytes(tokens: list[int]) -> bytes:
    """Tokens as the int64 bytes ``lookup_ngram`` searches."""
    return array.array("q", tokens).tobytes()


def lookup_ngram(data: bytes | bytearray, k: int, min_n: int, max_n: int) -> list[int]:
    """``propose_ngram`` on the tokens' ``token_bytes``: C's substring search (``rfind``) finds the latest earlier
    occurrence of a suffix with no Python loop over the tokens; a microsecond at thousands of tokens, where converting
    the list costs more (the speculator keeps each sequence's bytes: Sequence.ngram_bytes)."""
    length = len(data) // TOKEN_BYTES
    if length < min_n + 1:
        return []
    # the shortest suffix first: where it did not occur before (a miss), no longer one did, and one search says so
    start = _after_latest(data, min_n)
    if start < 0:
        return []
    for n in range(min(max_n, length - 1), min_n, -1):   # then the longest that occurs
        after = _after_latest(data, n)
        if after >= 0:
            start = after
            break
    return array.array("q", data[start * TOKEN_BYTES:(start + k) * TOKEN_BYTES]).tolist()


def _after_latest(data: bytes | bytearray, n: int) -> int:
    """The token after the latest occurrence of the last ``n`` tokens that ends before the last token; -1: none."""
    suffix = data[len(data) - n * TOKEN_BYTES:]
    at = data.rfind(suffix, 0, len(data) - TOKEN_BYTES)
    while at > 0 and at % TOKEN_BYTES:   # a match across token boundaries: look before it
        at = data.rfind(suffix, 0, at + len(suffix) - 1)
    return -1 if at < 0 else at // TOKEN_BYTES + n


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
