"""One completion (an OpenAI "choice") built from the core's deltas: token ids, logprobs, text, finish reason.

Text is detokenized incrementally; stop strings are found across token boundaries. Streamed, the last
``len(longest stop) - 1`` characters are held back while the completion runs, because they could be the start
of a stop string that the next token completes. The token that ends a completion in the core with "stop" (an
EOS or a ``stop_token_ids`` token) is kept in the token ids but is not text, unless
``include_stop_str_in_output`` (vLLM's rule, for the offline API and the server alike).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cvllm.detokenizer import IncrementalDetokenizer
from cvllm.engine_process.messages import SeqDelta, TokenLogprobs
from cvllm.sampling_params import SamplingParams


@dataclass(slots=True)
class CompletionUpdate:
    """What one or more deltas added to a streamed completion."""
    text: str = ""
    # the new tokens of the text, each with its logprobs; filled only when logprobs were asked for
    logprobs: list[tuple[int, TokenLogprobs]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)   # the new tokens of the text
    finish_reason: str | None = None       # set on the update that finishes the completion


class CompletionState:
    def __init__(self, index: int, tokenizer, params: SamplingParams, *, stream: bool = True):
        """``index``: the completion's index as its caller reports it (the server's response-wide choice index).
        ``stream``: text is wanted as it grows (``add``); without it (the offline API's final-only outputs) text
        is detokenized token by token only where stop strings need it, else decoded once at the end."""
        self.index = index
        self.tokenizer = tokenizer
        self.params = params
        self.detokenizer: IncrementalDetokenizer | None = None
        if tokenizer is not None and (stream or params.stop):
            self.detokenizer = IncrementalDetokenizer(tokenizer, list(params.stop), params.skip_special_tokens,
                                                      params.include_stop_str_in_output)
        self.hold_back = max(0, self.detokenizer.longest_stop - 1) if self.detokenizer is not None else 0
        self.emitted = 0                   # characters of the text already handed out (streaming)
        self.token_ids: list[int] = []     # every generated token taken, the core's final stop token included
        # every token's logprobs, for final-only outputs (a stream hands them out in its updates instead)
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None and not stream else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.ended_in_core = False         # the core sent this completion's last token
        self._last_token_is_text = True    # False when the core's final stop token is left out of the text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        """Generated tokens taken (usage's completion_tokens): up to the one that completed a stop string."""
        return len(self.token_ids)

    @property
    def text(self) -> str:
        if self.detokenizer is not None:
            return self.detokenizer.text
        if self.tokenizer is None:
            return ""
        ids = self.token_ids if self._last_token_is_text else self.token_ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def add(self, *deltas: SeqDelta) -> CompletionUpdate | None:
        """Take this completion's deltas, in order, as one streamed update; None once it has finished (a stop
        string matched). Several deltas are queued when a stream fell behind the core: one update for all of
        them lets the reply send one chunk for several tokens instead of one chunk (and one socket write) per
        token, so a stream that lags catches up rather than falling further behind."""
        if self.finish_reason is not None:
            return None
        update = CompletionUpdate()
        for delta in deltas:
            if self.finish_reason is not None:
                break   # a stop string matched in an earlier delta: the rest is past the end
            self.take(delta, update)
        update.text = self._release()
        update.finish_reason = self.finish_reason
        return update

    def take(self, delta: SeqDelta, update: CompletionUpdate | None = None) -> None:
        """Take one delta of an unfinished completion; what it adds to the stream goes into ``update`` (none for
        final-only outputs)."""
        ids = delta.token_ids
        finish_reason = delta.finish_reason
        taken = total = len(ids)
        # the core ends with "stop" only on an EOS or stop_token_ids token: that token is not text
        in_text = taken - 1 if finish_reason == "stop" and taken and not self.params.include_stop_str_in_output \
            else taken
        detokenizer = self.detokenizer
        if detokenizer is not None:
            for i in range(in_text):
                matched = detokenizer.update(ids[i])
                if matched is not None:
                    self.finish_reason, self.stop_reason = "stop", matched
                    taken = in_text = i + 1   # what follows the stop string is past the end
                    break
        self.token_ids += ids if taken == total else ids[:taken]
        if update is not None:
            update.token_ids += ids if in_text == total else ids[:in_text]
        logprobs = delta.logprobs
        if logprobs is not None:
            if self.logprobs is not None:
                self.logprobs += logprobs if taken == total else logprobs[:taken]
            if update is not None:
                update.logprobs += zip(ids, logprobs) if in_text == total else zip(ids[:in_text], logprobs[:in_text])
        if finish_reason is not None:
            self.ended_in_core = True
            if self.finish_reason is None:
                self.finish_reason, self.stop_reason = finish_reason, delta.stop_reason
                self._last_token_is_text = in_text == taken

    def _release(self) -> str:
        text = self.detokenizer.text if self.detokenizer is not None else ""
        end = len(text) if self.finish_reason is not None else max(self.emitted, len(text) - self.hold_back)
        piece, self.emitted = text[self.emitted:end], end
        return piece
