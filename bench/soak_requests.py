"""The soak's requests (bench/soak.py): the fixed-seed catalog the clients draw from and the fault requests, how
one is sent (streamed or whole, again after a 503), and how its answer is judged against the reference and counted.

Separate from the run (the server, its phases, the fault cycle, the memory checks) so that what is asked, and what
counts as a right answer, can be read and changed on their own.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

NAN_TOKEN, DETOKENIZE_TOKEN, POISON_TOKEN, HANG_TOKEN = 501, 502, 503, 504   # a prompt holding one meets its fault
EXPECTED_ERRORS = {   # fault -> what its request's error says
    "nan": "NaN or infinite",
    "detokenize": "Internal server error",   # the API process's own error: its message names no cause
    "poison": "each time the engine core died",
    "hang": "each time the engine core died",
}
POISON_RULE = EXPECTED_ERRORS["poison"]
WORDS = ("the", "cat", "sat", "on", "a", "mat", "tell", "me", "about", "rivers", "and", "stars", "why", "is",
         "sky", "blue", "write", "short", "poem", "list", "three", "colors", "how", "do", "birds", "fly", "explain",
         "numbers", "in", "plain", "words", "please")
STOPS = ("e", "a ", "s", "\n", "th", "o")


@dataclass(frozen=True, slots=True)
class Spec:
    """One request of the catalog."""
    name: str
    endpoint: str      # "completions" | "chat/completions"
    body: dict
    checked: bool      # greedy: its answer must equal the reference

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass(slots=True)
class Answer:
    """What a client got: per choice its text, finish reason and logprobs' tokens; usage; an error."""
    texts: dict[int, str] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    tokens: dict[int, list[str]] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    completion_tokens: int | None = None
    error: str | None = None
    status: int = 200
    done: bool = False   # a stream's [DONE], or a whole non-streamed body

    def key(self) -> tuple:
        return (sorted(self.texts.items()), sorted(self.finish.items()), sorted(self.tokens.items()),
                self.completion_tokens)


@dataclass
class Tally:
    sent: Counter = field(default_factory=Counter)
    completed: Counter = field(default_factory=Counter)
    failed: Counter = field(default_factory=Counter)     # by error kind
    unexpected: list = field(default_factory=list)       # failures that are no injected fault's
    mismatched: list = field(default_factory=list)
    duplicated: list = field(default_factory=list)
    lost: list = field(default_factory=list)
    cancelled: int = 0
    retried_503: int = 0
    checked: int = 0
    max_logprob_diff: float = 0.0
    faults: Counter = field(default_factory=Counter)


# -- the catalog --------------------------------------------------------------------------------------------------

def catalog(rng: random.Random, count: int) -> list[Spec]:
    specs = []
    for i in range(count):
        chat = rng.random() < 0.4
        stream = rng.random() < 0.6
        greedy = rng.random() < 0.8
        body: dict = {"max_tokens": rng.randint(8, 48), "temperature": 0.0 if greedy else 0.8}
        if not greedy:
            body["seed"] = rng.randrange(1 << 30)
        if rng.random() < 0.25:
            body["n"] = 2
        if rng.random() < 0.3:
            body |= {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}
        if rng.random() < 0.3:
            body["stop"] = [rng.choice(STOPS)]
        else:
            body["ignore_eos"] = rng.random() < 0.5
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        if chat:
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
            body["messages"] = [{"role": "user", "content": words}]
        else:
            body["prompt"] = [rng.randrange(10, 480) for _ in range(rng.randint(4, 24))]
        kind = f"{'chat' if chat else 'completion'}-{'stream' if stream else 'whole'}"
        specs.append(Spec(f"{i}:{kind}", "chat/completions" if chat else "completions", body, greedy))
    return specs


def fault_spec(fault: str, i: int) -> Spec:
    token = {"nan": NAN_TOKEN, "detokenize": DETOKENIZE_TOKEN, "poison": POISON_TOKEN, "hang": HANG_TOKEN}[fault]
    body = {"prompt": [token, 10 + i % 50, 11, 12], "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    if i % 2:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return Spec(f"fault:{fault}", "completions", body, False)


async def drop_fault_tokens(client: httpx.AsyncClient, url: str, specs: list[Spec]) -> list[Spec]:
    """The chat requests whose rendered prompt holds no fault's token (else they would meet that fault)."""
    kept = []
    for spec in specs:
        if spec.endpoint == "chat/completions":
            r = await client.post(f"{url}/tokenize", json={"messages": spec.body["messages"],
                                                           "add_generation_prompt": True})
            r.raise_for_status()
            if {NAN_TOKEN, DETOKENIZE_TOKEN, POISON_TOKEN, HANG_TOKEN} & set(r.json()["tokens"]):
                continue
        kept.append(spec)
    return kept


# -- one request --------------------------------------------------------------------------------------------------

def take_choice(answer: Answer, choice: dict, chat: bool) -> None:
    index = choice["index"]
    part = choice.get("delta") if "delta" in choice else choice.get("message")
    text = (part or {}).get("content") if chat else choice.get("text")
    answer.texts[index] = answer.texts.get(index, "") + (text or "")
    if choice.get("finish_reason"):
        answer.finish[index] = choice["finish_reason"]
    answer.finish.setdefault(index, None)
    logprobs = choice.get("logprobs")
    if logprobs:
        if chat:
            tokens = [t["token"] for t in logprobs.get("content") or ()]
            values = [t["logprob"] for t in logprobs.get("content") or ()]
        else:
            tokens, values = logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []
        answer.tokens.setdefault(index, []).extend(tokens)
        answer.logprobs.setdefault(index, []).extend(values)


def error_message(content: bytes) -> str:
    try:
        return json.loads(content)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return content.decode(errors="replace")[:300]


async def send(client: httpx.AsyncClient, url: str, spec: Spec, cancel_after: int | None = None) -> Answer:
    """One request; a stream is closed after ``cancel_after`` chunks with choices if given. A 503 (a core
    restarting) comes back as such, for the caller to retry."""
    answer, chat = Answer(), spec.endpoint.startswith("chat")
    if not spec.stream:
        r = await client.post(f"{url}/{spec.endpoint}", json=spec.body)
        answer.status = r.status_code
        if r.status_code != 200:
            answer.error = error_message(r.content)
            return answer
        body = r.json()
        for choice in body["choices"]:
            take_choice(answer, choice, chat)
        answer.completion_tokens = body["usage"]["completion_tokens"]
        answer.done = True
        return answer
    chunks = 0
    async with client.stream("POST", f"{url}/{spec.endpoint}", json=spec.body) as r:
        answer.status = r.status_code
        if r.status_code != 200:
            answer.error = error_message(await r.aread())
            return answer
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                answer.done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                answer.error = chunk["error"].get("message", str(chunk["error"]))
                continue
            if chunk.get("usage"):
                answer.completion_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or ():
                take_choice(answer, choice, chat)
                chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                return answer   # leaving the block closes the connection mid-stream
    return answer


async def send_retrying(client: httpx.AsyncClient, url: str, spec: Spec, tally: Tally,
                        cancel_after: int | None = None) -> Answer:
    """``send``, again after a 503 (the engine core restarting), for up to two minutes."""
    deadline = time.monotonic() + 120
    while True:
        answer = await send(client, url, spec, cancel_after)
        if answer.status != 503 or time.monotonic() > deadline:
            return answer
        tally.retried_503 += 1
        await asyncio.sleep(0.2)


# -- checking -----------------------------------------------------------------------------------------------------

def judge(spec: Spec, answer: Answer, reference: Answer | None, tally: Tally, cancelled: bool = False) -> None:
    """Count ``answer`` of a catalog request: completed, failed (expected: the poison rule), mismatched,
    duplicated, or lost."""
    if answer.error is not None:
        if POISON_RULE in answer.error:
            tally.failed["poison rule (in flight through two deaths)"] += 1
        else:
            tally.unexpected.append({"request": spec.name, "status": answer.status, "error": answer.error[:300]})
        return
    if cancelled:
        tally.cancelled += 1
        if reference is not None and any(not reference.texts.get(i, "").startswith(text)
                                         for i, text in answer.texts.items()):
            problem = {"request": spec.name, "cancelled": True, "got": answer.texts, "want": reference.texts}
            longer = any(len(t) > len(reference.texts.get(i, "")) for i, t in answer.texts.items())
            (tally.duplicated if longer else tally.mismatched).append(problem)
        return
    if not answer.done or None in answer.finish.values() or not answer.finish:
        tally.lost.append({"request": spec.name, "got": answer.texts, "finish": answer.finish})
        return
    tally.completed[spec.name.split(":")[1]] += 1
    if reference is None:
        return
    tally.checked += 1
    if answer.key() != reference.key():
        problem = {"request": spec.name, "got": answer.key(), "want": reference.key()}
        longer = (any(len(t) > len(reference.texts.get(i, "")) for i, t in answer.texts.items())
                  or (answer.completion_tokens or 0) > (reference.completion_tokens or 0)
                  or any(len(t) > len(reference.tokens.get(i, [])) for i, t in answer.tokens.items()))
        (tally.duplicated if longer else tally.mismatched).append(problem)
        return
    for index, values in answer.logprobs.items():
        for got, want in zip(values, reference.logprobs[index]):
            tally.max_logprob_diff = max(tally.max_logprob_diff, abs(got - want))


# -- one request, counted -----------------------------------------------------------------------------------------

async def catalog_request(client: httpx.AsyncClient, url: str, spec: Spec, references: dict[str, Answer],
                          tally: Tally, cancel_after: int | None = None) -> None:
    tally.sent[spec.name.split(":")[1]] += 1
    try:
        answer = await send_retrying(client, url, spec, tally, cancel_after)
    except httpx.HTTPError as e:
        tally.lost.append({"request": spec.name, "error": f"{type(e).__name__}: {e}"})
        return
    cancelled = cancel_after is not None and not answer.done   # else it ended before the client left
    judge(spec, answer, references.get(spec.name), tally, cancelled)


async def fault_request(client: httpx.AsyncClient, url: str, fault: str, i: int, tally: Tally) -> None:
    spec = fault_spec(fault, i)
    tally.sent[f"fault-{fault}"] += 1
    try:
        answer = await send_retrying(client, url, spec, tally)
    except httpx.HTTPError as e:
        tally.lost.append({"request": spec.name, "error": f"{type(e).__name__}: {e}"})
        return
    if answer.error is not None and EXPECTED_ERRORS[fault] in answer.error:
        tally.failed[f"injected {fault}"] += 1
    else:
        tally.unexpected.append({"request": spec.name, "status": answer.status, "error": answer.error,
                                 "got": answer.texts})
