"""Decode step time on the CPU backend by context and batch (issue 24): the decode rows' attention fused (SDPA over
the gathered blocks, backends/cpu_decode.py) against the float32 reference (``CpuBackend.fused_decode = False``),
in one run, on one engine, over the same prompts (prefilled once, then prefix-cache hits).

    python bench/cpu_decode_attention.py --model tiny --json bench/results/2026-12-03-cpu-decode_attention-tiny.json
    python bench/cpu_decode_attention.py --model demo --contexts 128,1024,4096 --batches 1,16

Each (batch, context) runs the prompts to ``--short`` and to ``--short + --steps`` new tokens; a step's time is the
difference over the difference in engine steps (the prefill and each run's start cancel out), the median of
``--repeats`` rounds, fused and reference rounds interleaved. The machine is shared: the 1-minute load average
is recorded beside every figure, and a round that starts above ``--max-load`` waits for it to fall (up to
``--patience`` seconds).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import git_commit  # noqa: E402
from random_checkpoint import SHAPES, random_checkpoint  # noqa: E402

from cvllm import LLM, SamplingParams  # noqa: E402
from cvllm.backends.cpu import CpuBackend  # noqa: E402


def wait_for_quiet(max_load: float, patience_s: float) -> float:
    deadline = time.monotonic() + patience_s
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        time.sleep(2)
    return os.getloadavg()[0]


def timed(llm: LLM, prompts: list, max_tokens: int) -> tuple[float, float, int]:
    """Wall seconds, this process's CPU seconds and engine steps of one generate call."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    steps = llm.llm_engine.stats.steps
    started, cpu = time.perf_counter(), time.process_time()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - started, time.process_time() - cpu, llm.llm_engine.stats.steps - steps


def step_ms(llm: LLM, prompts: list, short: int, steps: int) -> tuple[float, float]:
    """A decode step's wall and CPU milliseconds. With one thread the CPU time is the work done, whatever else
    runs on the machine; with more, OpenMP's waiting threads spin and count too."""
    short_s, short_cpu, short_steps = timed(llm, prompts, short)
    long_s, long_cpu, long_steps = timed(llm, prompts, short + steps)
    n = long_steps - short_steps
    return 1e3 * (long_s - short_s) / n, 1e3 * (long_cpu - short_cpu) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="'tiny' (random_checkpoint.py's shape, float32) or 'demo'")
    ap.add_argument("--contexts", default="128,1024,4096")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--short", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-load", type=float, default=1.5)
    ap.add_argument("--patience", type=float, default=300.0, help="seconds a round waits for the load to fall")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's, the core count)")
    ap.add_argument("--json")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    if args.model == "tiny":
        SHAPES["tiny-8k"] = dict(SHAPES["tiny"], max_position_embeddings=8192)   # contexts past tiny's 2048
        model, vocab, kwargs = random_checkpoint("tiny-8k", torch.float32, "cpu"), 500, {"dtype": "float32"}
    else:
        from cvllm.testing.requirements import demo_model
        model, vocab, kwargs = str(demo_model()), 49000, {}
    max_len = max(contexts) + args.short + args.steps + 16
    llm = LLM(model, max_num_seqs=max(batches), max_model_len=max_len, max_num_batched_tokens=max(max_len, 4096),
              **kwargs)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = str(next(llm.llm_engine.runner.model.parameters()).dtype).removeprefix("torch.")
    rows = []
    try:
        for context in contexts:
            for batch in batches:
                # distinct prompts (no blocks shared between sequences), prefilled once and then served from the
                # prefix cache, so every round's prefill is one partial block
                prompts = [{"prompt_token_ids": [(7 + b * 131 + t * 31 + (t * t) % 97) % vocab + 1
                                                 for t in range(context - 1)]} for b in range(batch)]
                timed(llm, prompts, args.short)
                row = {"context": context, "batch": batch}
                for _ in range(args.repeats):
                    for name, fused in (("reference", False), ("fused", True)):
                        CpuBackend.fused_decode = fused
                        load = wait_for_quiet(args.max_load, args.patience)
                        wall, cpu = step_ms(llm, prompts, args.short, args.steps)
                        row.setdefault(f"{name}_ms", []).append(round(wall, 3))
                        row.setdefault(f"{name}_cpu_ms", []).append(round(cpu, 3))
                        row.setdefault(f"{name}_load", []).append(round(load, 2))
                for name in ("reference", "fused"):
                    row[f"{name}_median_ms"] = round(statistics.median(row[f"{name}_ms"]), 3)
                    row[f"{name}_median_cpu_ms"] = round(statistics.median(row[f"{name}_cpu_ms"]), 3)
                row["speedup"] = round(row["reference_median_ms"] / row["fused_median_ms"], 2)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        CpuBackend.fused_decode = True
        llm.shutdown()
    print(f"\n{args.model} ({dtype}), torch threads {torch.get_num_threads()}: decode ms/step, median of "
          f"{args.repeats}")
    print(f"{'context':>8}{'batch':>6}{'reference':>11}{'fused':>9}{'speedup':>9}   spread (min-max) ref / fused"
          "   CPU ms ref / fused   load")
    for r in rows:
        print(f"{r['context']:>8}{r['batch']:>6}{r['reference_median_ms']:>11}{r['fused_median_ms']:>9}"
              f"{r['speedup']:>9}   {min(r['reference_ms'])}-{max(r['reference_ms'])} / "
              f"{min(r['fused_ms'])}-{max(r['fused_ms'])}   {r['reference_median_cpu_ms']} / "
              f"{r['fused_median_cpu_ms']}   {max(r['reference_load'] + r['fused_load'])}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "benchmark": "cpu_decode_attention", "commit": git_commit(), "date": datetime.date.today().isoformat(),
            "device": "cpu", "model": args.model, "dtype": dtype, "threads": torch.get_num_threads(),
            "command": " ".join(["python", "bench/cpu_decode_attention.py", *sys.argv[1:]]),
            "note": "the tree had uncommitted changes (backends/cpu_decode.py) on top of this commit",
            "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
