"""The demo GGUF on the CPU through cvserve and llama-cpp-python's server side by side (issue 24, item 3), with the
offline figures of both beside the HTTP ones, and the HTTP path's cost per token at batch 1 (item 4).

    python bench/cpu_servers_vs_llamacpp.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --json out.json
    # the AVX2 stand-in on an AVX-512 machine: torch's AVX2 kernels, llama.cpp built for AVX2 only
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/cpu_servers_vs_llamacpp.py --gguf FILE \\
        --llamacpp-pythonpath DIR_OF_THE_AVX2_BUILD --json out.json

llama-cpp-python is not a project dependency: ``pip install 'llama-cpp-python[server]'`` (a native build); for the
AVX2 stand-in ``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF" pip install --no-cache-dir
--no-deps --target DIR llama-cpp-python`` and pass ``--llamacpp-pythonpath DIR``. 2 threads on both sides: cvserve's
engine core with OMP_NUM_THREADS=2, llama.cpp with ``--n_threads 2``.

Measured, each a median of ``--rounds`` rounds after a warm-up:
- batch 1 through each server: one streamed /v1/completions of 128 greedy tokens (EOS suppressed with logit_bias),
  decode tok/s = (chunks - 1) / (last chunk - first chunk);
- 16 concurrent streams through each server: total output tok/s over the round's wall time;
- offline: cvllm's engine stepped directly (batch 1; and 16 sequences at once), llama.cpp's ``Llama.generate``
  (batch 1; its Python API has no batching);
- item 4: the HTTP path's cost per token at batch 1 = 1 / HTTP decode rate - 1 / offline decode rate, as a share
  of the offline step.
The load average before and after is recorded: on this 2-core VM other work moves both sides.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import free_port, git_commit  # noqa: E402
from cpu_gguf_vs_llamacpp import LLAMACPP_BS1, PROMPT, served  # noqa: E402

NEW_TOKENS = 128
EOS_IDS = [0, 2]  # SmolLM2: <|endoftext|>, <|im_end|>


def ours_offline(gguf: str, rounds: int) -> dict:
    import torch

    from cvllm import LLM, SamplingParams

    torch.set_num_threads(2)
    llm = LLM(gguf, max_num_seqs=16)
    ids = llm.get_tokenizer().encode(PROMPT)[:32]
    engine = llm.llm_engine

    def decode_rate(n: int, tag: str) -> float:
        for i in range(n):
            engine.add_request(f"{tag}-{i}", ids, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        times = []
        while engine.has_unfinished():
            if engine.step():
                times.append(time.perf_counter())
        for i in range(n):
            engine.release_request(f"{tag}-{i}")
        return n * (len(times) - 1) / (times[-1] - times[0])   # decode steps after the first token's

    decode_rate(1, "warm")
    bs1 = [decode_rate(1, f"bs1-{r}") for r in range(rounds)]
    c16 = [decode_rate(16, f"c16-{r}") for r in range(rounds)]
    llm.shutdown()
    return {"bs1_decode_tok_s": statistics.median(bs1), "bs1_rounds": bs1,
            "c16_decode_tok_s": statistics.median(c16), "c16_rounds": c16}


def llamacpp_offline(python: str, gguf: str, env: dict, rounds: int) -> dict:
    rates = []
    for _ in range(rounds):
        out = subprocess.run([python, "-c", LLAMACPP_BS1, gguf, PROMPT, str(NEW_TOKENS)], capture_output=True,
                             text=True, check=True, env=env)
        rates.append(json.loads(out.stdout.strip().splitlines()[-1])["decode_tok_s"])
    return {"bs1_decode_tok_s": statistics.median(rates), "bs1_rounds": rates}


async def stream_one(client: httpx.AsyncClient, base: str) -> list[float]:
    """Arrival times of the text chunks of one streamed completion."""
    body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True,
            "logit_bias": {str(i): -100 for i in EOS_IDS}}
    times = []
    async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                if any(c.get("text") for c in json.loads(line[5:]).get("choices") or []):
                    times.append(time.perf_counter())
    return times


async def load_server(base: str, streams: int, rounds: int) -> dict:
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=streams)) as client:
        await stream_one(client, base)   # warm-up
        bs1 = []
        for _ in range(rounds):
            times = await stream_one(client, base)
            bs1.append((len(times) - 1) / (times[-1] - times[0]))
        many = []
        for _ in range(rounds):
            started = time.perf_counter()
            results = await asyncio.gather(*(stream_one(client, base) for _ in range(streams)))
            wall = time.perf_counter() - started
            many.append(sum(len(t) for t in results) / wall)
    return {"bs1_decode_tok_s": statistics.median(bs1), "bs1_rounds": bs1,
            f"c{streams}_output_tok_s": statistics.median(many), f"c{streams}_rounds": many}


def serve(command: list[str], env: dict, health: str, port: int, streams: int, rounds: int, log: Path) -> dict:
    with served(command, env, port, health, log) as url:
        return asyncio.run(load_server(url, streams, rounds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--llamacpp-python", default=sys.executable, help="a python with llama-cpp-python[server]")
    ap.add_argument("--llamacpp-pythonpath", help="put this llama-cpp-python build first on llama.cpp's path")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llamacpp-server-threads", type=int, default=2,
                    help="llama.cpp's server threads (1: its HTTP thread and the client keep a core of the two)")
    ap.add_argument("--json")
    args = ap.parse_args()
    load_before = os.getloadavg()
    ours_env = {**os.environ, "OMP_NUM_THREADS": "2"}
    theirs_env = dict(os.environ)
    if args.llamacpp_pythonpath:
        theirs_env["PYTHONPATH"] = os.pathsep.join(p for p in (args.llamacpp_pythonpath,
                                                                os.environ.get("PYTHONPATH")) if p)

    ours = {"offline": ours_offline(args.gguf, args.rounds)}
    theirs = {"offline": llamacpp_offline(args.llamacpp_python, args.gguf, theirs_env, args.rounds)}
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        ours["http"] = serve([sys.executable, "-m", "cvllm.server.cli", "--w", args.gguf, "--p", str(port), "--log",
                              "warning", "--max-num-seqs", str(args.streams)], ours_env, "/health", port,
                             args.streams, args.rounds, Path(tmp) / "cvserve.log")
        port = free_port()
        theirs["http"] = serve([args.llamacpp_python, "-m", "llama_cpp.server", "--model", args.gguf, "--port",
                                str(port), "--n_threads", str(args.llamacpp_server_threads), "--n_threads_batch",
                                str(args.llamacpp_server_threads), "--n_ctx", "4096",
                                "--interrupt_requests", "False"], theirs_env, "/v1/models", port, args.streams,
                               args.rounds, Path(tmp) / "llamacpp.log")
    c = f"c{args.streams}_output_tok_s"
    http_step, offline_step = 1 / ours["http"]["bs1_decode_tok_s"], 1 / ours["offline"]["bs1_decode_tok_s"]
    report = {
        "bench": "cpu_servers_vs_llamacpp", "model": Path(args.gguf).name, "threads": 2, "commit": git_commit(),
        "command": " ".join(["python bench/cpu_servers_vs_llamacpp.py --gguf GGUF",
                             "--llamacpp-pythonpath LLAMACPP_BUILD" if args.llamacpp_pythonpath else "",
                             f"--streams {args.streams} --rounds {args.rounds}",
                             f"--llamacpp-server-threads {args.llamacpp_server_threads}"
                             if args.llamacpp_server_threads != 2 else ""]).replace("  ", " ").strip(),
        "env": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if k in os.environ},
        "load_before": load_before, "load_after": os.getloadavg(),
        "ratios": {"bs1_http": ours["http"]["bs1_decode_tok_s"] / theirs["http"]["bs1_decode_tok_s"],
                   "bs1_offline": ours["offline"]["bs1_decode_tok_s"] / theirs["offline"]["bs1_decode_tok_s"],
                   f"c{args.streams}_http": ours["http"][c] / theirs["http"][c]},
        "http_cost_per_token_ms": (http_step - offline_step) * 1e3,
        "http_cost_share_of_step": (http_step - offline_step) / offline_step,
        "cvllm": ours, "llamacpp": theirs}
    rows = [("batch-1 HTTP decode tok/s", ours["http"]["bs1_decode_tok_s"], theirs["http"]["bs1_decode_tok_s"]),
            ("batch-1 offline decode tok/s", ours["offline"]["bs1_decode_tok_s"],
             theirs["offline"]["bs1_decode_tok_s"]),
            (f"{args.streams} streams HTTP tok/s", ours["http"][c], theirs["http"][c]),
            (f"{args.streams} seqs offline decode tok/s", ours["offline"]["c16_decode_tok_s"], float("nan"))]
    print(f"{'':32} {'cvllm':>10} {'llama.cpp':>10} {'ratio':>6}")
    for name, a, b in rows:
        print(f"{name:32} {a:>10.1f} {b:>10.1f} {a / b:>6.2f}")
    print(f"HTTP cost per token at batch 1: {report['http_cost_per_token_ms']:.2f} ms "
          f"({report['http_cost_share_of_step']:.1%} of the offline step); load {load_before[0]:.2f} -> "
          f"{report['load_after'][0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
