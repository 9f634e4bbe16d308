"""The offline API's end of the output path: the core's deltas for many requests in, ``RequestOutput``s out.

The server keeps the same ``RequestState`` per HTTP request (server/output.py) and renders OpenAI JSON from
its streamed updates; ``LLM`` returns each request whole once it has ended (final-only, as vLLM's offline API
does), so nothing is handed out while it runs and no text is held back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from cvllm.engine_process.messages import SeqDelta, TokenLogprobs
from cvllm.output_processor.completion import CompletionState
from cvllm.output_processor.request import RequestState
from cvllm.outputs import CompletionOutput, Logprob, RequestOutput
from cvllm.sampling_params import SamplingParams


@dataclass(slots=True)
class ProcessedStep:
    num_finished: int = 0   # completions that ended with this step's deltas (by the core or by a stop string)
    # request id -> completions a stop string ended while the core still generates them: tell the core
    stopped: dict[str, list[int]] = field(default_factory=dict)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        choices = [CompletionState(index, self.tokenizer, params, stream=False) for index in range(params.n)]
        self.requests[request_id] = RequestState(choices, prompt_token_ids, prompt)

    def process(self, deltas: list[SeqDelta]) -> ProcessedStep:
        """One step's deltas (``StepOutputs.deltas``); those of requests this processor does not hold are skipped."""
        step = ProcessedStep()
        requests = self.requests
        for delta in deltas:
            request = requests.get(delta.request_id)
            if request is None:
                continue
            choice = request.choices[delta.index]
            if choice.finish_reason is not None:
                continue   # a stop string ended it; the core has not heard yet
            request.note_prompt(delta)
            choice.take(delta)   # final-only: nothing is streamed
            if choice.finish_reason is not None:
                step.num_finished += 1
                if not choice.ended_in_core:
                    step.stopped.setdefault(delta.request_id, []).append(delta.index)
        return step

    def pop(self, request_id: str) -> RequestOutput:
        """The request's output as it stands, and forget it."""
        return request_output(request_id, self.requests.pop(request_id), self.tokenizer)


def request_output(request_id: str, request: RequestState, tokenizer) -> RequestOutput:
    decoded = token_decoder(tokenizer)
    outputs = []
    for choice in request.choices:
        logprobs = cumulative = None
        if choice.logprobs is not None:
            logprobs = [logprob_entry(entry, token_id, decoded)
                        for entry, token_id in zip(choice.logprobs, choice.token_ids)]
            cumulative = sum(entry.logprob for entry in choice.logprobs)
        outputs.append(CompletionOutput(choice.index, choice.text, choice.token_ids, cumulative, logprobs,
                                        choice.finish_reason, choice.stop_reason))
    prompt_logprobs = None
    if request.prompt_logprobs is not None:
        prompt_logprobs = [None if entry is None else logprob_entry(entry, token_id, decoded)
                           for entry, token_id in zip(request.prompt_logprobs, request.prompt_token_ids)]
    return RequestOutput(request_id, request.prompt, request.prompt_token_ids, outputs, finished=request.finished,
                         prompt_logprobs=prompt_logprobs)


def logprob_entry(logprobs: TokenLogprobs, token_id: int, decoded: Callable[[int], str | None]) -> dict[int, Logprob]:
    """One position's logprobs as the offline API returns them: the top-k by rank, then the chosen token when it
    is not among them (rank None), each with its text."""
    entry = {top_id: Logprob(value, rank, decoded(top_id))
             for rank, (top_id, value) in enumerate(zip(logprobs.top_ids, logprobs.top_logprobs), 1)}
    if token_id not in entry:
        entry[token_id] = Logprob(logprobs.logprob, None, decoded(token_id))
    return entry


def token_decoder(tokenizer) -> Callable[[int], str | None]:
    """A token's text as logprobs show it (special tokens included), each id decoded once; None without a
    tokenizer."""
    cache: dict[int, str | None] = {}

    def decoded(token_id: int) -> str | None:
        text = cache.get(token_id)
        if text is None and tokenizer is not None:
            text = cache[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    return decoded
