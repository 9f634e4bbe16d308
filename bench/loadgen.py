"""The serving benchmark's load generator: streamed completions from several client processes that open
their streams at one agreed moment, and a probe of single requests sent one after another. Client
processes import only this module, httpx and cvllm.clients.bench."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict

import httpx

from cvllm.clients import server_root
from cvllm.clients.bench import BenchOptions, RequestRecord, one_request, summarize


def stream_share(url: str, prompts: list[list[int]], output_len: int, start_at: float) -> dict:
    """One load-generator process: its share of the streams, all opened at ``start_at`` (perf_counter
    is CLOCK_MONOTONIC, one clock for every process of the machine)."""
    return asyncio.run(_stream_share(url, prompts, output_len, start_at))


async def _stream_share(url: str, prompts: list[list[int]], output_len: int, start_at: float) -> dict:
    options = BenchOptions(url=url, input_len=len(prompts[0]), output_len=output_len)
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(60.0, read=None)) as client:
        # one request before the clock starts: a fresh client's first request pays for its connection and for
        # httpx's and anyio's lazy setup in this process (~30 ms on the 2-core VM), which is not the server's TTFT
        await client.get(f"{server_root(url)}/health")
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        cpu = time.process_time()
        records = await asyncio.gather(*(one_request(client, options, p) for p in prompts))
        cpu = time.process_time() - cpu
    return {"records": [asdict(r) for r in records], "cpu_s": cpu}


def sequential_ttft_ms(url: str, prompts: list[list[int]]) -> list[float]:
    """TTFT of single requests sent back to back from this process (the first one follows >= 1 s of idle
    server, the rest follow each other at once): the levels' one-request TTFT is one sample after an idle
    gap, this is several, so an idle GPU's slow start shows apart from the steady case. The first token is
    the first streamed chunk with a choice, text or not (a lone token may decode to no text yet)."""
    times = []
    with httpx.Client(timeout=httpx.Timeout(60.0, read=None)) as client:
        client.get(f"{server_root(url)}/health")  # the connection and the client's first-request setup, untimed
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": 1, "ignore_eos": True, "temperature": 0.0, "stream": True}
            started = time.perf_counter()
            with client.stream("POST", f"{url}/completions", json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"TTFT probe: HTTP {response.status_code}: {response.read()[:200]!r}")
                for line in response.iter_lines():
                    if line.startswith("data:") and '"choices"' in line:
                        times.append(1000 * (time.perf_counter() - started))
                        break
    return times


def run_level(pool, url: str, prompts: list[list[int]], output_len: int, streams_per_client: int) -> dict:
    procs = math.ceil(len(prompts) / streams_per_client)
    shares = [prompts[i::procs] for i in range(procs)]
    start_at = time.perf_counter() + 1.0          # time to hand every process its share
    results = pool.starmap(stream_share, [(url, share, output_len, start_at) for share in shares], chunksize=1)
    records = [RequestRecord(**r) for result in results for r in result["records"]]
    wall = max(r.end for r in records) - start_at
    cpu = [result["cpu_s"] for result in results]
    summary = summarize(records, len(prompts), wall, sum(cpu))
    summary |= {"client_procs": procs, "client_cpu_percent_max_proc": 100 * max(cpu) / wall}
    return summary
