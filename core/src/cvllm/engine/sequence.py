"""A sequence: one completion being generated (a request with n > 1 has n of them)."""

from __future__ import annotations

import array
from enum import Enum, auto
from typing import Any


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    __slots__ = ("seq_id", "request_id", "index", "token_ids", "num_prompt_tokens", "sampling_params",
                 "status", "num_computed_tokens", "num_hashed_blocks", "block_table", "generator",
                 "min_tokens_stop_ids", "finish_reason", "stop_reason", "logprobs", "prompt_logprobs", "arrival",
                 "num_inflight", "num_cached_tokens", "grammar", "num_drafts", "spec_proposed", "spec_accepted",
                 "spec_rejected", "spec_rejections", "spec_stopped_at", "spec_guess_rates", "ngram_bytes")

    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int], sampling_params: Any,
                 index: int = 0, arrival: float = 0.0):
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index                       # which of the request's n completions
        self.token_ids = list(prompt_token_ids)  # prompt, then generated tokens (those read back to the host)
        # tokens sampled by a launched step but not read back yet (async scheduling): they count for
        # scheduling (num_tokens) but are not in token_ids
        self.num_inflight = 0
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0             # tokens whose K/V are in the cache
        self.num_hashed_blocks = 0               # leading full blocks registered for prefix caching
        # prompt tokens found in the prefix cache when first scheduled (usage's cached_tokens); a preempted
        # sequence's later hits are its own recomputation, not the client's saving
        self.num_cached_tokens: int | None = None
        # int32 block ids, as the block-table tensor wants them: the runner copies whole rows (a memcpy
        # each, where a list's Python ints would be converted one by one every step)
        self.block_table = array.array("i")
        self.generator = None                    # torch.Generator for seeded requests (set by the engine)
        self.min_tokens_stop_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[Any] | None = None
        # per prompt position (None at 0), filled while the prompt is computed; set by the engine when asked
        self.prompt_logprobs: list[Any] | None = None
        self.arrival = arrival
        self.grammar = None                      # its structured-output matcher (structured_output/grammar.py)
        # speculative decoding (engine/speculative.py): draft tokens at the end of token_ids this step, and the
        # drafts proposed and accepted so far (its acceptance rate)
        self.num_drafts = 0
        self.spec_proposed = 0
        self.spec_accepted = 0
        self.spec_rejected = False               # its last verify step rejected a draft
        self.spec_rejections = 0                 # verify steps that rejected one of its drafts
        # its length when min_acceptance_rate stopped its drafts (speculative.REPROBE_TOKENS later it tries again)
        self.spec_stopped_at: int | None = None
        # how often the async guess of its in-flight step's outcome holds, recent steps weighing most, after a step
        # without drafts and after a verify step (speculator.py)
        self.spec_guess_rates = [1.0, 1.0]
        # its leading verified tokens as int64 bytes, for n-gram lookups (speculator.py), extended as they grow: the
        # lookup searches bytes, and converting the whole token list each step would cost more than the search
        self.ngram_bytes = bytearray()

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table.tolist()})")

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence so far, including any still on the device."""
        return len(self.token_ids) + self.num_inflight

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Still needs logits at prompt positions (so it must compute them: no prefix-cache hits)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def resume(self, output_token_ids: list[int]) -> None:
        """Continue from what an engine core that died had generated (server/supervisor.py): the tokens are output,
        so they count for penalties, min_tokens, max_tokens and usage, and the first step recomputes their K/V as it
        does for a preempted sequence. Their logprobs and the prompt's were reported already (placeholders keep
        ``logprobs`` indexed by output position)."""
        if not output_token_ids:
            return
        self.token_ids += output_token_ids
        if self.logprobs is not None:
            self.logprobs = [None] * len(output_token_ids)
        self.prompt_logprobs = None

    def replay_grammar(self) -> bool:
        """Advance a new grammar matcher over the output a resumed sequence already holds, token by token as if it
        were being generated; False if the grammar refuses one."""
        outputs = self.token_ids[self.num_prompt_tokens:]
        del self.token_ids[self.num_prompt_tokens:]
        for token in outputs:
            self.token_ids.append(token)
            if not self.grammar.accept(token, self):
                self.token_ids += outputs[len(self.token_ids) - self.num_prompt_tokens:]
                return False
        return True
