"""The soak's report (bench/soak.py): a run's tally and memory samples summed up, printed as a table, and judged
clean or not.

Separate from the run so that what is reported, and what a clean run requires, sit in one short place.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from soak_requests import Tally  # noqa: E402


def summary(run: dict) -> dict:
    t: Tally = run["tally"]
    mem, samples = run["memory"], run["memory_samples"]

    def peak(key: str, start: int = 0, stop: int | None = None) -> float | None:
        values = [s[key] for s in samples[start:stop] if s[key] is not None]
        return max(values) if values else None

    def rss(proc: str) -> dict:
        key = f"{proc}_mb"
        return {"start": mem["start"][key], "after_reference": mem["after_reference"][key],
                "baseline": mem.get("baseline", {}).get(key),
                "peak_warmup": peak(key, 0, run["baseline_sample"]) if "baseline" in mem else None,
                "peak": peak(key, run["baseline_sample"]), "end_idle": mem["end_idle"][key]}

    return {
        "sent": sum(t.sent.values()), "sent_by_kind": dict(t.sent),
        "completed": sum(t.completed.values()), "completed_by_kind": dict(t.completed),
        "checked_equal": t.checked - len(t.mismatched) - len(t.duplicated),
        "cancelled_mid_stream": t.cancelled,
        "failed_expected": sum(t.failed.values()), "failed_by_error": dict(t.failed),
        "failed_unexpected": len(t.unexpected), "lost": len(t.lost), "duplicated": len(t.duplicated),
        "mismatched": len(t.mismatched), "retried_503": t.retried_503,
        "max_logprob_abs_diff": t.max_logprob_diff,
        "faults": dict(t.faults), "core_deaths": run["core_deaths"], "core_restarts": run["core_restarts"],
        "requests_resumed": run["resumed"], "suspects_retried_alone": run["quarantined"],
        "hung_cores_killed": run["hung_cores_killed"],
        "kv_blocks_used_end": run["kv_blocks_used_end"], "kv_blocks_total": run["kv_blocks_total"],
        "in_flight_end": run["in_flight_end"],
        "rss_mb": {"api": rss("api"), "core": rss("core")},
        "api_rss_growth_mb": growth(mem, "api_mb"), "core_rss_growth_mb": growth(mem, "core_mb"),
        "problems": {"unexpected": t.unexpected[:10], "lost": t.lost[:10], "duplicated": t.duplicated[:5],
                     "mismatched": t.mismatched[:5]},
    }


def growth(mem: dict, key: str) -> float | None:
    """RSS idle at the end against the baseline (idle after the warm-up; without one, after the reference pass).
    The core's is a later core's at the end."""
    end, base = mem["end_idle"][key], mem.get("baseline", mem["after_reference"])[key]
    return None if end is None or base is None else round(end - base, 1)


def print_table(s: dict) -> None:
    rows = [("requests sent", s["sent"]), ("completed", s["completed"]),
            ("  checked equal to the reference", s["checked_equal"]),
            ("cancelled mid-stream", s["cancelled_mid_stream"]),
            ("failed, expected", f"{s['failed_expected']} {s['failed_by_error']}"),
            ("failed, unexpected", s["failed_unexpected"]), ("lost", s["lost"]), ("duplicated", s["duplicated"]),
            ("mismatched", s["mismatched"]), ("503 retried (core restarting)", s["retried_503"]),
            ("faults", s["faults"]), ("core deaths / restarts", f"{s['core_deaths']} / {s['core_restarts']}"),
            ("requests resumed on a new core", s["requests_resumed"]),
            ("suspects retried one at a time", s["suspects_retried_alone"]),
            ("hung cores killed", s["hung_cores_killed"]),
            ("KV blocks used at the end", f"{s['kv_blocks_used_end']:g} of {s['kv_blocks_total']:g}")]
    for proc in ("api", "core"):
        r = s["rss_mb"][proc]
        rows.append((f"RSS {proc} MB (start, warm, warm-up peak, baseline, peak, end)",
                     " / ".join("-" if r[k] is None else f"{r[k]:.1f}"
                                for k in ("start", "after_reference", "peak_warmup", "baseline", "peak", "end_idle"))))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def clean(s: dict, max_rss_growth_mb: float) -> bool:
    return (s["lost"] == s["duplicated"] == s["mismatched"] == s["failed_unexpected"] == 0
            and s["kv_blocks_used_end"] == 0 and s["in_flight_end"] == 0
            and all(g is not None and g <= max_rss_growth_mb
                    for g in (s["api_rss_growth_mb"], s["core_rss_growth_mb"])))
