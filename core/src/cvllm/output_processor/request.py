"""One core request's outputs: its n completions, and what the core reports once for the prompt."""

from __future__ import annotations

from cvllm.engine_process.messages import SeqDelta, TokenLogprobs
from cvllm.output_processor.completion import CompletionState, CompletionUpdate


class RequestState:
    def __init__(self, choices: list[CompletionState], prompt_token_ids: list[int], prompt: str | None = None):
        self.choices = choices             # by the core's completion index (0 .. n-1)
        self.prompt_token_ids = prompt_token_ids
        self.prompt = prompt
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.num_cached_tokens = 0         # prefix-cache hits of the prompt, as the core reported them

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return all(choice.finish_reason is not None for choice in self.choices)

    def note_prompt(self, delta: SeqDelta) -> None:
        """What a completion's first delta says about the prompt; completion 0 speaks for it (counted once)."""
        if delta.prompt_logprobs is None and not delta.num_cached_tokens:
            return   # every later delta: nothing about the prompt
        if delta.prompt_logprobs is not None and (self.prompt_logprobs is None or delta.index == 0):
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.num_cached_tokens and delta.index == 0:
            self.num_cached_tokens = delta.num_cached_tokens

    def apply(self, deltas: list[SeqDelta]) -> list[tuple[CompletionState, CompletionUpdate]]:
        """All deltas that arrived since the last call, as one streamed update per completion (see
        ``CompletionState.add``)."""
        if len(deltas) == 1:   # the usual case, a stream that keeps up: one delta, one completion
            delta = deltas[0]
            self.note_prompt(delta)
            update = None
            if 0 <= delta.index < len(self.choices):
                update = self.choices[delta.index].add(delta)
            if delta.token_ids:
                self.on_tokens(len(delta.token_ids))
            return [] if update is None else [(self.choices[delta.index], update)]
        by_choice: dict[int, list[SeqDelta]] = {}
        new_tokens = 0
        for delta in deltas:
            self.note_prompt(delta)
            new_tokens += len(delta.token_ids)
            if 0 <= delta.index < len(self.choices):
                by_choice.setdefault(delta.index, []).append(delta)
        out = []
        for index, group in by_choice.items():
            choice = self.choices[index]
            update = choice.add(*group)
            if update is not None:
                out.append((choice, update))
        if new_tokens:
            self.on_tokens(new_tokens)
        return out

    def on_tokens(self, count: int) -> None:
        """Called with the number of new tokens the core sent (a front-end's timings and metrics hook in here)."""
