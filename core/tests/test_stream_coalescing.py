"""A stream that fell behind the core: the deltas queued for it go out as one SSE chunk (one write), with the
same text, usage, finish reason and logprobs as when each token has its own chunk."""

from __future__ import annotations

import pytest

from cvllm.server.output import TextChunks, sse
from cvllm.server.protocol import (
    ChatCompletionChunk,
    ChatDelta,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    encode,
)
from cvllm.testing.fakes import HI, FakeClient, call, make_state, sse_chunks

TEXT = "Hello world, hello again! Café 日本語 🙂 ok"


class LaggingClient(FakeClient):
    """FakeClient whose streams hand out ``lag`` steps' deltas at once, as a stream that fell behind gets them."""

    def __init__(self, outputs, lag: int, **kwargs):
        super().__init__(outputs, **kwargs)
        self.lag = lag

    def add_request(self, request_id, prompt_ids, params):
        stream = super().add_request(request_id, prompt_ids, params)
        steps = list(stream.batches)
        stream.batches.clear()
        for i in range(0, len(steps), self.lag):
            stream.batches.append([delta for step in steps[i:i + self.lag] for delta in step])
        return stream


def stream_both(tokenizer, outputs, path: str, body: dict, lag: int) -> tuple[list[dict], list[dict]]:
    """The SSE chunks of the same request with one step per wakeup and with ``lag`` steps per wakeup."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    prompt = {"messages": HI} if "chat" in path else {"prompt": "x"}
    return [sse_chunks(call(make_state(tokenizer, client), "POST", path, {**prompt, **body}))
            for client in (FakeClient(outputs), LaggingClient(outputs, lag))]


def counts(chunks: list[dict]) -> dict:
    """The last chunk's usage without candle-vllm's timings, which are wall-clock and so differ run to run."""
    return {k: v for k, v in chunks[-1]["usage"].items() if not k.endswith("_time_costs")}


def text_of(chunks: list[dict], index: int = 0) -> str:
    return "".join(c["choices"][0].get("text", c["choices"][0].get("delta", {}).get("content", ""))
                   for c in chunks if c["choices"] and c["choices"][0]["index"] == index)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_lagging_stream_sends_one_chunk_per_wakeup_with_the_same_text(tokenizer, path):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    steady, lagging = stream_both(tokenizer, [ids], path, {"max_tokens": len(ids)}, lag=4)
    assert text_of(steady) == text_of(lagging) == TEXT
    has_text = [c for c in lagging if c["choices"] and (c["choices"][0].get("text")
                                                        or c["choices"][0].get("delta", {}).get("content"))]
    assert len(has_text) <= -(-len(ids) // 4) < len(ids)   # at most one text chunk per wakeup
    assert counts(steady) == counts(lagging) and lagging[-1]["usage"]["completion_tokens"] == len(ids)
    assert [c["choices"][0]["finish_reason"] for c in lagging if c["choices"]][-1] == "length"
    assert len({c["id"] for c in lagging}) == 1


def test_stop_string_inside_a_coalesced_batch(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    body = {"stop": ["lo ag"], "max_tokens": len(ids)}
    for lag in (3, len(ids)):   # the stop string inside one batch, or everything in a single batch
        steady, lagging = stream_both(tokenizer, [ids], "/v1/completions", body, lag=lag)
        assert text_of(steady) == text_of(lagging) == "Hello world, hel"
        assert lagging[-2]["choices"][0]["finish_reason"] == "stop"
        assert counts(steady) == counts(lagging)


def test_n_choices_interleaved_in_one_batch(tokenizer):
    a = tokenizer.encode("stop here now", add_special_tokens=False)
    b = tokenizer.encode("keeps on going far", add_special_tokens=False)
    body = {"n": 2, "stop": " here", "max_tokens": 20}
    steady, lagging = stream_both(tokenizer, [a, b], "/v1/completions", body, lag=5)
    for i in (0, 1):
        assert text_of(steady, i) == text_of(lagging, i)
    assert text_of(lagging, 0) == "stop" and text_of(lagging, 1) == "keeps on going far"
    assert counts(steady) == counts(lagging)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_coalesced_logprobs_cover_every_token(tokenizer, path):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    body = {"logprobs": 2, "max_tokens": len(ids)} if "chat" not in path else \
        {"logprobs": True, "top_logprobs": 1, "max_tokens": len(ids)}
    steady, lagging = stream_both(tokenizer, [ids], path, body, lag=4)

    def entries(chunks):
        out = []
        for c in chunks:
            lp = c["choices"][0]["logprobs"] if c["choices"] else None
            if lp:
                out.extend(lp["content"] if "content" in lp else zip(lp["tokens"], lp["token_logprobs"]))
        return [tuple(e.items()) if isinstance(e, dict) else e for e in out]

    assert entries(steady) == entries(lagging) and len(entries(lagging)) == len(ids)


def test_text_chunk_template_is_the_encoded_struct():
    def completion(index, text):
        return CompletionChunk(id="cmpl-1", created=7, model='m"odel', choices=[
            CompletionChoice(index=index, text=text, logprobs=None, finish_reason=None)])

    def chat(index, text):
        return ChatCompletionChunk(id="chatcmpl-1", created=7, model="m", choices=[
            ChatStreamChoice(index=index, delta=ChatDelta(content=text))])

    for make in (completion, chat):
        chunks = TextChunks(make)
        for index in (0, 3):
            for text in ("plain", 'quo"te\\ and\nnewline', "Café 日本語 🙂", "\x00"):
                assert chunks(index, text) == sse(encode(make(index, text)))
    def marked(index, text):   # the marker in the model name as well: the struct is encoded as it is
        return CompletionChunk(id="c", created=1, model=TextChunks._MARK,
                               choices=[CompletionChoice(index=index, text=text, logprobs=None, finish_reason=None)])

    assert TextChunks(marked)(0, "x") == sse(encode(marked(0, "x")))
