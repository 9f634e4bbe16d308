"""Soak: mixed traffic against a live cvserve while its engine core is killed and faults are injected (issue 23).

    python bench/soak.py                                  # 2 minutes of warm-up, then 10 on the CPU
    python bench/soak.py --minutes 3 --json out.json
    python bench/soak.py --backend cuda --clients 8

Makes a tiny random Llama checkpoint and serves it (cvllm.testing.server: a real server whose engine carries a
cvllm.testing.faults plan, which the cvserve command line cannot), then:

1. reference: every request of a fixed-seed catalog once, with no fault: streamed and non-streamed completions and
   chat completions, n > 1, logprobs, stop strings, greedy (checked) and seeded sampling (only counted);
2. warm-up (``--warmup-minutes``), then soak (``--minutes``): ``--clients`` concurrent clients draw requests from
   the catalog (some close the connection mid-stream), while every ``--fault-every`` seconds one fault of a cycle
   strikes: kill -9 of the engine core; a request whose logits are NaN; one whose detokenization raises; one that
   raises a device error on every core it reaches (the poison rule fails it); one that hangs every core it reaches
   (killed after ``--hang-timeout``, then the poison rule);
3. idle, after each: traffic stops; the KV blocks in use (/metrics) must go back to 0; after ``--settle-s`` more
   (past the server's keep-alive timeout and its idle release of memory) the processes' RSS is measured. The one
   after the warm-up is the baseline (the allocators' pools filled by this traffic once); the one after the soak
   must be back to it (``--max-rss-growth-mb``).

Every answer of a greedy request must equal its reference (text, finish reason, token count, logprobs' tokens):
a stream resumed on a new core goes on where it stopped. Requests fail only with the injected errors or the poison
rule (a request in flight through several deaths: the others in flight through both deaths with a poison request
are retried one at a time, so it fails a catalog request only when an unrelated fault, such as the next kill -9,
strikes while that request is on trial); none is lost (no answer, or a stream cut without an error or a finish) or
duplicated (a stream that repeats tokens). New requests that meet a core restarting get 503 and are retried. Not
in CI: a bounded run, minutes long.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import git_commit  # noqa: E402

from cvllm.testing import make_checkpoint  # noqa: E402
from cvllm.testing.server import LiveServer  # noqa: E402

NAN_TOKEN, DETOKENIZE_TOKEN, POISON_TOKEN, HANG_TOKEN = 501, 502, 503, 504   # a prompt holding one meets its fault
FAULT_CYCLE = ("kill", "nan", "kill", "detokenize", "kill", "poison", "kill", "hang")
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


# -- processes ----------------------------------------------------------------------------------------------------

def core_pid(server: LiveServer) -> int | None:
    """The engine core: the server's child that multiprocessing spawned (not its resource tracker)."""
    pid = server.process.pid
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    for child in map(int, children):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
        except OSError:
            continue
    return None


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return int(found.group(1)) / 1024 if found else None


def memory(server: LiveServer) -> dict:
    return {"api_mb": rss_mb(server.process.pid), "core_mb": rss_mb(core_pid(server))}


async def metric(client: httpx.AsyncClient, root: str, name: str) -> float | None:
    r = await client.get(f"{root}/metrics")
    found = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", r.text, re.M)
    return float(found.group(1)) if found else None


# -- the run ------------------------------------------------------------------------------------------------------

async def reference_pass(client: httpx.AsyncClient, url: str, specs: list[Spec], clients: int) -> dict[str, Answer]:
    """Each greedy request's answer with no fault, ``clients`` at a time (the soak's batches are mixed too)."""
    queue = list(specs)
    references: dict[str, Answer] = {}

    async def worker() -> None:
        while queue:
            spec = queue.pop(0)
            answer = await send(client, url, spec)
            if answer.error is not None or not answer.done:
                raise RuntimeError(f"reference request {spec.name} failed: {answer.error or 'no end'}")
            if spec.checked:
                references[spec.name] = answer

    await asyncio.gather(*(worker() for _ in range(clients)))
    return references


async def traffic(client: httpx.AsyncClient, url: str, specs: list[Spec], references: dict[str, Answer],
                  tally: Tally, rng: random.Random, until: float, cancel_share: float) -> None:
    while time.monotonic() < until:
        spec = rng.choice(specs)
        cancel_after = rng.randint(1, 4) if spec.stream and rng.random() < cancel_share else None
        await catalog_request(client, url, spec, references, tally, cancel_after)


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


async def faults(client: httpx.AsyncClient, url: str, server: LiveServer, specs: list[Spec],
                 references: dict[str, Answer], tally: Tally, rng: random.Random, every: float, until: float) -> None:
    """One fault of the cycle every ``every`` seconds, while traffic runs."""
    fault_requests = []
    for i in itertools.count():
        await asyncio.sleep(every)
        if time.monotonic() > until - every / 2:
            break
        while (await client.get(f"{server.url}/health")).status_code != 200:   # the last fault's restart is over
            await asyncio.sleep(0.2)
        fault = FAULT_CYCLE[i % len(FAULT_CYCLE)]
        tally.faults[fault] += 1
        if fault == "kill":
            pid = core_pid(server)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                # a request that arrives while the core restarts: 503, retried, then answered as without the kill
                deadline = time.monotonic() + 2
                while (await client.get(f"{server.url}/health")).status_code == 200 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                spec = rng.choice([spec for spec in specs if spec.checked])
                fault_requests.append(asyncio.create_task(catalog_request(client, url, spec, references, tally)))
            continue
        fault_requests.append(asyncio.create_task(fault_request(client, url, fault, i, tally)))
    await asyncio.gather(*fault_requests)


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


async def sample_memory(server: LiveServer, samples: list, stop: asyncio.Event, every: float = 5.0) -> None:
    started = time.monotonic()
    while not stop.is_set():
        samples.append({"t_s": round(time.monotonic() - started, 1), **memory(server)})
        try:
            await asyncio.wait_for(stop.wait(), every)
        except TimeoutError:
            pass


async def load(client: httpx.AsyncClient, server: LiveServer, specs: list[Spec], references: dict[str, Answer],
               tally: Tally, args: argparse.Namespace, minutes: float, seed: int) -> float:
    """``--clients`` clients and the fault cycle for ``minutes``; the seconds it took."""
    url = server.url + "/v1"
    until = time.monotonic() + minutes * 60
    started = time.perf_counter()
    await asyncio.gather(
        *(traffic(client, url, specs, references, tally, random.Random(seed * 1000 + c), until, args.cancel_share)
          for c in range(args.clients)),
        faults(client, url, server, specs, references, tally, random.Random(seed - 1), args.fault_every, until))
    return time.perf_counter() - started


async def settle(client: httpx.AsyncClient, server: LiveServer, args: argparse.Namespace) -> dict:
    """Traffic has stopped: wait until nothing is in flight and no KV block is used (at most ``--idle-s``), then
    ``--settle-s`` more, past the server's keep-alive timeout and its idle release (server/memory.py), and measure."""
    idle_started = time.monotonic()
    kv_used = in_flight = None
    while time.monotonic() - idle_started < args.idle_s:
        kv_used = await metric(client, server.url, "cvllm:kv_cache_blocks_used")
        in_flight = await metric(client, server.url, "cvllm:num_requests_in_flight")
        if kv_used == 0 and in_flight == 0 and time.monotonic() - idle_started > 5:
            break
        await asyncio.sleep(0.5)
    drained_s = time.monotonic() - idle_started
    await asyncio.sleep(args.settle_s)
    return {"kv_used": kv_used, "in_flight": in_flight, "drained_s": round(drained_s, 1), **memory(server)}


async def soak(server: LiveServer, args: argparse.Namespace) -> dict:
    root, url = server.url, server.url + "/v1"
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(30.0, read=args.request_timeout)) as client:
        specs = await drop_fault_tokens(client, url, catalog(rng, args.catalog))
        memory_at = {"start": memory(server)}
        started = time.perf_counter()
        references = await reference_pass(client, url, specs, args.clients)
        reference_s = time.perf_counter() - started
        memory_at["after_reference"] = memory(server)
        core_at_start = core_pid(server)

        tally, samples, stop_sampling = Tally(), [], asyncio.Event()
        sampler = asyncio.create_task(sample_memory(server, samples, stop_sampling))
        # The baseline: what the server holds, idle, after a warm-up of the same traffic and faults (the
        # allocators' pools and caches filled once); the end is measured the same way after the soak.
        warmup_s, baseline_sample = 0.0, 0
        if args.warmup_minutes:
            warmup_s = await load(client, server, specs, references, tally, args, args.warmup_minutes, args.seed + 1)
            memory_at["baseline"] = {k: v for k, v in (await settle(client, server, args)).items() if k.endswith("_mb")}
        baseline_sample = len(samples)   # the samples before it are the warm-up's
        soak_s = await load(client, server, specs, references, tally, args, args.minutes, args.seed)
        end = await settle(client, server, args)
        stop_sampling.set()
        await sampler
        memory_at["end_idle"] = {k: v for k, v in end.items() if k.endswith("_mb")}
        kv_total = await metric(client, root, "cvllm:kv_cache_blocks_total")
    log = server.log()
    return {"catalog": len(specs), "checked_in_catalog": len(references), "reference_s": round(reference_s, 1),
            "warmup_s": round(warmup_s, 1), "soak_s": round(soak_s, 1), "idle_wait_s": end["drained_s"],
            "tally": tally, "kv_blocks_used_end": end["kv_used"], "kv_blocks_total": kv_total,
            "in_flight_end": end["in_flight"], "memory": memory_at, "memory_samples": samples,
            "baseline_sample": baseline_sample,
            "core_deaths": log.count("engine core dead:"), "core_restarts": log.count("engine core restarted in"),
            "resumed": sum(int(n) for n in re.findall(r"(\d+) request\(s\) resumed", log)),
            "quarantined": sum(len(m.split(", ")) for m in re.findall(r"requests (.*) were in flight when", log)),
            "hung_cores_killed": log.count("is hung: it made no progress"),
            "core_replaced": core_pid(server) != core_at_start}


def summary(run: dict) -> dict:
    t: Tally = run["tally"]
    mem, samples = run["memory"], run["memory_samples"]

    def peak(key: str, start: int = 0, stop: int | None = None) -> float | None:
        values = [s[key] for s in samples[start:stop] if s[key] is not None]
        return max(values) if values else None

    def rss(proc: str) -> dict:
        key = f"{proc}_mb"
        return {"start": mem["start"][key], "after_reference": mem["after_reference"][key],
                "baseline": mem.get("baseline", {}).get(key),
                "peak_warmup": peak(key, 0, run["baseline_sample"]) if "baseline" in mem else None,
                "peak": peak(key, run["baseline_sample"]), "end_idle": mem["end_idle"][key]}

    return {
        "sent": sum(t.sent.values()), "sent_by_kind": dict(t.sent),
        "completed": sum(t.completed.values()), "completed_by_kind": dict(t.completed),
        "checked_equal": t.checked - len(t.mismatched) - len(t.duplicated),
        "cancelled_mid_stream": t.cancelled,
        "failed_expected": sum(t.failed.values()), "failed_by_error": dict(t.failed),
        "failed_unexpected": len(t.unexpected), "lost": len(t.lost), "duplicated": len(t.duplicated),
        "mismatched": len(t.mismatched), "retried_503": t.retried_503,
        "max_logprob_abs_diff": t.max_logprob_diff,
        "faults": dict(t.faults), "core_deaths": run["core_deaths"], "core_restarts": run["core_restarts"],
        "requests_resumed": run["resumed"], "suspects_retried_alone": run["quarantined"],
        "hung_cores_killed": run["hung_cores_killed"],
        "kv_blocks_used_end": run["kv_blocks_used_end"], "kv_blocks_total": run["kv_blocks_total"],
        "in_flight_end": run["in_flight_end"],
        "rss_mb": {"api": rss("api"), "core": rss("core")},
        "api_rss_growth_mb": growth(mem, "api_mb"), "core_rss_growth_mb": growth(mem, "core_mb"),
        "problems": {"unexpected": t.unexpected[:10], "lost": t.lost[:10], "duplicated": t.duplicated[:5],
                     "mismatched": t.mismatched[:5]},
    }


def growth(mem: dict, key: str) -> float | None:
    """RSS idle at the end against the baseline (idle after the warm-up; without one, after the reference pass).
    The core's is a later core's at the end."""
    end, base = mem["end_idle"][key], mem.get("baseline", mem["after_reference"])[key]
    return None if end is None or base is None else round(end - base, 1)


def print_table(s: dict) -> None:
    rows = [("requests sent", s["sent"]), ("completed", s["completed"]),
            ("  checked equal to the reference", s["checked_equal"]),
            ("cancelled mid-stream", s["cancelled_mid_stream"]),
            ("failed, expected", f"{s['failed_expected']} {s['failed_by_error']}"),
            ("failed, unexpected", s["failed_unexpected"]), ("lost", s["lost"]), ("duplicated", s["duplicated"]),
            ("mismatched", s["mismatched"]), ("503 retried (core restarting)", s["retried_503"]),
            ("faults", s["faults"]), ("core deaths / restarts", f"{s['core_deaths']} / {s['core_restarts']}"),
            ("requests resumed on a new core", s["requests_resumed"]),
            ("suspects retried one at a time", s["suspects_retried_alone"]),
            ("hung cores killed", s["hung_cores_killed"]),
            ("KV blocks used at the end", f"{s['kv_blocks_used_end']:g} of {s['kv_blocks_total']:g}")]
    for proc in ("api", "core"):
        r = s["rss_mb"][proc]
        rows.append((f"RSS {proc} MB (start, warm, warm-up peak, baseline, peak, end)",
                     " / ".join("-" if r[k] is None else f"{r[k]:.1f}"
                                for k in ("start", "after_reference", "peak_warmup", "baseline", "peak", "end_idle"))))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def clean(s: dict, max_rss_growth_mb: float) -> bool:
    return (s["lost"] == s["duplicated"] == s["mismatched"] == s["failed_unexpected"] == 0
            and s["kv_blocks_used_end"] == 0 and s["in_flight_end"] == 0
            and all(g is not None and g <= max_rss_growth_mb
                    for g in (s["api_rss_growth_mb"], s["core_rss_growth_mb"])))


def recorded_argv(argv: list[str]) -> list[str]:
    """The command as the report records it: without --server-log's path (the log is a local debugging aid)."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--server-log="):
            skip = False
            continue
        skip = arg == "--server-log"
        if not skip:
            kept.append(arg)
    return kept


def engine_spec(model: Path, args: argparse.Namespace) -> dict:
    plan = [{"stage": "sample", "action": "nan", "prompt_token": NAN_TOKEN},
            {"stage": "detokenize", "action": "raise", "prompt_token": DETOKENIZE_TOKEN},
            {"stage": "forward", "action": "device_error", "prompt_token": POISON_TOKEN},
            {"stage": "forward", "action": "hang", "prompt_token": HANG_TOKEN}]
    return {"model": str(model), "dtype": args.dtype, "backend": args.backend, "max_num_seqs": args.max_num_seqs,
            "fault_injector": plan}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="how long the traffic runs")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients")
    ap.add_argument("--fault-every", type=float, default=15.0, help="seconds between faults")
    ap.add_argument("--cancel-share", type=float, default=0.15, help="share of streams closed mid-stream")
    ap.add_argument("--catalog", type=int, default=64, help="distinct requests the clients draw from")
    ap.add_argument("--seed", type=int, default=23)
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--hang-timeout", type=float, default=5.0, help="the server's --engine-hang-timeout")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds without a byte: the request is lost")
    ap.add_argument("--warmup-minutes", type=float, default=2.0,
                    help="the same traffic and faults first (default: one fault cycle at --fault-every 15); the "
                         "RSS idle after it is the baseline")
    ap.add_argument("--idle-s", type=float, default=60.0, help="at most this long for the requests to drain")
    ap.add_argument("--settle-s", type=float, default=40.0,
                    help="then idle this long before measuring: past the server's keep-alive timeout (30 s) and "
                         "its idle release of memory (35 s)")
    ap.add_argument("--max-rss-growth-mb", type=float, default=2.0,
                    help="a process's RSS idle at the end may exceed its baseline by this much")
    ap.add_argument("--server-log", help="keep the server's log here")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "llama"
        make_checkpoint(model, "llama", seed=args.seed)
        server = LiveServer(engine_spec(model, args), max_restarts=10_000, engine_hang_timeout=args.hang_timeout)
        try:
            server.start()
            run = asyncio.run(soak(server, args))
        finally:
            log = server.log() if server.process is not None else ""
            exit_code = server.stop(60)
            server.close()
            if args.server_log:
                Path(args.server_log).write_text(log)
    s = summary(run)
    s["server_exit_code"] = exit_code
    print_table(s)
    print(f"server exit code after SIGTERM: {exit_code}")
    ok = clean(s, args.max_rss_growth_mb)
    print("clean" if ok else "NOT CLEAN: see problems in the JSON")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "server_log")}
        report = {"bench": "soak", "command": " ".join(recorded_argv(sys.argv)), "commit": git_commit(),
                  "date": datetime.now(UTC).isoformat(timespec="seconds"), "cpus": os.cpu_count(),
                  "config": config, "fault_cycle": FAULT_CYCLE, "catalog": run["catalog"],
                  "checked_in_catalog": run["checked_in_catalog"], "reference_s": run["reference_s"],
                  "warmup_s": run["warmup_s"], "soak_s": run["soak_s"], "idle_wait_s": run["idle_wait_s"],
                  "clean": ok, "results": s, "memory_samples": run["memory_samples"],
                  "baseline_sample": run["baseline_sample"]}
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
