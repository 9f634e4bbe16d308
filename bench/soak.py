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
from datetime import UTC, datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import git_commit  # noqa: E402
from soak_report import clean, print_table, summary  # noqa: E402
from soak_requests import (  # noqa: E402
    DETOKENIZE_TOKEN,
    HANG_TOKEN,
    NAN_TOKEN,
    POISON_TOKEN,
    Answer,
    Spec,
    Tally,
    catalog,
    catalog_request,
    drop_fault_tokens,
    fault_request,
    send,
)

from cvllm.testing import make_checkpoint  # noqa: E402
from cvllm.testing.server import LiveServer  # noqa: E402

FAULT_CYCLE = ("kill", "nan", "kill", "detokenize", "kill", "poison", "kill", "hang")


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
