"""Start-up time of ``cvserve``: from launching the command to the first healthy ``/health``, with the engine's
own one-line breakdown (imports, checkpoint, weights, KV cache, graphs) from its log.

    python bench/startup.py                               # the demo model, 3 starts
    python bench/startup.py --write-random llama3-8b --model /tmp/llama3-8b --runs 2 --json out.json

The first start reads the weights from disk; later ones find them in the page cache (the figure the targets use:
demo model <= 5 s on an idle 2-core machine, an 8B bf16 checkpoint <= 15 s on the H200, graphs included).
``--write-random SHAPE`` first writes a random checkpoint of that shape (random_checkpoint.py) with the tests'
tiny tokenizer to ``--model``. Arguments after ``--`` go to cvserve.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import command_line, free_port, git_commit, stop_cvserve  # noqa: E402

BREAKDOWN = re.compile(r"engine started in (.*)$", re.M)


def start_once(flags: list[str], log_path: Path, timeout: float) -> tuple[float, str | None]:
    """Seconds from launch to a healthy /health, and the engine's breakdown line."""
    port = free_port()
    started = time.perf_counter()
    with log_path.open("w") as log_file:
        server = subprocess.Popen([sys.executable, "-m", "cvllm.server.cli", "--p", str(port), *flags],
                                  stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"cvserve exited with {server.returncode}:\n{log_path.read_text()[-4000:]}")
            if time.perf_counter() - started > timeout:
                raise RuntimeError(f"cvserve not healthy within {timeout} s:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    elapsed = time.perf_counter() - started
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
    finally:
        stop_cvserve(server)
    match = BREAKDOWN.search(log_path.read_text())
    return elapsed, match[1] if match else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint path (default: the demo model)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--write-random", metavar="SHAPE", help="first write a random checkpoint of this shape")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("cvserve_args", nargs="*", help="after --: more cvserve flags")
    args = parser.parse_args()
    if args.write_random:
        import torch
        from random_checkpoint import write_random_llama

        from cvllm.testing.tokenizer import write_tiny_tokenizer

        began = time.perf_counter()
        path = write_random_llama(Path(args.model), args.write_random,
                                  device="cuda" if torch.cuda.is_available() else "cpu")
        write_tiny_tokenizer(path)
        print(f"wrote a random {args.write_random} to {path} in {time.perf_counter() - began:.0f} s")
    flags = (["--w", args.model] if args.model else []) + args.cvserve_args
    runs = []
    with tempfile.TemporaryDirectory() as logs:
        for run in range(args.runs):
            seconds, breakdown = start_once(flags, Path(logs) / f"run{run}.log", args.timeout)
            runs.append({"run": run, "ready_s": round(seconds, 2), "engine": breakdown})
            print(f"start {run}: healthy in {seconds:.2f} s (engine {breakdown})", flush=True)
    result = {"bench": "startup", "commit": git_commit(), "command": command_line(), "model": args.model or "demo",
              "host": platform.node(), "runs": runs}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
