"""One batched sampling step: logits [B, V] for B sequences in, one token id per sequence out.

Semantics follow vLLM: the grammar bitmask of structured output, the logits processors requests named
(logits_processors.py), logit_bias, min_tokens suppression, repetition penalty (prompt + output), presence and
frequency penalties (output only; token counts kept on the device, penalties.py), greedy argmax, then temperature,
top-k, top-p and min-p before an exponential-race draw. Returned logprobs are the raw model log-softmax.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from cvllm.engine.logits_processors import LogitsProcessors
from cvllm.engine.penalties import PenaltyHistory, histories_from_token_lists
from cvllm.engine.upload import upload
from cvllm.sampling_params import SamplingParams
from cvllm.structured_output.grammar import apply_token_bitmask


class SamplerRow(Protocol):
    """What the sampler reads from each sequence (the engine's Sequence provides it)."""

    seq_id: int  # keys its penalty history
    sampling_params: SamplingParams
    token_ids: list[int]  # prompt followed by the tokens generated so far
    num_prompt_tokens: int
    generator: torch.Generator | None  # only for seeded requests
    min_tokens_stop_ids: list[int]  # suppressed while fewer than min_tokens outputs exist


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, raw logprob of the sampled token
    top_ids: torch.Tensor | None  # [B, K] int64, K = max logprobs asked in the batch
    top_logprobs: torch.Tensor | None  # [B, K] float32
    # token_ids for the host: -1 where the model's logits held NaN or +inf (the engine fails that request alone);
    # token_ids itself stays a valid id, as the next step's input on the device
    reported_ids: torch.Tensor | None = None


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def advance_generator(generator: torch.Generator, num_tokens: int, vocab_size: int) -> None:
    """Move a seeded sequence's generator past ``num_tokens`` sampled tokens, each one exponential-race draw over
    the vocabulary (``_exponential_race``), so a request resumed on a new engine core continues its random stream.
    Exact unless speculative decoding drew for drafts too."""
    noise = torch.empty(vocab_size, device=generator.device)
    for _ in range(num_tokens):
        noise.exponential_(generator=generator)


def torch_argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


class Sampler:
    def __init__(self, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 argmax_reported: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None):
        """``argmax`` over the vocabulary, for greedy rows and the exponential race: the backend's kernel
        (Backend.argmax) where it has one; ``argmax_reported``: the same with the ids the host is told (-1 where a
        row is not finite) from one pass (Backend.argmax_reported), for a batch of plain greedy rows."""
        self.argmax = argmax or torch_argmax
        self.argmax_reported = argmax_reported
        self.logits_processors = LogitsProcessors()

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplerRow],
                 history: PenaltyHistory | None = None,
                 allowed: tuple[torch.Tensor, torch.Tensor] | None = None) -> SamplerOutput:
        """``history``: the engine's device-side token history of penalised sequences (penalties.py); the
        sampled tokens of penalised rows are added to it. Without one, penalties read the rows' token lists.
        ``allowed``: (row indices, int32 bitmask) on the device, the tokens the grammars of those rows allow
        (structured output); applied first, so nothing after it can bring a forbidden token back."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
        params = [row.sampling_params for row in rows]
        plain_greedy = allowed is None and all(_plain_greedy(p) for p in params)
        if plain_greedy and self.argmax_reported is not None:
            # the usual batch-1 step, in the backend's one pass: the argmax, and -1 where a row is not finite
            token_ids, reported_ids = self.argmax_reported(logits)
            return SamplerOutput(token_ids, None, None, None, reported_ids)
        if plain_greedy:
            # the usual batch-1 step without the backend's one-pass kernel: only the argmax (what the general path
            # below computes for such rows, in one pass over the rows instead of one per feature: host time a step,
            # where the device waits for it). NaN and +inf rank highest in it, so a row holding one is not finite
            # exactly where its chosen logit is not below +inf: no second pass over the row
            token_ids = self.argmax(logits)
            sane = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1) < float("inf")
            return SamplerOutput(token_ids, None, None, None, torch.where(sane, token_ids, -1))
        # False for a row with NaN or +inf (-inf is a masked token): its max is NaN or +inf. One reduction, no
        # [B, V] boolean temporary; the backend's one-pass argmax reports it where it has one (torch's amax of a
        # 128k-wide row took 18 us on an H100, the chunked argmax kernels ~4)
        if self.argmax_reported is not None:
            sane = self.argmax_reported(logits)[1] >= 0
        else:
            sane = logits.amax(dim=-1) < float("inf")
        asked = [p.logprobs for p in params if p.logprobs is not None]
        processed = any(p.logits_processors for p in params)
        # something computes with the logits (a plain greedy batch, which needs only the argmax, returned above):
        # in float32
        logits = logits.float()

        raw_logprobs = logits.log_softmax(dim=-1) if asked else None

        if allowed is not None:
            logits = apply_token_bitmask(logits, *allowed)
        if processed:
            logits = self.logits_processors.apply(logits, rows)
        logits = apply_logit_bias(logits, params)
        logits = apply_min_tokens(logits, rows)
        penalised = [i for i, p in enumerate(params) if p.needs_penalties]
        if penalised:
            index = _row_tensor(penalised, logits, torch.long)
            subset = [rows[i] for i in penalised]
            if history is not None:
                history_rows = history.rows(subset)
                counts, seen = history.gather(history_rows)
            else:
                counts, seen = histories_from_token_lists(subset, logits.shape[1], logits.device)
            penalised_logits = apply_penalties(logits[index], [params[i] for i in penalised], counts, seen)
            logits = logits.index_put((index,), penalised_logits)

        token_ids = _sample_or_argmax(logits, rows, self.argmax)
        if penalised and history is not None:
            history.record(history_rows, token_ids[index])

        reported_ids = torch.where(sane, token_ids, -1)
        if raw_logprobs is None:
            return SamplerOutput(token_ids, None, None, None, reported_ids)
        sampled_logprobs = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        top_logprobs, top_ids = raw_logprobs.topk(max(asked), dim=-1)
        return SamplerOutput(token_ids, sampled_logprobs, top_ids, top_logprobs, reported_ids)


def _plain_greedy(p: SamplingParams) -> bool:
    """A greedy row that nothing else applies to: its token is the argmax of its logits."""
    return (p.greedy and p.logprobs is None and not p.logits_processors and not p.logit_bias
            and not p.needs_penalties and not p.min_tokens)


def _sample_or_argmax(logits: torch.Tensor, rows: Sequence[SamplerRow],
                      argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax) -> torch.Tensor:
    params = [row.sampling_params for row in rows]
    if all(p.greedy for p in params):
        return argmax(logits)

    # Greedy rows go through the random path with temperature 1 and are replaced at the end.
    temperatures = _row_tensor([1.0 if p.greedy else p.temperature for p in params], logits)
    scaled = apply_top_k_top_p(logits / temperatures.unsqueeze(1), params)
    sampled_ids = _exponential_race(apply_min_p(scaled, params), [row.generator for row in rows], argmax)

    if not any(p.greedy for p in params):
        return sampled_ids   # (no argmax of the logits: a sampling batch needs none)
    greedy = _row_tensor([p.greedy for p in params], logits, torch.bool)
    return torch.where(greedy, argmax(logits), sampled_ids)


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Add each row's logit_bias (OpenAI's: before everything else, greedy included)."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            rows.extend([i] * len(p.logit_bias))
            cols.extend(p.logit_bias.keys())
            values.extend(p.logit_bias.values())
    if not rows:
        return logits
    index = (_row_tensor(rows, logits, torch.long), _row_tensor(cols, logits, torch.long))
    return logits.index_put(index, _row_tensor(values, logits), accumulate=True)


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplerRow]) -> torch.Tensor:
    """Forbid the stop ids of rows that have produced fewer than min_tokens outputs."""
    row_index: list[int] = []
    col_index: list[int] = []
    for i, row in enumerate(rows):
        min_tokens = row.sampling_params.min_tokens
        if min_tokens and len(row.token_ids) - row.num_prompt_tokens < min_tokens:
            row_index.extend([i] * len(row.min_tokens_stop_ids))
            col_index.extend(row.min_tokens_stop_ids)
    if not row_index:
        return logits
    index = torch.tensor([row_index, col_index], dtype=torch.long, device=logits.device)
    return logits.index_put((index[0], index[1]), torch.tensor(float("-inf"), device=logits.device))


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], counts: torch.Tensor,
                    seen: torch.Tensor) -> torch.Tensor:
    """Repetition penalty over the tokens ``seen`` (prompt + output); presence and frequency penalties over
    the output ``counts`` (``[B, V]`` each, from penalties.py)."""
    repetition = _row_tensor([p.repetition_penalty for p in params], logits).unsqueeze(1)
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)

    frequency = _row_tensor([p.frequency_penalty for p in params], logits).unsqueeze(1)
    presence = _row_tensor([p.presence_penalty for p in params], logits).unsqueeze(1)
    return logits - frequency * counts - presence * (counts > 0).float()


def apply_top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf."""
    vocab = logits.shape[1]
    use_top_k = any(0 < p.top_k < vocab for p in params)
    use_top_p = any(p.top_p < 1.0 for p in params)
    if not (use_top_k or use_top_p):
        return logits

    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)  # [1, V]
    if use_top_k:
        top_k = _row_tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], logits)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    if use_top_p:
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Keep a token while the mass strictly before it is below p: the smallest set reaching p.
        # The first token has zero mass before it, so the most likely token is always kept.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Disabled rows get an infinite threshold so rounding in the cumsum never trims their tail.
        top_p = _row_tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], logits)
        remove = (mass_before >= top_p.unsqueeze(1)) & (ranks > 0)
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def apply_min_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Set to -inf the logits whose probability is below min_p times the row's largest probability: in log space,
    below the row's largest logit plus log(min_p) (no softmax needed)."""
    if not any(p.min_p > 0.0 for p in params):
        return logits
    log_min_p = _row_tensor([math.log(p.min_p) if p.min_p > 0.0 else float("-inf") for p in params], logits)
    threshold = logits.amax(dim=-1, keepdim=True) + log_min_p.unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def _exponential_race(logits: torch.Tensor, generators: Sequence[torch.Generator | None],
                      argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax) -> torch.Tensor:
    """argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i / sum(p), with no host sync; taken in log
    space, argmax(logit_i - log E_i) (log p_i is logit_i less the row's log-sum-exp, the same for every i), so no
    softmax is computed: on an H100 torch's softmax of one 128k-wide row took 34 us of a ~2.7 ms decode step.

    Unseeded rows share one draw from the default generator; a seeded row draws from its own
    generator, so its result depends on nothing else in the batch.
    """
    noise = torch.empty_like(logits)
    if any(generator is None for generator in generators):
        noise.exponential_()
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].exponential_(generator=generator)
    # An exact zero draw would give -inf - (-inf) = NaN for a masked token.
    return argmax(logits - noise.clamp_min_(1e-10).log_())


def _row_tensor(values: list[float] | list[int], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Per-row parameters on the logits' device, copied without waiting for the device (upload.py)."""
    return upload(torch.tensor(values, dtype=dtype or like.dtype), like.device)
