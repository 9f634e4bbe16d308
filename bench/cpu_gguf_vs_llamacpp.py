"""SmolLM2-135M-Instruct Q4_1 on CPU: cvllm next to llama.cpp (llama-cpp-python), same machine, same file.

    python bench/cpu_gguf_vs_llamacpp.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf \\
        --llamacpp-python /path/to/venv-with-llama-cpp-python/bin/python [--json out.json]

llama-cpp-python is not a project dependency: build it in a scratch venv (`pip install llama-cpp-python
fastapi uvicorn sse-starlette starlette-context pydantic-settings`) and point --llamacpp-python at it.

Measures (issue 4's targets: batch-1 decode ≥ 0.5× llama.cpp; 16 concurrent streams ≥ 2× llama-cpp-python's
server, which is run with --interrupt_requests False):
- batch-1 decode tok/s: a 32-token prompt, 128 greedy tokens, decode time only (after the first token);
- 16 concurrent streamed /v1/completions, 128 tokens each, EOS suppressed with logit_bias on both servers:
  total output tok/s over the wall time of the round.
Both sides use 2 threads (the CI/dev VM has 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

PROMPT = "Write a short story about a robot who learns to paint, in the style of a fairy tale."
NEW_TOKENS = 128

LLAMACPP_BS1 = r"""
import sys, time, json
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=1024, n_threads=2, n_threads_batch=2, verbose=False)
tokens = llm.tokenize(sys.argv[2].encode())[:32]
for attempt in range(2):          # the first round warms up
    llm.reset()
    times = []
    for i, tok in enumerate(llm.generate(tokens, temp=0.0, reset=True)):
        times.append(time.perf_counter())
        if i + 1 == int(sys.argv[3]):
            break
print(json.dumps({"decode_tok_s": (len(times) - 1) / (times[-1] - times[0])}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout} s")


@contextlib.contextmanager
def served(command: list[str], env: dict, port: int, health: str, log: Path):
    """A server started from ``command`` (output to ``log``), yielded once ``health`` answers, then stopped."""
    proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(f"http://127.0.0.1:{port}{health}", proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def ours_bs1(gguf: str) -> float:
    import torch

    from cvllm import LLM, SamplingParams

    torch.set_num_threads(2)
    llm = LLM(gguf, max_num_seqs=16)
    ids = llm.get_tokenizer().encode(PROMPT)[:32]
    engine = llm.llm_engine
    rates = []
    for attempt in range(2):  # the first round warms up
        engine.add_request(f"bs1-{attempt}", ids, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        times = []
        while engine.has_unfinished():
            if engine.step():
                times.append(time.perf_counter())
        engine.release_request(f"bs1-{attempt}")
        rates.append((len(times) - 1) / (times[-1] - times[0]))
    return rates[-1]


async def concurrent_round(base: str, n: int, eos_ids: list[int]) -> dict:
    body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "logit_bias": {str(i): -100 for i in eos_ids}}

    async def one(client: httpx.AsyncClient) -> tuple[int, float]:
        started, first, chunks = time.perf_counter(), None, 0
        async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                    event = json.loads(line[5:])
                    if any(c.get("text") for c in event.get("choices") or []):
                        chunks += 1
                        first = first or time.perf_counter()
        return chunks, (first or started) - started

    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=n)) as client:
        await one(client)  # warm-up
        started = time.perf_counter()
        results = await asyncio.gather(*(one(client) for _ in range(n)))
        wall = time.perf_counter() - started
    chunks = sum(c for c, _ in results)
    ttfts = sorted(t for _, t in results)
    return {"streams": n, "wall_s": wall, "text_chunks": chunks, "output_tok_s": n * NEW_TOKENS / wall,
            "ttft_p50_s": ttfts[len(ttfts) // 2]}


def serve_and_load(command: list[str], port: int, n: int, eos_ids: list[int], log: Path,
                   health: str) -> dict:
    with served(command, {**os.environ, "OMP_NUM_THREADS": "2"}, port, health, log) as url:
        return asyncio.run(concurrent_round(url, n, eos_ids))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--llamacpp-python", required=True, help="a python with llama-cpp-python[server] installed")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--json")
    args = ap.parse_args()
    eos_ids = [0, 2]  # SmolLM2: <|endoftext|>, <|im_end|>

    ours = {"bs1_decode_tok_s": ours_bs1(args.gguf)}
    out = subprocess.run([args.llamacpp_python, "-c", LLAMACPP_BS1, args.gguf, PROMPT, str(NEW_TOKENS)],
                         capture_output=True, text=True, check=True)
    theirs = {"bs1_decode_tok_s": json.loads(out.stdout.strip().splitlines()[-1])["decode_tok_s"]}

    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        ours[f"c{args.streams}"] = serve_and_load(
            [sys.executable, "-m", "cvllm.server.cli", "--w", args.gguf, "--p", str(port), "--log", "warning",
             "--max-num-seqs", str(args.streams)], port, args.streams, eos_ids,
            Path(tmp) / "cvserve.log", "/health")
        port = free_port()
        theirs[f"c{args.streams}"] = serve_and_load(
            [args.llamacpp_python, "-m", "llama_cpp.server", "--model", args.gguf, "--port", str(port),
             "--n_threads", "2", "--n_ctx", "4096", "--interrupt_requests", "False"], port, args.streams,
            eos_ids, Path(tmp) / "llamacpp.log", "/v1/models")

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    c = f"c{args.streams}"
    report = {"bench": "cpu_gguf_vs_llamacpp", "model": Path(args.gguf).name, "threads": 2, "commit": commit,
              "command": "python bench/cpu_gguf_vs_llamacpp.py --gguf GGUF --llamacpp-python PYTHON",
              "measured": {"bs1_decode_tok_s": ours["bs1_decode_tok_s"], f"{c}_output_tok_s": ours[c]["output_tok_s"]},
              "reference": {"llamacpp_bs1_decode_tok_s": theirs["bs1_decode_tok_s"],
                            f"llamacpp_server_{c}_output_tok_s": theirs[c]["output_tok_s"]},
              "ours": ours, "llamacpp": theirs}
    print(f"{'':28} {'cvllm':>10} {'llama.cpp':>10} {'ratio':>6}")
    print(f"{'batch-1 decode tok/s':28} {ours['bs1_decode_tok_s']:>10.1f} {theirs['bs1_decode_tok_s']:>10.1f} "
          f"{ours['bs1_decode_tok_s'] / theirs['bs1_decode_tok_s']:>6.2f}")
    print(f"{f'{args.streams} streams total tok/s':28} {ours[c]['output_tok_s']:>10.1f} "
          f"{theirs[c]['output_tok_s']:>10.1f} {ours[c]['output_tok_s'] / theirs[c]['output_tok_s']:>6.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
