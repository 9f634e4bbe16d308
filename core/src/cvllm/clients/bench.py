"""``cvllm bench``: load a running server with concurrent streamed completions and measure it.

Prompts are lists of token ids sent to ``/v1/completions`` with ``ignore_eos`` and ``max_tokens``,
so every request has exactly ``--input-len`` prompt and ``--output-len`` output tokens. The ids
come from tokenizing random words through the server's ``/tokenize``, so they are ordinary tokens
of the model's vocabulary, and each prompt is a fresh random draw (no shared prefix to cache).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import httpx

from cvllm.clients import api_url, auth_headers, error_message, server_root

Clock = Callable[[], float]

_WORDS = ("time year people way day man thing woman life child world school state family student group country "
          "problem hand part place case week company system program question work government number night point "
          "home water room mother area money story fact month lot right study book eye job word business issue "
          "side kind head house service friend father power hour game line end member law car city community name "
          "president team minute idea kid body information back parent face others level office door health art "
          "war history party result change morning reason research girl guy moment air teacher force education").split()


@dataclass(slots=True)
class BenchOptions:
    url: str
    model: str | None = None
    input_len: int = 128
    output_len: int = 128
    stream: bool = True
    api_key: str | None = None
    seed: int = 0


@dataclass(slots=True)
class RequestRecord:
    start: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)   # arrival of each chunk that carried text
    output_tokens: int = 0
    error: str | None = None


def describe_error(exc: BaseException) -> str:
    """``Type: message``, followed by the underlying error where the message is empty (httpx's ReadError
    says nothing itself: the reset or closed socket is in its cause)."""
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__ or exc.__context__
    while not str(exc) and cause is not None:
        text += f" <- {type(cause).__name__}: {cause}"
        exc, cause = cause, cause.__cause__ or cause.__context__
    return text


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _distribution_ms(seconds: list[float]) -> dict[str, float]:
    ms = [1000 * s for s in seconds]
    return {"mean": sum(ms) / len(ms) if ms else math.nan,
            **{f"p{q}": percentile(ms, q) for q in (50, 90, 99)}}


def summarize(records: list[RequestRecord], concurrency: int, wall: float, cpu: float) -> dict:
    """Per-level numbers. TTFT, ITL (gaps between text-bearing chunks; a chunk may carry several
    tokens when the server merges a lagging stream's deltas) and TPOT ((last - first chunk) over
    tokens after the first) come from successful streamed requests only."""
    ok = [r for r in records if r.error is None]
    streamed = [r for r in ok if r.chunk_times]
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "concurrency": concurrency, "requests": len(records), "completed": len(ok), "errors": len(records) - len(ok),
        "error_messages": errors, "duration_s": wall, "requests_per_s": len(ok) / wall,
        "output_tokens": output_tokens, "output_tok_per_s": output_tokens / wall,
        "ttft_ms": _distribution_ms([r.chunk_times[0] - r.start for r in streamed]),
        "itl_ms": _distribution_ms([b - a for r in streamed for a, b in zip(r.chunk_times, r.chunk_times[1:])]),
        "tpot_ms": _distribution_ms([(r.chunk_times[-1] - r.chunk_times[0]) / (r.output_tokens - 1)
                                     for r in streamed if r.output_tokens > 1]),
        "e2e_ms": _distribution_ms([r.end - r.start for r in ok]),
        # when failed requests failed (seconds after they were sent) and how far their streams had got
        "failed_after_s": sorted(round(r.end - r.start, 3) for r in records if r.error is not None)[:32],
        "failed_chunks": sorted(len(r.chunk_times) for r in records if r.error is not None)[:32],
        "client_cpu_percent": 100 * cpu / wall,
    }


async def one_request(client: httpx.AsyncClient, options: BenchOptions, prompt: list[int],
                      clock: Clock = time.perf_counter) -> RequestRecord:
    body = {"prompt": prompt, "max_tokens": options.output_len, "ignore_eos": True, "temperature": 0.0,
            "stream": options.stream}
    if options.model:
        body["model"] = options.model
    if options.stream:
        body["stream_options"] = {"include_usage": True}
    record = RequestRecord(start=clock())
    try:
        async with client.stream("POST", f"{api_url(options.url)}/completions", json=body,
                                 headers=auth_headers(options.api_key)) as response:
            if response.status_code != 200:
                record.error = error_message(response.status_code, await response.aread())
            elif options.stream:
                await _read_stream(response, record, clock)
            else:
                record.output_tokens = json.loads(await response.aread())["usage"]["completion_tokens"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        record.error = describe_error(exc)
    record.end = clock()
    return record


async def _read_stream(response: httpx.Response, record: RequestRecord, clock: Clock) -> None:
    """Note when each text-bearing chunk arrives. Every OpenAI-style server sends one ``data:``
    line per event, so lines are parsed as they come, after the arrival time is taken."""
    usage = None
    async for line in response.aiter_lines():
        arrived = clock()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        event = json.loads(payload)
        if "error" in event:
            record.error = event["error"].get("message", str(event["error"]))
            return
        if any(choice.get("text") for choice in event.get("choices") or []):
            record.chunk_times.append(arrived)
        usage = event.get("usage") or usage
    # Without usage (a server ignoring stream_options), count text-bearing chunks as tokens.
    record.output_tokens = usage["completion_tokens"] if usage else len(record.chunk_times)


async def run_level(client: httpx.AsyncClient, options: BenchOptions, prompts: list[list[int]], concurrency: int,
                    clock: Clock = time.perf_counter) -> dict:
    """Send every prompt with at most ``concurrency`` in flight; summarize the level."""
    pending = iter(prompts)
    records: list[RequestRecord] = []

    async def worker() -> None:
        for prompt in pending:  # one shared iterator: each prompt is taken by exactly one worker
            records.append(await one_request(client, options, prompt, clock))

    cpu0, t0 = time.process_time(), clock()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return summarize(records, concurrency, clock() - t0, time.process_time() - cpu0)


async def sample_prompts(client: httpx.AsyncClient, options: BenchOptions, count: int) -> list[list[int]]:
    rng = random.Random(options.seed)
    text = " ".join(rng.choice(_WORDS) for _ in range(max(256, options.input_len)))
    response = await client.post(f"{server_root(options.url)}/tokenize", headers=auth_headers(options.api_key),
                                 json={"prompt": text, "add_special_tokens": False})
    if response.status_code != 200:
        why = error_message(response.status_code, response.content)
        raise RuntimeError(f"cannot calibrate prompts through /tokenize: {why}")
    pool = response.json()["tokens"]
    return [rng.choices(pool, k=options.input_len) for _ in range(count)]


async def run_bench(options: BenchOptions, levels: list[int], num_requests: int | None,
                    transport: httpx.AsyncBaseTransport | None = None,
                    log: Callable[[str], None] = print) -> list[dict]:
    limits = httpx.Limits(max_connections=max(levels), max_keepalive_connections=max(levels))
    async with httpx.AsyncClient(transport=transport, limits=limits, timeout=httpx.Timeout(30.0, read=None)) as client:
        prompts = await sample_prompts(client, options, 1 + sum(num_requests or 4 * c for c in levels))
        warm = await one_request(client, replace(options, output_len=4), prompts.pop())
        if warm.error:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        results = []
        for concurrency in levels:
            count = num_requests or 4 * concurrency
            level_prompts, prompts = prompts[:count], prompts[count:]
            log(f"concurrency {concurrency}: {count} requests ...")
            results.append(await run_level(client, options, level_prompts, concurrency))
        return results


def _cell(value: float, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if math.isnan(value) else f"{value:>{width}.{digits}f}"


def format_table(results: list[dict]) -> str:
    header = (f"{'conc':>5} {'reqs':>5} {'err':>4} {'req/s':>7} {'out tok/s':>10} "
              f"{'TTFT p50/p90/p99 ms':>22} {'ITL p50/p90/p99 ms':>21} {'TPOT p50':>9} {'E2E p50/p99 s':>15} "
              f"{'client CPU':>10}")
    rows = [header]
    for r in results:
        t, i, e = r["ttft_ms"], r["itl_ms"], r["e2e_ms"]
        rows.append(" ".join([
            f"{r['concurrency']:>5} {r['requests']:>5} {r['errors']:>4} {r['requests_per_s']:>7.2f}",
            f"{r['output_tok_per_s']:>10.1f}", _cell(t["p50"], 6, 0), _cell(t["p90"], 6, 0), _cell(t["p99"], 8, 0),
            _cell(i["p50"], 6, 1), _cell(i["p90"], 6, 1), _cell(i["p99"], 7, 1), _cell(r["tpot_ms"]["p50"], 9, 1),
            _cell(e["p50"] / 1000, 7, 2), _cell(e["p99"] / 1000, 7, 2), f"{r['client_cpu_percent']:>9.0f}%"]))
    return "\n".join(rows)


def main(args: argparse.Namespace, transport: httpx.AsyncBaseTransport | None = None) -> int:
    options = BenchOptions(url=args.url, model=args.model, input_len=args.input_len, output_len=args.output_len,
                           stream=args.stream, api_key=args.api_key or os.environ.get("CVLLM_API_KEY"), seed=args.seed)
    def progress(line: str) -> None:  # stderr, so stdout holds only the table
        print(line, file=sys.stderr)

    try:
        results = asyncio.run(run_bench(options, args.concurrency, args.num_requests, transport, progress))
    except (RuntimeError, httpx.HTTPError) as exc:
        print(f"cvllm bench: error: {exc}", file=sys.stderr)
        return 1
    print(format_table(results))
    for r in results:
        for message, count in r["error_messages"].items():
            print(f"concurrency {r['concurrency']}: {count} × {message}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"options": asdict(options) | {"api_key": None}, "results": results}, f, indent=2)
    return 1 if any(r["errors"] for r in results) else 0
