"""What candle-vllm's clients rely on, through the real app with a scripted engine: any ``model`` name means the
served model (unless --strict-model-name), and ``usage`` carries cached and reasoning tokens and candle-vllm's
prefill/decode timings, alike in both endpoints, streamed or not."""

from __future__ import annotations

import asyncio

import pytest

from cvllm.testing.fakes import HI, FakeClient, FakeStream, call, make_state, sse_chunks

STEP_S = 0.005   # each scripted engine step takes this long, so the timings have something to measure
CACHED = 32


class SlowStream(FakeStream):
    async def __anext__(self):
        await asyncio.sleep(STEP_S)
        return await super().__anext__()


class CachingClient(FakeClient):
    """FakeClient whose steps take STEP_S and whose first delta of choice 0 reports CACHED prefix-cache hits, as
    the engine core reports them."""

    def add_request(self, request_id, prompt_ids, params):
        stream = super().add_request(request_id, prompt_ids, params)
        stream.batches[0][0].num_cached_tokens = CACHED
        self.streams[-1] = slow = SlowStream(list(stream.batches), stream.fail)
        return slow


def post(tokenizer, path: str, body: dict, outputs: list[list[int]], stream: bool, strict: bool = False,
         reasoning_parser: str | None = None) -> tuple[int, dict]:
    """(status, usage-bearing body: the response, or the last chunk of the stream)."""
    state = make_state(tokenizer, CachingClient(outputs), reasoning_parser=reasoning_parser)
    state.args.strict_model_name = strict
    prompt = {"messages": HI} if "chat" in path else {"prompt": "x"}
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    response = call(state, "POST", path, {**prompt, "max_tokens": 50, **body, **extra})
    if response.status_code != 200:
        return response.status_code, response.json()
    return 200, sse_chunks(response)[-1] if stream else response.json()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("name", ["", "any", "gpt-4o"])
def test_any_model_name_means_the_served_model(tokenizer, path, stream, name):
    status, body = post(tokenizer, path, {"model": name}, [[5, 6]], stream)
    assert (status, body["model"]) == (200, "fake")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
def test_strict_model_name_refuses_unknown_names(tokenizer, path):
    status, body = post(tokenizer, path, {"model": "any"}, [[5, 6]], stream=False, strict=True)
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert post(tokenizer, path, {"model": "fake"}, [[5, 6]], stream=False, strict=True)[0] == 200


def test_models_lookup_knows_only_served_names(tokenizer):
    state = make_state(tokenizer, FakeClient([[5]]))
    assert call(state, "GET", "/v1/models/fake").status_code == 200
    assert call(state, "GET", "/v1/models/any").status_code == 404


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_usage_has_cached_tokens_and_timings(tokenizer, path, stream):
    tokens = tokenizer.encode("Hello world, hello again!", add_special_tokens=False)
    status, body = post(tokenizer, path, {}, [tokens], stream)
    usage = body["usage"]
    assert status == 200 and usage["completion_tokens"] == len(tokens) > 3
    assert usage["prompt_tokens_details"] == {"cached_tokens": CACHED}
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 0}
    # whole ms, as candle-vllm's: the first step before the first token, the other steps before the last
    assert isinstance(usage["prompt_time_costs"], int) and usage["prompt_time_costs"] >= STEP_S * 1000 - 1
    assert isinstance(usage["completion_time_costs"], int)
    assert usage["completion_time_costs"] >= (len(tokens) - 1) * STEP_S * 1000 - 1


def test_cached_tokens_of_several_prompts_add_up(tokenizer):
    status, body = post(tokenizer, "/v1/completions", {"prompt": ["a", "b", "c"]}, [[5, 6]], stream=False)
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 3 * CACHED}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_reasoning_tokens_count_the_thinking_text(tokenizer, stream):
    output = tokenizer.encode("<think>Let me see, two and two.</think>Four.", add_special_tokens=False)
    status, body = post(tokenizer, "/v1/chat/completions", {"n": 2}, [output, output], stream,
                        reasoning_parser="think")
    thinking = len(tokenizer.encode("Let me see, two and two.", add_special_tokens=False))
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2 * thinking}   # both choices
    if not stream:
        assert body["choices"][0]["message"]["reasoning_content"] == "Let me see, two and two."
