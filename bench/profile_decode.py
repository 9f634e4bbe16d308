"""Where a decode step's time goes at a given batch size: torch profiler over a few engine steps (GPU kernels
by total time, and the host's share), on a random-weight model.

    python bench/profile_decode.py --batch 256 --context 1024          # on the GPU machine
    python bench/profile_decode.py --tiny                               # a CPU rehearsal
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from common import graph_replay_ms  # noqa: E402
from host_timers import HostTimers  # noqa: E402
from random_checkpoint import random_checkpoint, shape_config  # noqa: E402

from cvllm.engine.build import build_engine  # noqa: E402
from cvllm.engine.config import EngineConfig  # noqa: E402
from cvllm.engine.llm_engine import LLMEngine  # noqa: E402
from cvllm.sampling_params import SamplingParams  # noqa: E402


def report_syncs(engine: LLMEngine, steps: int) -> None:
    """Each place that made the host wait for the GPU during ``steps`` engine steps, with its count. One
    wait per step is expected (reading the sampled ids back); more means a step cannot overlap the next."""
    import collections
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            engine.step()
    torch.cuda.set_sync_debug_mode("default")
    places = collections.Counter(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    print(f"host waits in {steps} steps: {sum(places.values())}")
    for place, count in places.most_common(12):
        print(f"  {count:4d}  {place}")


def report_gpu_gaps(prof, steps: int, top: int = 8) -> None:
    """Where the GPU sat idle in the profiled steps: the gaps between consecutive kernels and copies (CUPTI's
    device events, graph replays included), summed, and the largest by the pair of names around them. The
    profiler slows the host's launches, so the gaps around a step's pre-graph operations read larger here than
    without it (at 256 rows, ~0.5 ms a step here against ~35 us in ``--timeline``)."""
    import collections

    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA)
    if not spans:
        return
    by_pair, total, busy_until, last = collections.Counter(), 0.0, spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start > busy_until:
            gap = start - busy_until
            total += gap
            by_pair[f"{last[:40]} -> {name[:40]}"] += gap
        if end >= busy_until:
            busy_until, last = end, name
    wall = busy_until - spans[0][0]
    print(f"GPU idle between kernels: {total / steps:.1f} us a step ({total / wall:.1%} of {wall / steps:.0f} us)")
    for pair, gap in by_pair.most_common(top):
        print(f"  {gap / steps:8.1f} us a step  {pair}")


def report_critical_path(prof, steps: int, top: int = 16) -> None:
    """What each kernel adds to a step's GPU time: kernels sorted by their end, each charged the time from the
    previous one's end to its own (from its start, if the GPU was idle in between). With programmatic dependent
    launch a kernel starts while its predecessor runs and waits inside, so its own duration (the table above)
    counts that wait too; the end-to-end deltas do not."""
    import collections

    from torch.autograd import DeviceType

    spans = sorted((e.time_range.end, e.time_range.start, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA)
    if not spans:
        return
    charged, calls, last_end = collections.Counter(), collections.Counter(), spans[0][1]
    for end, start, name in spans:
        charged[name[:60]] += end - max(start, last_end) if end > last_end else 0.0
        calls[name[:60]] += 1
        last_end = max(last_end, end)
    busy = sum(charged.values())
    print(f"critical path: {busy / steps:.1f} us of GPU work a step, by kernel (us a step, calls a step, us a call):")
    for name, t in charged.most_common(top):
        print(f"  {t / steps:8.1f}  {calls[name] / steps:6.1f}  {t / calls[name]:7.2f}  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--phase", choices=["decode", "prefill"], default="decode",
                    help="prefill: profile the steps that prefill the batch's prompts (budget-sized mixed steps)")
    ap.add_argument("--cprofile", action="store_true", help="prefill phase: cProfile the host instead")
    ap.add_argument("--timeline", action="store_true",
                    help="also time the step boundary with CUDA events (bench/step_timeline.py)")
    ap.add_argument("--isq", metavar="TYPE", help="quantize the random weights in situ as they load (q4k, gptq, ...)")
    ap.add_argument("--sync-debug", action="store_true",
                    help="also run a few steps under torch's sync debug mode and list where the host waited")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    shape = "tiny" if args.tiny else args.shape
    batch, context = (8, 64) if args.tiny else (args.batch, args.context)
    dtype = torch.bfloat16
    vocab = shape_config(shape, dtype)["vocab_size"]
    engine = build_engine(EngineConfig(model=random_checkpoint(shape, dtype, device), backend=device, dtype=dtype,
                                       max_num_seqs=batch, max_model_len=context + 64 + 3 * args.steps,
                                       max_num_batched_tokens=8192, isq=args.isq))
    g = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"

    def submit(tag: str, max_tokens: int) -> None:
        params = SamplingParams(temperature=args.temperature, max_tokens=max_tokens, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"{tag}{i}", torch.randint(10, vocab, (context,), generator=g).tolist(), params)

    def prefilling() -> bool:
        return bool(engine.scheduler.waiting) or any(s.num_computed_tokens < s.num_prompt_tokens
                                                     for s in engine.scheduler.running)

    if args.phase == "prefill":
        submit("warm", 1)             # compiles every kernel variant the prefill steps use
        while engine.has_unfinished():
            engine.step()
        submit("", 64)
        timers = HostTimers(engine)
        sync()
        started, steps = time.perf_counter(), 0
        if args.cprofile:
            import cProfile
            import pstats
            profiler = cProfile.Profile()
            prof = contextlib.nullcontext()
            profiler.enable()
        else:
            prof = profile(activities=activities)
        with prof, timers.installed():
            while prefilling():
                engine.step()
                steps += 1
            sync()
        wall = time.perf_counter() - started
        if args.cprofile:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        else:
            print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
        print(timers.table(steps))
        print(f"{shape} on {device}: {batch} prompts of {context} tokens prefilled in {steps} steps, "
              f"{wall * 1e3:.1f} ms ({batch * context / wall:.0f} prompt tok/s, profiler on)")
        return

    submit("", 64)
    while prefilling():
        engine.step()
    for _ in range(3):
        engine.step()
    sync()                     # no synchronisation per step: async scheduling overlaps consecutive steps
    started = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync()
    wall = (time.perf_counter() - started) / args.steps
    timers = HostTimers(engine)
    with timers.installed():
        for _ in range(args.steps):
            engine.step()
        sync()
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        sync()
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
    if device == "cuda":
        report_gpu_gaps(prof, args.steps)
        report_critical_path(prof, args.steps)
    print(timers.table(args.steps))
    if args.timeline and device == "cuda":
        from step_timeline import step_timeline

        print(step_timeline(engine))
    if args.sync_debug and device == "cuda":
        report_syncs(engine, args.steps)
    print(f"{shape} on {device}: batch {batch}, context {context}: engine step {wall * 1e3:.2f} ms "
          f"({batch / wall:.0f} tok/s) over {args.steps} steps; profiled {args.steps} more above")
    replay_ms = graph_replay_ms(engine, batch)   # its buffers hold the last step's inputs
    if replay_ms is not None:
        print(f"decode graph replayed alone: {replay_ms:.2f} ms; GPU idle share {1 - replay_ms / (wall * 1e3):.1%} "
              f"(what the host's work between steps and the inputs' copies cost)")

if __name__ == "__main__":
    main()
