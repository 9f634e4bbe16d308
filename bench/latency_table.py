"""Batch-1 decode of several bench/latency.py result files side by side, against the unquantized run among them
(bench/device/run_all.sh fusionslatency: bf16 and the quantized cases with switches on and off, one call): tok/s,
the ratio to bf16 (issue 18's batch-1 targets: Q4_K >= 2.0x, GPTQ >= 2.2x, Q8_0 and FP8 >= 1.6x), the GPU's time a
step and its idle share, weight memory.

    python bench/latency_table.py $OUT/*-latency-*-<commit>.json

A file that is missing or unreadable (a step that failed or ran out of time) is named and left out.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

TARGETS = {"q4k": 2.0, "gptq": 2.2, "q8_0": 1.6, "fp8": 1.6}


def case_name(path: Path) -> str:
    """The run's name: the file's stem without its date, device and commit (``2026-12-05-h200-latency-`` ...
    ``-abc1234``)."""
    stem = re.sub(r"^\d{4}-\d{2}-\d{2}-[a-z0-9]+-latency-", "", path.stem)
    return re.sub(r"-[0-9a-f]{7,40}$", "", stem)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args()
    rows = []
    for path in args.files:
        try:
            result = json.loads(path.read_text())
            measured = result["measured"]
            rows.append((case_name(path), result.get("isq"), measured["bs1_decode_tok_s"],
                         measured.get("gpu_step_ms_bs1"), measured.get("gpu_idle_share_bs1"),
                         result.get("model_memory_gb")))
        except (OSError, ValueError, KeyError) as exc:
            print(f"left out {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
    base = next((tok_s for _, isq, tok_s, *_ in rows if isq in (None, "none")), None)
    print(f"{'case':58s} {'tok/s':>7s} {'x bf16':>7s} {'target':>6s} {'GPU ms':>7s} {'idle':>5s} {'GB':>6s}")
    for name, isq, tok_s, step_ms, idle, memory in rows:
        ratio = f"{tok_s / base:7.2f}" if base else "      -"
        target = f"{TARGETS[isq]:6.1f}" if isq in TARGETS else "     -"
        step = f"{step_ms:7.3f}" if step_ms is not None else "      -"
        share = f"{idle:5.1%}" if idle is not None else "    -"
        size = f"{memory:6.2f}" if memory is not None else "     -"
        print(f"{name[:58]:58s} {tok_s:7.1f} {ratio} {target} {step} {share} {size}")


if __name__ == "__main__":
    main()
