"""Where a batch-1 speculative run's steps go (issue 22): for each kind of step (plain decode, verify), how many,
the host's milliseconds by phase, the device's time for the forward pass and the whole step, and how long the
device sat idle before the step's first operation (host-bound steps show it there).

    python bench/spec_steps.py [--k 4] [--task rewrite] [--sync] [--profile] [--cprofile]

The demo model on bench/speculative.py's tasks, plain and with n-gram drafts, the engine's default scheduling
(async on CUDA) unless ``--sync``. Device times come from backend events at the step's marks
(cvllm/engine/observers.py), so on the CPU only the host columns mean anything. ``--profile`` (CUDA) runs each once
more under the torch profiler and lists the kernels on the device's critical path, per launched step;
``--cprofile`` once more under cProfile: the host's functions by own and cumulative time (where a synchronous verify
step's host time goes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from latency import print_profile  # noqa: E402
from profile_decode import report_critical_path  # noqa: E402
from speculative import TASKS  # noqa: E402
from step_timeline import Records  # noqa: E402

from cvllm import LLM, SamplingParams  # noqa: E402
from cvllm.testing.requirements import demo_model  # noqa: E402


def kind(record, k: int) -> str:
    if not record.num_seqs:
        return "readback only"
    if record.num_prefill_tokens > k + 1 or (record.num_prefill_tokens and record.num_decodes):
        return "prefill"
    if record.lagged:   # (device drafts: launched a step behind, before the verify step it follows was read back)
        return "lagged verify"
    return "verify" if record.num_prefill_tokens else "decode"


def table(records, k: int) -> str:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    rows: dict[str, dict[str, list[float]]] = {}
    previous_end = None
    for record in records:
        marks = {label: event for label, _, event in record.device}
        row = rows.setdefault(kind(record, k), {})
        row.setdefault("step", []).append(record.step_s * 1e3)
        for phase, seconds in record.host.items():
            row.setdefault(phase, []).append(seconds * 1e3)
        if {"launch", "forward", "forwarded", "sampled"} <= marks.keys():
            row.setdefault("gpu fwd", []).append(marks["forward"].elapsed_time(marks["forwarded"]))
            row.setdefault("gpu step", []).append(marks["launch"].elapsed_time(marks["sampled"]))
            if previous_end is not None:
                row.setdefault("gpu idle", []).append(max(0.0, previous_end.elapsed_time(marks["launch"])))
            previous_end = marks["sampled"]
    columns = ["step", "schedule", "prepare", "forward", "sample", "advance", "wait", "finish",
               "gpu fwd", "gpu step", "gpu idle"]
    lines = [f"{'kind':<15}{'n':>5}" + "".join(f"{c:>10}" for c in columns) + "   (median ms)"]
    for name, row in rows.items():
        n = len(row["step"])
        lines.append(f"{name:<15}{n:>5}" + "".join(
            f"{statistics.median(row[c]):>10.3f}" if row.get(c) else f"{'':>10}" for c in columns))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--task", default="rewrite", choices=sorted(TASKS))
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--sync", action="store_true", help="synchronous steps (the CPU's default)")
    ap.add_argument("--profile", action="store_true", help="also the device's kernels, per launched step (CUDA)")
    ap.add_argument("--cprofile", action="store_true", help="also the host's functions (cProfile of one more run)")
    ap.add_argument("--device-drafts", action="store_true",
                    help="n-gram drafts looked up on the device, verify steps launched a step behind (ngram_device.py)")
    args = ap.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if args.device_drafts:
        spec["device_drafts"] = True
    prompt = [[{"role": "user", "content": TASKS[args.task]}]]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for name, config in (("plain", None), ("ngram", spec)):
        llm = LLM(str(demo_model()), speculative_config=config, async_scheduling=False if args.sync else None)
        for _ in range(2):
            llm.chat(prompt, params)
        engine = llm.llm_engine
        stats = engine.stats
        before = (stats.steps, stats.spec_guesses, stats.spec_guess_misses)
        with engine.observers.observing(Records()) as records:
            out = llm.chat(prompt, params)
        steps, guesses, misses = (a - b for a, b in zip((stats.steps, stats.spec_guesses, stats.spec_guess_misses),
                                                          before))
        print(f"\n{name}: {len(out[0].outputs[0].token_ids)} tokens, {steps} steps, async "
              f"{engine.async_scheduling}, guesses {guesses} (wrong {misses})")
        print(table(records.records, args.k))
        if args.profile and torch.cuda.is_available():
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                llm.chat(prompt, params)
                torch.cuda.synchronize()
            report_critical_path(prof, sum(1 for r in records.records if r.num_seqs), top=30)
        if args.cprofile:
            print(f"\n{name}: cProfile of one run ({steps} steps)")
            print_profile(lambda llm=llm: llm.chat(prompt, params), "tottime", "cumulative", rows=30)
        llm.shutdown()


if __name__ == "__main__":
    main()
