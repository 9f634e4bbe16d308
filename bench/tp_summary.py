"""Tensor parallelism against one GPU, from result files of bench/latency.py and bench/serving.py run at several
``--tensor-parallel-size``s (bench/device/run_all.sh tp): batch-1 decode tok/s and the largest serving level's output
tok/s per size, their ratio to the smallest size present, and issue 17's targets for TP=2 against TP=1 (batch-1
decode >= 1.6x, 256 streams >= 1.7x).

    python bench/tp_summary.py --json $OUT/summary.json $OUT/*-{latency,serving}-tp*-<commit>.json

A file that is missing or unreadable (a step that failed or ran out of time) is named and left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# (figure, tensor-parallel size against TP=1): the least ratio issue 17 (item 9) asks for, on this shape
TARGET_SHAPE = "llama3-8b"
TARGETS = {("bs1_decode_tok_s", 2): 1.6, ("c256_output_tok_s", 2): 1.7}


def figures(result: dict) -> dict[str, float]:
    """The figures a result file contributes: batch-1 decode (latency.py), the largest level's output tok/s
    through cvserve and the offline engine's (serving.py)."""
    measured = result.get("measured", {})
    if result.get("bench") == "latency":
        return {"bs1_decode_tok_s": measured["bs1_decode_tok_s"]} if "bs1_decode_tok_s" in measured else {}
    if result.get("bench") == "serving":
        out = {}
        levels = result.get("workload", {}).get("levels") or []
        if levels and f"c{max(levels)}_output_tok_s" in measured:
            out[f"c{max(levels)}_output_tok_s"] = measured[f"c{max(levels)}_output_tok_s"]
        for key, value in result.get("reference", {}).items():
            if key.startswith("offline_"):
                out[key] = value
        return out
    return {}


def summarize(paths: list[Path]) -> dict:
    table: dict[str, dict[int, float]] = {}   # figure -> tensor-parallel size -> value
    shapes, commits, devices, missing, sources = set(), set(), set(), [], {}
    for path in paths:
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            missing.append(f"{path} ({type(e).__name__})")
            continue
        size = int(result.get("tensor_parallel_size", 1))
        shapes.add(result.get("shape"))
        commits.add(result.get("commit"))
        devices.add(result.get("device") or result.get("gpu"))
        for key, value in figures(result).items():
            table.setdefault(key, {})[size] = value
            sources[f"{key}@tp{size}"] = {"file": path.name, "command": result.get("command")}
    rows = []
    for key, by_size in table.items():
        base = min(by_size)
        for size in sorted(by_size):
            row = {"figure": key, "tensor_parallel_size": size, "value": by_size[size]}
            if size != base:
                row["against_tp"] = base
                row["ratio"] = by_size[size] / by_size[base]
                target = TARGETS.get((key, size)) if base == 1 and shapes == {TARGET_SHAPE} else None
                if target is not None:
                    row["target"] = target
                    row["met"] = row["ratio"] >= target
            rows.append(row)
    return {"bench": "tp_summary", "shapes": sorted(s for s in shapes if s), "commits": sorted(c for c in commits if c),
            "devices": sorted(d for d in devices if d), "rows": rows, "missing": missing, "sources": sources}


def print_table(summary: dict) -> None:
    print(f"\ntensor parallelism: {', '.join(summary['shapes']) or '?'} on {', '.join(summary['devices']) or '?'} "
          f"at {', '.join(summary['commits']) or '?'}")
    print(f"{'figure':>24} {'TP':>3} {'tok/s':>10} {'ratio':>7} {'target':>8}")
    for row in summary["rows"]:
        ratio = f"{row['ratio']:.2f}x" if "ratio" in row else ""
        target = ""
        if "target" in row:
            target = f">= {row['target']}x {'met' if row['met'] else 'NOT met'}"
        print(f"{row['figure']:>24} {row['tensor_parallel_size']:>3} {row['value']:>10.1f} {ratio:>7} {target}")
    for name in summary["missing"]:
        print(f"missing: {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="latency.py / serving.py result files")
    ap.add_argument("--command", help="the command that produced them (recorded in the summary)")
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args()
    summary = summarize(args.results)
    summary["command"] = args.command or "python " + " ".join(sys.argv)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    print_table(summary)


if __name__ == "__main__":
    main()
