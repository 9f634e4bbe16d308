"""The offline API and the server turn the core's tokens into text through the same output processor: for the same
token stream (a tiny Llama's greedy output, played back to the server's app) they cut the same text at a stop string
and leave out the same stop token, and the offline API tells its engine to stop what a stop string ended."""

from __future__ import annotations

import pytest

from cvllm import LLM, SamplingParams
from cvllm.output_processor import CompletionState
from cvllm.testing import make_checkpoint
from cvllm.testing.fakes import FakeClient, call, make_state, sse_chunks

PROMPT = "once upon a time"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path = tmp_path_factory.mktemp("one-path-llama")
    make_checkpoint(path, "llama", seed=3)
    return LLM(model=str(path), dtype="float32", num_kv_blocks=64)


@pytest.fixture(scope="module")
def free(llm) -> list[int]:
    """The greedy continuation with nothing stopping it."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate(PROMPT, params)[0].outputs[0].token_ids


def spanning_stop(tokenizer, ids: list[int]) -> str:
    """Two characters around a token boundary, the first time they occur in the text: a stop string that no single
    token completes."""
    text = tokenizer.decode(ids)
    ends = [len(tokenizer.decode(ids[:i + 1])) for i in range(len(ids))]
    for before, end, after in zip([0, *ends], ends, ends[1:]):
        stop = text[end - 1:end + 1]
        if end - before >= 1 and after - end >= 1 and text.index(stop) == end - 1 and stop.strip():
            return stop
    raise AssertionError(f"no two-token stop string in {text!r}")


def server_completion(tokenizer, tokens: list[int], body: dict, finish: str = "length") -> tuple[str, str, int]:
    """(text, finish_reason, completion_tokens) of /v1/completions fed ``tokens`` as the core's, checked to be the
    same streamed and whole."""
    body = {"prompt": "x", "max_tokens": MAX_TOKENS, **body}
    whole = call(make_state(tokenizer, FakeClient([tokens], finish=finish)), "POST", "/v1/completions", body).json()
    chunks = sse_chunks(call(make_state(tokenizer, FakeClient([tokens], finish=finish)), "POST", "/v1/completions",
                             {**body, "stream": True, "stream_options": {"include_usage": True}}))
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    finished = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    choice = whole["choices"][0]
    assert streamed == choice["text"] and finished == [choice["finish_reason"]]
    assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    return choice["text"], choice["finish_reason"], whole["usage"]["completion_tokens"]


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_ends_the_same_text_offline_and_in_the_server(llm, free, include, monkeypatch):
    tokenizer = llm.get_tokenizer()
    stop = spanning_stop(tokenizer, free)
    taken = {"offline": 0, "server": 0}
    take = CompletionState.take

    def counted(self, delta, update=None):
        taken["server" if update is not None else "offline"] += 1   # the server streams; the offline API does not
        return take(self, delta, update)

    monkeypatch.setattr(CompletionState, "take", counted)
    fields = {"stop": [stop], "include_stop_str_in_output": include}
    offline = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                  **fields))[0].outputs[0]
    text = tokenizer.decode(free)
    assert offline.text == text[:text.index(stop) + (len(stop) if include else 0)]
    assert (offline.finish_reason, offline.stop_reason) == ("stop", stop)
    assert server_completion(tokenizer, free, fields) == (offline.text, "stop", len(offline.token_ids))
    assert taken["offline"] > 0 and taken["server"] > 0


def test_the_cores_stop_token_is_left_out_of_the_text_by_both(llm, free):
    tokenizer = llm.get_tokenizer()
    # a visible token, first seen after a text that ends with a whole character (an incomplete one is held back
    # by a stream, and shows as U+FFFD when a finished output is decoded whole)
    stop_at = next(i for i, token in enumerate(free) if i >= 3 and token not in free[:i]
                   and tokenizer.decode([token]).strip() and not tokenizer.decode(free[:i]).endswith("\ufffd"))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[free[stop_at]])
    offline = llm.generate(PROMPT, params)[0].outputs[0]
    assert offline.token_ids == free[:stop_at + 1] and offline.stop_reason == free[stop_at]
    assert offline.text == tokenizer.decode(free[:stop_at])
    assert server_completion(tokenizer, free[:stop_at + 1], {"stop_token_ids": [free[stop_at]]}, finish="stop") \
        == (offline.text, "stop", stop_at + 1)


def test_what_a_stop_string_ended_stops_generating_in_the_engine(llm, free):
    """Offline, each completion a stop string ended is stopped in the engine at once, not generated to the end."""
    stop = spanning_stop(llm.get_tokenizer(), free)
    stats = llm.llm_engine.stats
    before = stats.generated_tokens
    outputs = llm.generate(PROMPT, SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                  stop=[stop]))[0].outputs
    assert [c.finish_reason for c in outputs] == ["stop", "stop"]
    kept = sum(len(c.token_ids) for c in outputs)
    assert kept < 2 * MAX_TOKENS and stats.generated_tokens - before <= kept + 2   # at most one token in flight each
    assert not llm.llm_engine.requests and not llm.output_processor.requests


def test_the_in_process_client_stops_one_completion_and_lets_its_sibling_run(llm):
    client = llm.engine_client
    client.add_request("pair", [5, 6, 7], SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True))
    got: dict[int, list[int]] = {0: [], 1: []}
    finish: dict[int, str | None] = {}
    aborted = False
    while client.has_unfinished():
        for delta in client.step().deltas:
            got[delta.index] += delta.token_ids
            finish[delta.index] = delta.finish_reason
        if got[0] and not aborted:
            client.abort("pair", [0])
            aborted = True
    assert len(got[0]) == 1 and finish[0] is None   # nothing more came for it, not even a finish
    assert len(got[1]) == 8 and finish[1] == "length"
    assert "pair" not in llm.llm_engine.requests   # released once both ended
