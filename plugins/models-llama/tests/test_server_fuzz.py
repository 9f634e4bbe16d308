"""Seeded fuzzing of both generation endpoints: hundreds of random and mutated bodies (wrong types, huge and
negative numbers, 1e999, wrong nesting, unknown fields, odd unicode) each get a 2xx or a 4xx in OpenAI's error
shape, never a 5xx. The app runs in-process (no sockets) over a real engine core whose model runner is a fake
(no weights, instant steps), so every body crosses the real request validation, and every accepted one the
msgspec transport and the sampler, in a few milliseconds."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx
import msgspec

from cvllm.engine.config import EngineConfig
from cvllm.engine_process.client import EngineCoreClient
from cvllm.server.app import build_app
from cvllm.server.args import ServerArgs
from cvllm.server.protocol import ChatCompletionRequest, CompletionRequest
from cvllm.server.state import ServerState
from cvllm.testing import make_checkpoint

SEED = 15
BODIES = 500           # per endpoint
INF = float("inf")     # sent as 1e999

INTS = [0, 1, 2, 3, -1, -2, 20, 21, 127, 128, 129, 511, 512, 2**31 - 1, 2**31, 2**63 - 1, 2**63, -2**63,
        -2**63 - 1, 2**64 - 1, 2**64, -2**64, 1180591620717411303424, -10**30, 10**400]
FLOATS = [0.0, 0.5, -0.5, 1.0, 1.5, 2.5, -100.5, 100.0, 1e-320, 1e308, -1e308, INF, -INF]
STRINGS = ["", "hi", "5", "-3", " 7 ", "1_0", "1e999", "NaN", "²", "٣", "\x00", "\ud800", "é" * 3, "🙂" * 40,
           "x" * 3000, "9" * 5000, "<|im_start|>", "{{ raise_exception('x') }}", "{% for %}", "null", "text",
           "function", "user", "assistant", "tool"]
UNKNOWN = ["store", "metadata", "extra_body", "service_tier", "__proto__", "", "🙂", "prompt", "messages"]
FIELDS = sorted({f.name for kind in (ChatCompletionRequest, CompletionRequest) for f in msgspec.structs.fields(kind)})


def garbage(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.choice(INTS)
    if kind == 1:
        return rng.choice(FLOATS)
    if kind == 2:
        return rng.choice(STRINGS)
    if kind == 3:
        return rng.choice([None, True, False, rng.randint(-5, 600)])
    if kind == 4:
        return {}
    if kind == 5:
        return [garbage(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 6:
        return {rng.choice(STRINGS + FIELDS): garbage(rng, depth + 1) for _ in range(rng.randrange(4))}
    nested: Any = garbage(rng, 3)
    for _ in range(rng.randrange(1, 200)):
        nested = [nested] if rng.random() < 0.7 else {"a": nested}
    return nested


def number(rng: random.Random) -> Any:
    return rng.choice(INTS + FLOATS + [garbage(rng)])


def message(rng: random.Random) -> Any:
    if rng.random() < 0.2:
        return garbage(rng)
    item = {"role": rng.choice(["user", "system", "developer", "assistant", "tool", "wizard", 5, None]),
            "content": rng.choice(STRINGS + [None, [{"type": "text", "text": rng.choice(STRINGS)}], garbage(rng)])}
    for key in rng.sample(["name", "tool_calls", "tool_call_id", "reasoning_content", "extra"], rng.randrange(3)):
        item[key] = rng.choice([garbage(rng), [{"id": "c", "type": "function", "function": {
            "name": rng.choice(STRINGS), "arguments": rng.choice(STRINGS + ['{"a": 1e999}', '{"a": [[[1]]]}'])}}]])
    return item


def token_ids(rng: random.Random) -> list[Any]:
    return [rng.choice(INTS) if rng.random() < 0.2 else rng.randint(0, 600) for _ in range(rng.randint(0, 5))]


# values of the right shape with edge-case contents, so a body gets past decoding to the range checks
SHAPED = {
    "prompt": lambda rng: rng.choice([rng.choice(STRINGS), token_ids(rng), [token_ids(rng) for _ in range(3)],
                                      [rng.choice(STRINGS) for _ in range(rng.randint(0, 4))], [[]] * 1500]),
    "messages": lambda rng: [message(rng) for _ in range(rng.randint(0, 3))],
    "logit_bias": lambda rng: {rng.choice([str(rng.choice(INTS)), rng.choice(STRINGS)]): number(rng)
                               for _ in range(rng.randint(1, 3))},
    "stop_token_ids": token_ids,
    "stop": lambda rng: rng.choice([rng.choice(STRINGS), [rng.choice(STRINGS) for _ in range(3)], garbage(rng)]),
    "stream_options": lambda rng: {"include_usage": rng.choice([True, False, 1, "yes"]),
                                   "continuous_usage_stats": garbage(rng)},
    "response_format": lambda rng: {"type": rng.choice(["text", "json_object", "json_schema", "xml", 1]),
                                    "json_schema": garbage(rng)},
    "tools": lambda rng: [{"type": rng.choice(["function", "x"]), "function": {
        "name": rng.choice(STRINGS), "parameters": garbage(rng), "description": garbage(rng)}}],
    "tool_choice": lambda rng: rng.choice(["none", "auto", "required", {"type": "function", "function": {
        "name": "f"}}, garbage(rng)]),
    "chat_template_kwargs": lambda rng: {rng.choice(["tokenize", "enable_thinking", "messages", "tools",
                                                     "add_generation_prompt", "chat_template", "return_dict",
                                                     rng.choice(STRINGS)]): garbage(rng) for _ in range(2)},
    "thinking": lambda rng: rng.choice([True, False, {"type": rng.choice(["enabled", "disabled", [1], {}])},
                                        garbage(rng)]),
}


def mutated(rng: random.Random, chat: bool) -> bytes:
    body: Any = {"model": "tiny", "max_tokens": 2}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    for _ in range(rng.randint(1, 4)):
        roll = rng.random()
        name = rng.choice(FIELDS)
        if roll < 0.45:
            body[name] = SHAPED[name](rng) if name in SHAPED else number(rng)
        elif roll < 0.75:
            body[name] = garbage(rng)
        elif roll < 0.85:
            body.pop(name, None)
        else:
            body[rng.choice(UNKNOWN)] = garbage(rng)
    if rng.random() < 0.05:
        body = garbage(rng)   # not an object at all
    # escaped or raw UTF-8; raw, a lone surrogate ("\ud800") becomes bytes that are not UTF-8
    text = json.dumps(body, ensure_ascii=rng.random() < 0.5)
    text = text.replace("-Infinity", "-1e999").replace("Infinity", "1e999")   # JSON has no inf: 1e999 overflows to it
    if rng.random() < 0.05:
        text = text[:rng.randrange(len(text) + 1)]   # cut short
    return text.encode("utf-8", "surrogatepass")


def check(response: httpx.Response) -> str | None:
    """What is wrong with the response, or None."""
    if response.status_code >= 500:
        return f"{response.status_code}: {response.text[:300]}"
    if response.status_code >= 400:
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"{response.status_code} without an OpenAI error body: {response.text[:300]}"
        shape = set(error) == {"message", "type", "param", "code"} and isinstance(error["param"], str | None)
        if not (shape and isinstance(error["message"], str) and error["message"] and error["type"] != "server_error"):
            return f"{response.status_code} with a malformed error: {error}"
        return None
    if response.headers["content-type"].startswith("text/event-stream"):
        for event in response.text.split("\n\n"):   # a failure after the status line travels as an event
            if event.startswith("data: {") and '"error"' in event and "server_error" in event:
                return f"a server error mid-stream: {event[:300]}"
    return None


async def fuzz(model_dir: str) -> tuple[list[str], int]:
    engine = EngineConfig(model=model_dir, dtype="float32", backend="cpu", fake_step_ms=0, max_num_seqs=256,
                          max_model_len=128)
    state = ServerState.open(ServerArgs(engine=engine, served_model_names=["tiny"], max_queue=4096))
    state.client = await EngineCoreClient.start(engine, startup_timeout=120)
    rng = random.Random(SEED)
    failures, accepted = [], 0
    try:
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://fuzz", timeout=60) as client:
            for i in range(2 * BODIES):
                path = "/v1/chat/completions" if i % 2 else "/v1/completions"
                body = mutated(rng, chat=bool(i % 2))
                response = await client.post(path, content=body, headers={"Content-Type": "application/json"})
                accepted += response.status_code == 200
                problem = check(response)
                if problem is not None:
                    failures.append(f"{path} {body[:300]!r}\n    → {problem}")
            # and the engine core took none of it badly
            after = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            if after.status_code != 200 or state.client.dead is not None:
                failures.append(f"not serving afterwards: {after.status_code} {after.text[:300]}")
    finally:
        await state.client.shutdown()
    return failures, accepted


def test_no_body_makes_the_server_fail(tmp_path):
    make_checkpoint(tmp_path, "llama", seed=5)
    failures, accepted = asyncio.run(fuzz(str(tmp_path)))
    assert not failures, f"{len(failures)} of {2 * BODIES} bodies:\n" + "\n".join(failures[:20])
    assert accepted > BODIES // 10   # the mutations leave enough bodies valid to reach the engine core

