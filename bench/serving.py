"""Serving throughput through ``cvserve`` on the H200 next to the offline engine's, Llama-3-8B shape.

    python bench/serving.py --json $OUT/serving.json      # on the H200 (one device call)
    python bench/serving.py --tiny                        # a CPU rehearsal: tiny shape, 1 and 4 streams of 32/32
    python bench/serving.py --tensor-parallel-size 2 --checkpoint /tmp/ckpt-8b --concurrency 256 --skip-hf
                                                          # over 2 GPUs: cvserve --tensor-parallel-size 2, and
                                                          # LLM(..., tensor_parallel_size=2) offline

1. Writes a random bf16 checkpoint (drawn on the device, saved as safetensors shards) plus a tokenizer
   covering its vocabulary; ``--checkpoint DIR`` keeps it there and reuses it on the next run.
2. Starts ``cvserve`` on it on 127.0.0.1, times the first token of six single requests sent one after
   another (the TTFT on an idle server that docs/benchmarks.md quotes), then, per concurrency level, opens that
   many streamed completions at once (random token-id prompts of ``--input-len``, ``--output-len`` tokens each,
   ignore_eos). The load generator is httpx in several processes (``--streams-per-client`` each) so
   that it never becomes the bottleneck; it reports its own CPU use (summed, and the busiest process).
3. Stops the server, then runs the offline engine (``LLM.generate``) in a fresh process on the same
   prompts of the largest level: the HTTP/offline ratio is what the server costs on top of the engine. The
   same process then measures transformers' ``generate`` on the config (batches of 16 and 64, 64 new
   tokens) and the copy-bandwidth ceiling (the references docs/benchmarks.md quotes).

Output tok/s = completion tokens over the wall time from the moment all streams are opened to the last
token. TTFT and inter-token gaps are per stream (a chunk may carry several tokens when the server
merges a lagging stream's deltas).

``--tensor-parallel-size N`` runs both the server and the offline engine over N ranks (one process per GPU, NCCL);
the GPU sampler still reads GPU 0 only (rank 0).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).parent
sys.path.insert(0, str(BENCH_DIR))   # the bench helpers, imported where used (the client processes need none)
from loadgen import run_level, sequential_ttft_ms  # noqa: E402

TARGETS = {"c64_output_tok_s": 6500, "c256_output_tok_s": 10000, "ratio_http_vs_offline": 0.95}


def log(message: str) -> None:
    print(f"[serving {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def prompts_for(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token ids (no shared prefix to cache); ids below 10 (the specials) are left out."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(count)]


# -- the checkpoint ------------------------------------------------------------------------------------

def write_checkpoint(path: Path, shape: str, device: str, shard_bytes: int = 2 << 30) -> None:
    """random_checkpoint's tensors (drawn on ``device``: an 8B model in seconds on a GPU, where the CPU
    draws ~10^8 normals/s) copied to the host and saved in shards with an index, plus config and tokenizer."""
    import torch
    from random_checkpoint import random_checkpoint, shape_config
    from safetensors.torch import save_file
    from serving_cpu import write_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    size = total = 0

    def flush() -> None:
        nonlocal shard, size
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard, size = {}, 0

    for name, tensor in random_checkpoint(shape, torch.bfloat16, device).weight_iterator():
        shard[name] = tensor.to("cpu")
        size += tensor.numel() * tensor.element_size()
        total += tensor.numel() * tensor.element_size()
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = shape_config(shape, torch.bfloat16)
    write_tokenizer(path, config["vocab_size"])
    # last: a checkpoint directory with a config.json is complete (measure() reuses it; a run cut short rewrites it)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if device == "cuda":
        torch.cuda.empty_cache()   # the server, another process, sizes its KV cache from what is free


# -- the server --------------------------------------------------------------------------------------

def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--dtype", "bfloat16", "--backend", args.backend, "--max-num-seqs", str(args.max_num_seqs),
             "--max-model-len", str(args.input_len + args.output_len)]
    if args.tensor_parallel_size > 1:
        flags += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.kv_cache_dtype != "auto":
        flags += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.isq:
        flags += ["--isq", args.isq]
    if args.max_num_batched_tokens:
        flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return flags


def start_server(model: Path, port: int, args: argparse.Namespace, log_path: Path) -> subprocess.Popen:
    from common import start_cvserve

    flags = ["--w", str(model), "--log", "info", *engine_flags(args)]
    return start_cvserve(flags, port, log_path, args.startup_timeout)


# -- the offline engine (a fresh process, after the server is gone) ----------------------------------

def offline_worker(spec: dict) -> dict:
    from cvllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(spec["model"], dtype="bfloat16", backend=spec["backend"], max_num_seqs=spec["max_num_seqs"],
              max_model_len=spec["input_len"] + spec["output_len"],
              max_num_batched_tokens=spec["max_num_batched_tokens"],
              tensor_parallel_size=spec.get("tensor_parallel_size", 1),
              kv_cache_dtype=spec.get("kv_cache_dtype", "auto"), isq=spec.get("isq"))
    load_s = time.perf_counter() - started
    warm = prompts_for(8, spec["input_len"], spec["vocab"], seed=1)
    llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    prompts = prompts_for(spec["concurrency"], spec["input_len"], spec["vocab"], seed=spec["concurrency"])
    params = SamplingParams(temperature=0, max_tokens=spec["output_len"], ignore_eos=True)
    from step_trace import StepTrace

    # on CUDA, events around each step: where the run's GPU time went, by phase
    trace = StepTrace(llm.llm_engine) if spec["backend"] == "cuda" else None
    with trace.installed() if trace is not None else contextlib.nullcontext():
        started = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        wall = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {"output_tok_s": tokens / wall, "output_tokens": tokens, "wall_s": wall, "load_s": load_s,
              "preemptions": llm.llm_engine.stats.preemptions}
    if trace is not None:
        result["by_phase"] = trace.phases()
    llm.shutdown()   # the other ranks' processes end here, and their devices' memory is free again
    if spec["hf_batches"]:
        del llm, outputs
        result["hf"] = hf_reference(spec)
    return result


def hf_reference(spec: dict) -> dict:
    """The references for this shape (docs/benchmarks.md), in the offline worker once its engine is gone: transformers'
    ``generate`` at the given batch sizes (prompts of the benchmark's input length, 64 new tokens) and the
    device-to-device copy rate."""
    import gc

    import torch
    from latency import copy_bandwidth_tb_s
    from random_checkpoint import hf_model
    from throughput import hf_generate_tok_s

    gc.collect()
    if spec["backend"] == "cuda":
        torch.cuda.empty_cache()
    device = spec["backend"]
    model = hf_model(spec["shape"], device)
    reference = {f"hf_generate_c{batch}_output_tok_s": hf_generate_tok_s(
        spec["shape"], batch, spec["input_len"], spec["hf_new_tokens"], device, repeats=1, model=model)["output_tok_s"]
        for batch in spec["hf_batches"]}
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
        reference["copy_tb_s"] = copy_bandwidth_tb_s()
    return reference


def run_offline(spec: dict) -> dict:
    done = subprocess.run([sys.executable, __file__, "--offline-worker", json.dumps(spec)], stdout=subprocess.PIPE,
                          text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [line for line in done.stdout.splitlines() if line.startswith("OFFLINE ")]
    if done.returncode or not lines:
        raise RuntimeError(f"the offline run failed ({done.returncode}):\n{done.stdout[-3000:]}")
    return json.loads(lines[-1].removeprefix("OFFLINE "))


# -- the run -----------------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU rehearsal: tiny shape, 1 and 4 streams of 32 in/32 out")
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--offline-concurrency", type=int, help="default: the largest level")
    ap.add_argument("--max-num-batched-tokens", type=int, help="default: the backend's")
    ap.add_argument("--streams-per-client", type=int, default=64, help="streams per load-generator process")
    ap.add_argument("--checkpoint", type=Path, help="write the random checkpoint here and keep it (reused if there)")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--skip-offline", action="store_true", help="also skips the transformers reference")
    ap.add_argument("--skip-hf", action="store_true", help="leave out the transformers reference and copy rate")
    ap.add_argument("--hf-batches", default="16,64", help="batch sizes of the transformers reference")
    ap.add_argument("--hf-new-tokens", type=int, default=64)
    ap.add_argument("--json", help="write the result file here (the server's log goes beside it)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                    help="the server and the offline engine over N ranks (GPUs; processes with gloo under --tiny)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                    help="the server's and the offline engine's KV cache (issue 18: FP8 KV at 256 streams)")
    ap.add_argument("--isq", metavar="TYPE", help="quantize the random weights in situ (q4k, gptq, fp8 ...)")
    ap.add_argument("--offline-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tiny:
        args.shape, args.concurrency, args.input_len, args.output_len = "tiny", "1,4", 32, 32
    args.backend = "cpu" if args.tiny else "cuda"
    args.levels = [int(c) for c in args.concurrency.split(",")]
    args.hf_batches = [int(b) for b in args.hf_batches.split(",")] if not args.tiny else [2]
    if args.tiny:
        args.hf_new_tokens = 8
    args.max_num_seqs = max(args.levels + [args.offline_concurrency or 0])
    args.offline_concurrency = args.offline_concurrency or max(args.levels)
    return args


def measure(args: argparse.Namespace, workdir: Path, timings: dict) -> tuple[list[dict], dict | None]:
    model = args.checkpoint or workdir / args.shape
    vocab_size = None
    if not (model / "config.json").exists():
        started = time.perf_counter()
        write_checkpoint(model, args.shape, args.backend)
        timings["checkpoint_write"] = time.perf_counter() - started
        log(f"random {args.shape} checkpoint written to {model} in {timings['checkpoint_write']:.1f}s")
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    from common import GpuSampler, free_port, process_cpu_s, stop_cvserve

    port = free_port()
    server_log = Path(args.json).with_suffix(".server.log") if args.json else workdir / "cvserve.log"
    clients = math.ceil(max(args.levels) / args.streams_per_client)
    levels = []
    with multiprocessing.get_context("spawn").Pool(clients) as pool:
        started = time.perf_counter()
        server = start_server(model, port, args, server_log)
        timings["server_start"] = time.perf_counter() - started
        log(f"cvserve healthy after {timings['server_start']:.1f}s")
        url = f"http://127.0.0.1:{port}/v1"
        try:
            # warm-up: one full-length prefill alone, then a small concurrent batch (mixed steps)
            run_level(pool, url, prompts_for(1, args.input_len, vocab_size, seed=2), 8, args.streams_per_client)
            run_level(pool, url, prompts_for(8, args.input_len, vocab_size, seed=3), 8, args.streams_per_client)
            ttft = sequential_ttft_ms(url, prompts_for(6, args.input_len, vocab_size, seed=4))
            timings["ttft_probe"] = ttft
            log(f"TTFT of {args.input_len}-token prompts sent one after another: "
                f"{', '.join(f'{t:.1f}' for t in ttft)} ms")
            for c in args.levels:
                started, cpu_before = time.perf_counter(), process_cpu_s(server.pid)
                with GpuSampler() as gpu:
                    levels.append(run_level(pool, url, prompts_for(c, args.input_len, vocab_size, seed=c),
                                            args.output_len, args.streams_per_client))
                timings[f"c{c}"] = time.perf_counter() - started
                levels[-1] |= gpu.summary
                # the server's share of a core over the level: an API process near 100% is what limits it
                api_s, engine_s = (after - before for after, before in zip(process_cpu_s(server.pid), cpu_before))
                levels[-1] |= {"server_api_cpu_percent": 100 * api_s / timings[f"c{c}"],
                               "server_engine_cpu_percent": 100 * engine_s / timings[f"c{c}"]}
                log(f"{c} streams: {levels[-1]['output_tok_per_s']:.1f} output tok/s, "
                    f"{levels[-1]['errors']} errors, {timings[f'c{c}']:.1f}s")
        finally:
            stop_cvserve(server)
    if args.skip_offline:
        return levels, None
    started = time.perf_counter()
    offline = run_offline({"model": str(model), "backend": args.backend, "max_num_seqs": args.max_num_seqs,
                           "max_num_batched_tokens": args.max_num_batched_tokens, "input_len": args.input_len,
                           "output_len": args.output_len, "vocab": vocab_size,
                           "concurrency": args.offline_concurrency, "shape": args.shape,
                           "tensor_parallel_size": args.tensor_parallel_size,
                           "kv_cache_dtype": args.kv_cache_dtype, "isq": args.isq,
                           "hf_batches": [] if args.skip_hf else args.hf_batches, "hf_new_tokens": args.hf_new_tokens})
    timings["offline"] = time.perf_counter() - started
    log(f"offline {args.offline_concurrency}: {offline['output_tok_s']:.1f} output tok/s ({timings['offline']:.1f}s)")
    return levels, offline


def report(args: argparse.Namespace, levels: list[dict], offline: dict | None, timings: dict) -> dict:
    measured = {}
    if "ttft_probe" in timings:
        probe = timings.pop("ttft_probe")
        measured[f"ttft_ms_{args.input_len}_http_after_idle"] = probe[0]
        measured[f"ttft_ms_{args.input_len}_http"] = statistics.median(probe[1:])
    for r in levels:
        c = r["concurrency"]
        measured |= {f"c{c}_output_tok_s": r["output_tok_per_s"], f"c{c}_ttft_ms_p50": r["ttft_ms"]["p50"],
                     f"c{c}_ttft_ms_p99": r["ttft_ms"]["p99"], f"c{c}_itl_ms_p50": r["itl_ms"]["p50"],
                     f"c{c}_client_cpu_percent": r["client_cpu_percent"],
                     f"c{c}_server_api_cpu_percent": r.get("server_api_cpu_percent"),
                     f"c{c}_server_engine_cpu_percent": r.get("server_engine_cpu_percent")}
        measured |= {f"c{c}_{key}": r[key] for key in ("gpu_sm_clock_mhz_p50", "gpu_power_w_p50") if key in r}
    from common import command_line, git_commit
    from throughput import gpu_name

    result = {"bench": "serving", "shape": args.shape, "dtype": "bfloat16", "gpu": gpu_name(args.backend),
              "tensor_parallel_size": args.tensor_parallel_size,
              "command": command_line(), "commit": git_commit(),
              "date": datetime.date.today().isoformat(),
              "workload": {"input_len": args.input_len, "output_len": args.output_len, "levels": args.levels,
                           "prompt": "random token ids", "ignore_eos": True, "temperature": 0, "stream": True},
              "measured": measured, "reference": {}, "targets": TARGETS, "timings_s": timings, "levels": levels}
    if offline is not None:
        c = args.offline_concurrency
        result["reference"][f"offline_c{c}_output_tok_s"] = offline["output_tok_s"]
        for key, value in offline.pop("hf", {}).items():
            (result.setdefault("ceiling", {}) if key == "copy_tb_s" else result["reference"])[key] = value
        result["offline"] = offline
        if f"c{c}_output_tok_s" in measured:
            result[f"ratio_http_vs_offline_c{c}"] = measured[f"c{c}_output_tok_s"] / offline["output_tok_s"]
    return result


def gpu_cell(level: dict) -> str:
    """The level's median SM clock, median power and share of samples at the power cap (GpuSampler)."""
    if "gpu_sm_clock_mhz_p50" not in level:
        return "-"
    return (f"{level['gpu_sm_clock_mhz_p50']:.0f}/{level['gpu_power_w_p50']:.0f}/"
            f"{level['gpu_power_capped_share']:.0%}")


def print_table(result: dict) -> None:
    w = result["workload"]
    tp = result.get("tensor_parallel_size", 1)
    print(f"\n{result['shape']} on {result['gpu']}{f', TP={tp}' if tp > 1 else ''} through cvserve: "
          f"{w['input_len']} in / {w['output_len']} out, "
          f"one round of N streams per level")
    print(f"{'streams':>7} {'out tok/s':>10} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'ITL p50 ms':>11} "
          f"{'client CPU sum/max':>19} {'procs':>5} {'API/engine CPU':>15} {'errors':>6} {'GPU MHz/W/capped':>17}")
    for r in result["levels"]:
        cpu = f"{r['client_cpu_percent']:.0f}%/{r['client_cpu_percent_max_proc']:.0f}%"
        server_cpu = f"{r.get('server_api_cpu_percent', 0):.0f}%/{r.get('server_engine_cpu_percent', 0):.0f}%"
        print(f"{r['concurrency']:>7} {r['output_tok_per_s']:>10.1f} {r['ttft_ms']['p50']:>12.1f} "
              f"{r['ttft_ms']['p99']:>12.1f} {r['itl_ms']['p50']:>11.2f} {cpu:>19} {r['client_procs']:>5} "
              f"{server_cpu:>15} {r['errors']:>6} {gpu_cell(r):>17}")
    for key in [k for k in result["measured"] if k.startswith("ttft_ms_")]:
        print(f"{key}: {result['measured'][key]:.1f} ms")
    for key, value in result["reference"].items():
        print(f"{key}: {value:.1f}")
    for key in [k for k in result if k.startswith("ratio_")]:
        print(f"{key}: {result[key]:.3f} (target >= {TARGETS['ratio_http_vs_offline']})")
    if result.get("offline", {}).get("by_phase"):
        from step_trace import phase_table

        print(phase_table(result["offline"]["by_phase"]))


def main() -> None:
    args = parse_args()
    if args.offline_worker:
        print("OFFLINE " + json.dumps(offline_worker(json.loads(args.offline_worker))), flush=True)
        return
    # a SIGTERM (run_all.sh's timeout) unwinds like an error, so the server (its own session: the signal does not
    # reach it) and its tensor-parallel workers are stopped rather than left holding the GPUs for the next step
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    started = time.perf_counter()
    timings: dict[str, float] = {}
    workdir = Path(tempfile.mkdtemp(prefix="cvllm-serving-bench-"))
    try:
        levels, offline = measure(args, workdir, timings)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    timings["total"] = time.perf_counter() - started
    result = report(args, levels, offline, timings)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    for r in levels:
        for message, count in r["error_messages"].items():
            print(f"{r['concurrency']} streams: {count} x {message}", file=sys.stderr)
    print_table(result)


if __name__ == "__main__":
    main()
