"""The server's text pipeline without a model: a scripted engine-core client feeds known tokens through the
real app (httpx's ASGI transport), so stop strings, hold-back, reasoning tags split across tokens, logprob
bytes, n > 1 and engine failures are checked exactly."""

from __future__ import annotations

import random

import pytest

from cvllm.engine_process.client import EngineDeadError, RequestError
from cvllm.engine_process.messages import SeqDelta
from cvllm.sampling_params import SamplingParams
from cvllm.server.output import ChoiceState
from cvllm.server.reasoning import ThinkParser
from cvllm.testing import CHATML_TEMPLATE, EOS_TOKEN_ID, write_tiny_tokenizer
from cvllm.testing.fakes import HI, FakeClient, call, make_state, sse_chunks
from cvllm.tokenizer import Tokenizer

THINK_TEMPLATE = CHATML_TEMPLATE.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tokenizer")
    write_tiny_tokenizer(path)
    return Tokenizer.from_dir(path)


def one_token_each(tokenizer: Tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    return ids


# -- detokenization, stop strings, hold-back ---------------------------------------------------------


def feed(tokenizer, ids: list[int], params: SamplingParams, finish: str = "length") -> tuple[list[str], ChoiceState]:
    choice = ChoiceState(0, tokenizer, params)
    pieces = []
    for i, token in enumerate(ids):
        update = choice.add(SeqDelta("r", 0, [token], None, finish if i == len(ids) - 1 else None))
        if update is None:
            break
        pieces.append(update.text)
    return pieces, choice


@pytest.mark.parametrize("stop", ["o wor", "world", "ld, h", "!"])
def test_stop_strings_across_tokens_never_emit_what_is_cut(tokenizer, stop):
    text = "Hello world, hello again!"
    ids = one_token_each(tokenizer, text)
    pieces, choice = feed(tokenizer, ids, SamplingParams(stop=[stop, "never there"]))
    emitted = ""
    for piece in pieces:
        emitted += piece
        assert stop not in emitted and text.startswith(emitted)   # nothing emitted is ever taken back
    assert emitted == choice.text == text[: text.index(stop)]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    kept, _ = feed(tokenizer, ids, SamplingParams(stop=[stop], include_stop_str_in_output=True))
    assert "".join(kept) == text[: text.index(stop) + len(stop)]


def test_hold_back_is_released_at_the_end(tokenizer):
    text = "the quick brown fox"
    pieces, choice = feed(tokenizer, one_token_each(tokenizer, text), SamplingParams(stop=["xyzzy"]))
    assert "".join(pieces) == text and choice.finish_reason == "length"
    assert len("".join(pieces[:-1])) <= len(text) - len("xyzzy") + 1   # the tail waited for the end


def test_eos_that_ends_the_request_is_not_text(tokenizer):
    ids = [*one_token_each(tokenizer, "done"), EOS_TOKEN_ID]
    pieces, choice = feed(tokenizer, ids, SamplingParams(skip_special_tokens=False), finish="stop")
    assert "".join(pieces) == "done" and choice.num_tokens == len(ids)


# -- through the app ----------------------------------------------------------------------------------


def test_streaming_and_non_streaming_agree_on_stops(tokenizer):
    text = "Hello world, hello again!"
    client = FakeClient([one_token_each(tokenizer, text)])
    state = make_state(tokenizer, client)
    body = {"messages": HI, "stop": ["lo ag"]}
    whole = call(state, "POST", "/v1/chat/completions", body).json()
    chunks = sse_chunks(call(state, "POST", "/v1/chat/completions", {**body, "stream": True}))
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert whole["choices"][0]["message"]["content"] == streamed == "Hello world, hel"
    assert whole["choices"][0]["finish_reason"] == chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(s.aborts == 1 for s in client.streams)   # the core is told to stop generating
    assert client.prompts[0] == tokenizer.encode(
        tokenizer.apply_chat_template(HI, add_generation_prompt=True), add_special_tokens=False)


def test_n_choices_finish_separately(tokenizer):
    a, b = one_token_each(tokenizer, "stop here now"), one_token_each(tokenizer, "keeps on going far")
    client = FakeClient([a, b])
    state = make_state(tokenizer, client)
    out = call(state, "POST", "/v1/completions", {"prompt": "x", "n": 2, "stop": " here", "max_tokens": 20}).json()
    texts = {c["index"]: (c["text"], c["finish_reason"]) for c in out["choices"]}
    assert texts == {0: ("stop", "stop"), 1: ("keeps on going far", "length")}
    _, stopped = feed(tokenizer, a, SamplingParams(stop=[" here"]))
    assert stopped.num_tokens < len(a)
    assert out["usage"]["completion_tokens"] == stopped.num_tokens + len(b)
    chunks = sse_chunks(call(state, "POST", "/v1/completions",
                             {"prompt": "x", "n": 2, "stop": " here", "max_tokens": 20, "stream": True}))
    finished = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks
                if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [(0, "stop"), (1, "length")]
    for i in (0, 1):
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) == texts[i][0]


def test_logprob_bytes_concatenate_to_the_content(tokenizer):
    text = "Café 日本語 🙂 ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any(not tokenizer.token_bytes(t).decode("utf-8", errors="ignore") for t in ids)  # split characters
    state = make_state(tokenizer, FakeClient([ids]))
    for stream in (False, True):
        response = call(state, "POST", "/v1/chat/completions", {"messages": HI, "logprobs": True, "stream": stream})
        if stream:
            chunks = sse_chunks(response)
            entries = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                       for e in c["choices"][0]["logprobs"]["content"]]
            content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        else:
            choice = response.json()["choices"][0]
            entries, content = choice["logprobs"]["content"], choice["message"]["content"]
        assert content == text and len(entries) == len(ids)
        assert b"".join(bytes(e["bytes"]) for e in entries) == text.encode("utf-8")
        assert any(e["token"].startswith("bytes:\\x") for e in entries)
        assert all(e["logprob"] == -0.25 and e["top_logprobs"] == [] for e in entries)


@pytest.mark.parametrize("template,output,reasoning,content", [
    (CHATML_TEMPLATE.replace("{{ '<|im_start|>assistant\\n' }}", "{{ '<|im_start|>assistant\\n' }}{# <think> #}"),
     "<think>Let me see, 2+2.</think>\n\nIt is 4.", "Let me see, 2+2.", "It is 4."),
    (THINK_TEMPLATE, "Let me see, 2+2.\n</think>\n\nIt is 4.", "Let me see, 2+2.\n", "It is 4."),
    (THINK_TEMPLATE, "<think>Let me see</think>It is 4.", "Let me see", "It is 4."),
    (CHATML_TEMPLATE.replace("{{ '<|im_start|>assistant\\n' }}", "{{ '<|im_start|>assistant\\n' }}{# <think> #}"),
     "No thinking today.", None, "No thinking today."),
])
def test_reasoning_split_streaming_and_not(tokenizer, template, output, reasoning, content):
    ids = tokenizer.encode(output, add_special_tokens=False)
    state = make_state(tokenizer, FakeClient([ids]), template=template)
    assert state.reasoning_parser == ("deepseek_r1" if template == THINK_TEMPLATE else "think")
    message = call(state, "POST", "/v1/chat/completions", {"messages": HI}).json()["choices"][0]["message"]
    assert message.get("reasoning_content") == reasoning and message.get("reasoning") == reasoning
    assert message["content"] == content
    chunks = sse_chunks(call(state, "POST", "/v1/chat/completions", {"messages": HI, "stream": True}))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[-1] == {}
    assert all(d.get("content") != "" for d in deltas[1:])
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (reasoning or "")
    assert "".join(d.get("content", "") for d in deltas) == content


def test_think_parser_with_random_splits():
    rng = random.Random(0)
    cases = [("<think>\nhmm</think>\n\nThe answer.", False, "\nhmm", "The answer."),
             ("  plain text with </think> inside", False, "", "  plain text with </think> inside"),
             ("reasoning only, cut off <", True, "reasoning only, cut off <", ""),
             ("<thin", False, "", "<thin")]
    for text, opened, reasoning, content in cases:
        for _ in range(30):
            parser, got_r, got_c, i = ThinkParser(opened), [], [], 0
            while i < len(text):
                n = rng.randint(1, 4)
                r, c = parser.feed(text[i:i + n])
                got_r.append(r)
                got_c.append(c)
                i += n
            r, c = parser.finish()
            assert ("".join(got_r) + r, "".join(got_c) + c) == (reasoning, content)


# -- failures -----------------------------------------------------------------------------------------


def test_engine_failure_mid_stream_and_before(tokenizer):
    ids = one_token_each(tokenizer, "partial output here")
    state = make_state(tokenizer, FakeClient([ids], finish=None, fail=RequestError("the model raised")))
    chunks = sse_chunks(call(state, "POST", "/v1/chat/completions", {"messages": HI, "stream": True}))
    assert chunks[-1]["error"]["type"] == "server_error" and "the model raised" in chunks[-1]["error"]["message"]
    whole = call(state, "POST", "/v1/chat/completions", {"messages": HI})
    assert whole.status_code == 500 and "the model raised" in whole.json()["error"]["message"]
    rejected = make_state(tokenizer, FakeClient([ids], finish=None, fail=RequestError("bad params", True)))
    assert call(rejected, "POST", "/v1/completions", {"prompt": "x"}).status_code == 400
    dead = make_state(tokenizer, FakeClient([ids], finish=None, fail=EngineDeadError("device lost")))
    assert call(dead, "POST", "/v1/completions", {"prompt": "x"}).status_code == 503


def test_not_ready_and_dead_engine_are_503(tokenizer):
    loading = make_state(tokenizer, None)
    assert call(loading, "GET", "/health").status_code == 503
    response = call(loading, "POST", "/v1/chat/completions", {"messages": HI})
    assert response.status_code == 503 and response.json()["error"]["code"] == "service_unavailable"
    client = FakeClient([[5]])
    client.dead = "the engine core exited unexpectedly"
    dead = make_state(tokenizer, client)
    assert call(dead, "GET", "/health").status_code == 503
    assert "exited unexpectedly" in call(dead, "GET", "/v1/models").json()["error"]["message"]
    assert call(dead, "GET", "/metrics").status_code == 200


# -- what reaches the chat template ------------------------------------------------------------------

PROBE_TEMPLATE = (
    "{% if tools %}TOOLS={% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% if enable_thinking is defined %}THINKING={{ enable_thinking }}\n{% endif %}" + CHATML_TEMPLATE)


def rendered_prompt(tokenizer, body: dict) -> str:
    client = FakeClient([[5]])
    response = call(make_state(tokenizer, client, template=PROBE_TEMPLATE), "POST", "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    return tokenizer.decode(client.prompts[0], skip_special_tokens=False)


def test_template_inputs(tokenizer):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "get_time"}}]
    for choice in (None, "auto", "none"):
        prompt = rendered_prompt(tokenizer, {"messages": HI, "tools": tools, "tool_choice": choice})
        assert prompt.startswith("TOOLS=get_weather;get_time;<|im_start|>user")
    assert "THINKING=False" in rendered_prompt(tokenizer, {"messages": HI, "thinking": False})
    assert "THINKING=True" in rendered_prompt(tokenizer, {"messages": HI, "enable_thinking": True})
    assert "THINKING=False" in rendered_prompt(tokenizer, {"messages": HI,
                                                           "chat_template_kwargs": {"enable_thinking": False}})
    assert "THINKING" not in rendered_prompt(tokenizer, {"messages": HI})
    developer = rendered_prompt(tokenizer, {"messages": [{"role": "developer", "content": "rules"}, *HI]})
    assert "<|im_start|>system\nrules<|im_end|>" in developer
    parts = rendered_prompt(tokenizer, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]})
    assert "<|im_start|>user\none\ntwo<|im_end|>" in parts
    continued = rendered_prompt(tokenizer, {"messages": [*HI, {"role": "assistant", "content": "Once upon"}],
                                            "continue_final_message": True})
    assert continued.endswith("<|im_start|>assistant\nOnce upon")


def test_unexpected_failure_is_a_500_with_an_id_and_the_traceback_only_in_the_log(tokenizer, caplog):
    class BrokenClient(FakeClient):
        def add_request(self, *args):
            raise KeyError("internal detail")

    state = make_state(tokenizer, BrokenClient([[5]]))
    with caplog.at_level("ERROR", logger="cvllm.server"):
        response = call(state, "POST", "/v1/completions", {"prompt": "x"})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "internal detail" not in error["message"]
    error_id = error["message"].rsplit("error id ", 1)[1].rstrip(").")
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert logged and logged[0].exc_info is not None
    assert call(state, "GET", "/health").status_code == 200   # and it keeps serving


def test_sampling_defaults_precedence(tokenizer):
    client = FakeClient([[5, 6, 7]])
    state = make_state(tokenizer, client)
    state.args.default_sampling = {"temperature": 0.7, "max_tokens": 2}
    state.generation_config = {"temperature": 0.3, "top_k": 5, "repetition_penalty": 1.2}
    state.__post_init__()   # recompute the merged defaults
    call(state, "POST", "/v1/chat/completions", {"messages": HI, "top_p": 0.5})
    call(state, "POST", "/v1/chat/completions", {"messages": HI, "temperature": 0.1, "max_tokens": 3})
    call(state, "POST", "/v1/completions", {"prompt": "x"})
    first, second, third = client.params
    assert (first.temperature, first.top_k, first.top_p, first.repetition_penalty) == (0.7, 5, 0.5, 1.2)
    assert first.max_tokens == 2 and second.max_tokens == 3 and third.max_tokens == 2
    assert second.temperature == 0.1
    plain = FakeClient([[5]])
    call(make_state(tokenizer, plain), "POST", "/v1/completions", {"prompt": "x"})
    call(make_state(tokenizer, plain), "POST", "/v1/chat/completions", {"messages": HI})
    assert plain.params[0].max_tokens == 16 and plain.params[0].temperature == 1.0
    assert plain.params[1].max_tokens == 256 - len(plain.prompts[1])   # chat: the rest of the context


def test_token_bytes_of_sentencepiece_vocabularies():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "<s>": 1, "▁hello": 2, "<0xE6>": 3, "<0x97>": 4, "<0xA5>": 5, "world": 6}
    raw = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = Tokenizer(raw)
    assert [tok.token_bytes(i) for i in (2, 3, 4, 5, 6)] == [b" hello", b"\xe6", b"\x97", b"\xa5", b"world"]
    assert b"".join(tok.token_bytes(i) for i in (3, 4, 5)).decode() == "日"
    assert raw.decode([2, 3, 4, 5, 6]) == " hello日world"
