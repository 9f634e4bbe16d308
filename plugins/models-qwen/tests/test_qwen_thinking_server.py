"""Thinking through the HTTP server with the Qwen family's real chat templates (tests/data): the prompt the engine
is given (thinking on, off, or opened by the template), and how the answer is split into ``reasoning_content``
/ ``reasoning`` and ``content``, streamed and not.

No model: the server state is opened from a checkpoint folder that holds the template's tokenizer files (the
way ``cvserve`` opens one, so the reasoning parser is the one it would detect), and a scripted engine-core
client (cvllm.testing.fakes) plays back known token ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from cvllm.engine.config import EngineConfig
from cvllm.server.args import ServerArgs
from cvllm.server.state import ServerState
from cvllm.testing.checkpoints import BASE_CONFIG
from cvllm.testing.fakes import HI, FakeClient, call, sse_chunks

QWEN3, QWQ = "qwen3-0.6b", "qwq-32b"
R1, R1_FIRST_RELEASE = "deepseek-r1-distill-qwen-32b", "deepseek-r1-distill-qwen-32b-first-release"

# the prompt each template renders for HI, thinking left at its default
PROMPTS = {
    QWEN3: "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    QWQ: "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n",
    R1: "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>\n",
    R1_FIRST_RELEASE: "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>",
}
QWEN3_NOT_THINKING = PROMPTS[QWEN3] + "<think>\n\n</think>\n\n"

SPLITS = ["tokens", "characters"]   # the tokenizer's own ids (each tag one token), or one token per character


@pytest.fixture(scope="module")
def open_state(chat_tokenizer_dir):
    """``open_state(name, reasoning_parser=None)``: the server's state for a checkpoint that ships the named
    template, opened as ``cvserve`` opens it (no engine client yet: see ``play``)."""
    def open_(name: str, reasoning_parser: str | None = None) -> ServerState:
        path = chat_tokenizer_dir(name)
        # The API process reads only config.json and the tokenizer, but a folder without a weight file is not a
        # checkpoint; the weights are never loaded.
        config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **BASE_CONFIG, "head_dim": 16}
        (path / "config.json").write_text(json.dumps(config))
        save_file({"unused": np.zeros(1, np.float32)}, str(path / "model.safetensors"))
        return ServerState.open(ServerArgs(engine=EngineConfig(model=str(path)), reasoning_parser=reasoning_parser))

    return open_


def play(state: ServerState, text: str, split: str, finish: str = "stop") -> list[int]:
    """Script the engine to answer every request with ``text``: the tokenizer's own ids (``split="tokens"``:
    each tag one token, as in the real vocabularies) or one token per character (the tags arrive in pieces),
    then, when it finishes with "stop", the EOS token that ends it. Returns the ids."""
    tokenizer = state.tokenizer
    if split == "tokens":
        ids = tokenizer.encode(text, add_special_tokens=False)
        for tag in ("<think>", "</think>"):
            assert (tag in text) == (tokenizer.token_to_id(tag) in ids)
    else:
        ids = [i for character in text for i in tokenizer.encode(character, add_special_tokens=False)]
        assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text
    if finish == "stop":
        ids.append(tokenizer.eos_token_id)
    state.client = FakeClient([ids], finish=finish)
    return ids


@dataclass
class Reply:
    message: dict[str, Any]      # the non-streamed choice's message
    finish_reason: str
    streamed_reasoning: str      # the streamed deltas, concatenated
    streamed_content: str
    prompts: list[str]           # what the engine was given, per request (special tokens kept)


def ask(state: ServerState, body: dict[str, Any]) -> Reply:
    """The same request without and with streaming; checks what the two must share and the stream's shape."""
    response = call(state, "POST", "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    chunks = sse_chunks(call(state, "POST", "/v1/chat/completions", {**body, "stream": True}))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[-1] == {}
    assert all(d and d.get("content") != "" for d in deltas[1:-1])   # no empty deltas after the first
    assert all(d.get("reasoning_content") == d.get("reasoning") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    tokenizer = state.tokenizer
    prompts = [tokenizer.decode(ids, skip_special_tokens=False) for ids in state.client.prompts]
    return Reply(choice["message"], choice["finish_reason"], "".join(d.get("reasoning_content", "") for d in deltas),
                 "".join(d.get("content", "") for d in deltas), prompts)


def check_split(reply: Reply, reasoning: str | None, content: str | None) -> None:
    """Exactly this reasoning and content, in both responses; None: the field is absent (reasoning) or null."""
    message = reply.message
    assert message.get("reasoning_content") == reasoning and message.get("reasoning") == reasoning
    assert ("reasoning_content" in message) == (reasoning is not None)
    assert message["content"] == content
    assert reply.streamed_reasoning == (reasoning or "") and reply.streamed_content == (content or "")


@pytest.mark.parametrize(("name", "parser"), [
    (QWEN3, "think"), (QWQ, "deepseek_r1"), (R1, "deepseek_r1"), (R1_FIRST_RELEASE, "think")])
def test_the_server_detects_the_parser_from_the_template(open_state, qwen_chat_templates, name, parser):
    state = open_state(name)
    assert state.chat_template == qwen_chat_templates[name].source   # the template the checkpoint ships
    assert state.reasoning_parser == parser


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("switch", [{}, {"thinking": True}, {"thinking": {"type": "enabled"}},
                                    {"enable_thinking": True}, {"chat_template_kwargs": {"enable_thinking": True}}],
                         ids=["default", "thinking", "thinking-enabled", "enable_thinking", "template-kwargs"])
def test_qwen3_thinks_by_default(open_state, split, switch):
    state = open_state(QWEN3)
    play(state, "<think>\nLet me add.\n</think>\n\n4", split)
    reply = ask(state, {"messages": HI, **switch})
    assert reply.prompts == [PROMPTS[QWEN3]] * 2
    assert reply.finish_reason == "stop"
    check_split(reply, "\nLet me add.\n", "4")


@pytest.mark.parametrize("switch", [
    {"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}, {"thinking": False},
    {"thinking": {"type": "disabled"}}], ids=["template-kwargs", "enable_thinking", "thinking", "thinking-disabled"])
def test_qwen3_with_thinking_off(open_state, switch):
    state = open_state(QWEN3)
    play(state, "4", "tokens")
    reply = ask(state, {"messages": HI, **switch})
    # the template writes the empty reasoning block itself; the model only answers
    assert reply.prompts == [QWEN3_NOT_THINKING] * 2
    check_split(reply, None, "4")


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("name", [QWQ, R1])
def test_templates_that_open_the_reasoning(open_state, name, split):
    state = open_state(name)
    play(state, "Let me add.\n</think>\n\n4", split)
    reply = ask(state, {"messages": HI})
    assert reply.prompts == [PROMPTS[name]] * 2 and reply.prompts[0].endswith("<think>\n")
    assert state.tokenizer.token_to_id("<think>") in state.client.prompts[0]   # the tag reaches the model as one token
    assert reply.finish_reason == "stop"
    check_split(reply, "Let me add.\n", "4")


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("output", ["Let me add. Two and two", "Let me add.\n</thi"], ids=["plain", "mid-tag"])
@pytest.mark.parametrize("name", [QWQ, R1])
def test_cut_off_while_reasoning_is_all_reasoning(open_state, name, output, split):
    # max_tokens ran out before </think>: everything is reasoning, even a tag's start held back for the next
    # token, and the message's content is null (the stream sends no content at all)
    state = open_state(name)
    play(state, output, split, finish="length")
    reply = ask(state, {"messages": HI, "max_tokens": 40})
    assert reply.finish_reason == "length"
    check_split(reply, output, None)


@pytest.mark.parametrize("split", SPLITS)
def test_first_release_r1_template_lets_the_model_open_the_reasoning(open_state, split):
    state = open_state(R1_FIRST_RELEASE)
    play(state, "<think>\nLet me add.\n</think>\n\n4", split)
    reply = ask(state, {"messages": HI})
    assert reply.prompts == [PROMPTS[R1_FIRST_RELEASE]] * 2
    check_split(reply, "\nLet me add.\n", "4")


@pytest.mark.parametrize("name", [QWQ, R1])
def test_templates_without_a_thinking_switch_ignore_it(open_state, name):
    state = open_state(name)
    play(state, "Let me add.\n</think>\n\n4", "tokens")
    reply = ask(state, {"messages": HI, "enable_thinking": False})
    assert reply.prompts == [PROMPTS[name]] * 2   # still opens <think>: the reasoning is still split off
    check_split(reply, "Let me add.\n", "4")


@pytest.mark.parametrize(("reasoning_parser", "reasoning", "content"), [
    (None, None, "Let me add.\n</think>\n\n4"),   # detected "think": no <think> first, so it is all answer
    ("deepseek_r1", "Let me add.\n", "4"),       # --reasoning-parser deepseek_r1: reasoning until </think>
])
def test_reasoning_parser_flag_beats_detection(open_state, reasoning_parser, reasoning, content):
    # Qwen3 prompted without <think> that still reasons first and closes with </think>
    state = open_state(QWEN3, reasoning_parser=reasoning_parser)
    play(state, "Let me add.\n</think>\n\n4", "characters")
    assert state.reasoning_parser == (reasoning_parser or "think")
    reply = ask(state, {"messages": HI})
    assert reply.prompts == [PROMPTS[QWEN3]] * 2
    check_split(reply, reasoning, content)



# -- tool calls (Qwen's hermes format: <tool_call>{...}</tool_call>), after the reasoning ------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def play_long(state: ServerState, text: str, split: str) -> None:
    """``play``, with room for the tools' part of the prompt (the scripted client's context is 256 by default)."""
    play(state, text, split)
    state.client.info.max_model_len = 2048


def streamed_calls(state: ServerState, body: dict[str, Any]) -> tuple[list[dict], str, str]:
    """(the streamed tool-call deltas, the streamed content, the finish reason)."""
    chunks = sse_chunks(call(state, "POST", "/v1/chat/completions", {**body, "stream": True}))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    return calls, "".join(d.get("content", "") for d in deltas), chunks[-1]["choices"][0]["finish_reason"]


def test_the_server_detects_the_tool_call_parser(open_state):
    assert open_state(QWEN3).tool_parser == "hermes"


@pytest.mark.parametrize("split", SPLITS)
def test_a_tool_call_after_reasoning(open_state, split):
    state = open_state(QWEN3)
    play_long(state, f"<think>\nThe user wants weather.\n</think>\n\nLet me check.\n{CALL}", split)
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS}
    reply = ask(state, body)
    assert reply.finish_reason == "tool_calls"
    assert reply.message["reasoning_content"] == "\nThe user wants weather.\n"
    assert reply.message["content"] == "Let me check."
    [tool_call] = reply.message["tool_calls"]
    assert tool_call["type"] == "function" and tool_call["id"].startswith("call_")
    assert tool_call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert "<tools>" in reply.prompts[0] and "get_weather" in reply.prompts[0]   # the template rendered the tools
    calls, content, finish = streamed_calls(state, body)
    assert finish == "tool_calls" and content.strip() == "Let me check."
    assert [(c["index"], c["type"], c["function"]) for c in calls] == [
        (0, "function", {"name": "get_weather", "arguments": '{"city": "Paris"}'})]


def test_two_calls_and_a_malformed_one(open_state):
    state = open_state(QWEN3)
    second = CALL.replace("Paris", "Rome")
    play_long(state, f"<think>\n</think>\n\n{CALL}\n<tool_call>\nnot json\n</tool_call>\n{second}", "tokens")
    reply = ask(state, {"messages": HI, "tools": TOOLS})
    assert [json.loads(c["function"]["arguments"])["city"] for c in reply.message["tool_calls"]] == ["Paris", "Rome"]
    assert "not json" in reply.message["content"]   # a call that does not parse stays text, as vLLM leaves it
    calls, _, _ = streamed_calls(state, {"messages": HI, "tools": TOOLS})
    assert [c["index"] for c in calls] == [0, 1]
    # parallel_tool_calls false: the first call only
    one = ask(state, {"messages": HI, "tools": TOOLS, "parallel_tool_calls": False})
    assert [json.loads(c["function"]["arguments"])["city"] for c in one.message["tool_calls"]] == ["Paris"]
    calls, _, _ = streamed_calls(state, {"messages": HI, "tools": TOOLS, "parallel_tool_calls": False})
    assert [c["index"] for c in calls] == [0]


@pytest.mark.parametrize("body", [{}, {"tools": TOOLS, "tool_choice": "none"}], ids=["no-tools", "choice-none"])
def test_without_tools_the_text_stays_content(open_state, body):
    state = open_state(QWEN3)
    play_long(state, f"<think>\n</think>\n\n{CALL}", "tokens")
    reply = ask(state, {"messages": HI, **body})
    assert reply.finish_reason == "stop" and "tool_calls" not in reply.message
    assert reply.message["content"] == CALL


def test_the_openai_sdk_reads_the_calls(open_state):
    """The openai SDK's own types, streamed and not: the deltas accumulate into the call, as agents do it."""
    import asyncio

    import httpx
    import openai

    from cvllm.server.app import build_app

    state = open_state(QWEN3)
    play_long(state, f"<think>\n</think>\n\n{CALL}", "characters")
    messages = [{"role": "user", "content": "Weather in Paris?"}]

    async def run():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state)), base_url="http://test")
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)
        reply = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        [tool_call] = reply.choices[0].message.tool_calls
        assert (tool_call.function.name, json.loads(tool_call.function.arguments)) == ("get_weather",
                                                                                         {"city": "Paris"})
        assert reply.choices[0].finish_reason == "tool_calls"
        names, arguments = {}, {}
        async for chunk in await client.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                                                stream=True):
            for delta in chunk.choices[0].delta.tool_calls or []:
                names[delta.index] = names.get(delta.index, "") + (delta.function.name or "")
                arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
        assert names == {0: "get_weather"} and json.loads(arguments[0]) == {"city": "Paris"}
        await http.aclose()

    asyncio.run(run())
