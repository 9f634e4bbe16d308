"""HTTP serving throughput next to the offline engine's, on a random-weight Llama-shaped model on CPU.

    python bench/serving_cpu.py                         # SmolLM2-135M shape, 16 and 64 streams
    python bench/serving_cpu.py --tiny                  # a seconds-long rehearsal
    python bench/serving_cpu.py --json out.json
    python bench/serving_cpu.py --fake-step-ms 20 --concurrency 256   # the HTTP stack alone

Starts ``cvserve`` on the checkpoint, runs ``cvllm bench`` against it at each concurrency, and runs
the same number of equal requests through the offline ``LLM`` (all at once, same engine limits).
Prints both output-token rates and their ratio: what the server costs on top of the engine. With
``--fake-step-ms`` both sides run the engine without a model (each step a fixed-cost stub), so the
ratio isolates the API process, IPC, detokenization and HTTP at loads the CPU model could not produce.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import command_line, free_port, git_commit, start_cvserve, stop_cvserve  # noqa: E402
from random_checkpoint import write_random_llama  # noqa: E402

from cvllm import LLM, SamplingParams  # noqa: E402
from cvllm.clients.bench import BenchOptions, format_table, run_bench  # noqa: E402
from cvllm.testing.tokenizer import build_tiny_tokenizer, tokenizer_config  # noqa: E402


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """The tests' byte-level BPE, padded with placeholder tokens up to the model's vocabulary so every
    id a random model generates decodes to something."""
    tokenizer = build_tiny_tokenizer(512)
    tokenizer.add_tokens([f"<x{i}>" for i in range(tokenizer.get_vocab_size(), vocab_size)])
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2))


def offline_tok_s(llm: LLM, concurrency: int, input_len: int, output_len: int, vocab: int) -> float:
    g = torch.Generator().manual_seed(concurrency)
    prompts = [{"prompt_token_ids": torch.randint(3, min(512, vocab), (input_len,), generator=g).tolist()}
               for _ in range(concurrency)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def start_server(model: Path, port: int, dtype: str, max_num_seqs: int, log: Path,
                 fake_step_ms: float | None = None) -> subprocess.Popen:
    flags = ["--w", str(model), "--dtype", dtype, "--max-num-seqs", str(max_num_seqs),
             "--max-num-batched-tokens", "4096", "--log", "warning"]
    if fake_step_ms is not None:
        flags += ["--fake-step-ms", str(fake_step_ms)]
    return start_cvserve(flags, port, log, timeout=600)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model, short run (rehearsal)")
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--fake-step-ms", type=float, help="no model: each engine step takes this long")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    shape = "tiny" if args.tiny else args.shape
    levels = [2, 4] if args.tiny else [int(c) for c in args.concurrency.split(",")]
    input_len, output_len = (16, 8) if args.tiny else (args.input_len, args.output_len)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_llama(Path(tmp) / shape, shape, getattr(torch, args.dtype))
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        write_tokenizer(path, vocab)

        llm = LLM(str(path), dtype=args.dtype, max_num_seqs=max(levels), max_num_batched_tokens=4096,
                  fake_step_ms=args.fake_step_ms)
        offline_tok_s(llm, 2, 16, 4, vocab)  # warm-up
        offline = {c: offline_tok_s(llm, c, input_len, output_len, vocab) for c in levels}
        del llm

        port = free_port()
        server = start_server(path, port, args.dtype, max(levels), Path(tmp) / "cvserve.log", args.fake_step_ms)
        try:
            options = BenchOptions(url=f"http://127.0.0.1:{port}/v1", input_len=input_len, output_len=output_len)
            # One round of `concurrency` requests per level, as offline: the same work.
            serving = [asyncio.run(run_bench(options, [c], c, log=lambda line: None))[0] for c in levels]
        finally:
            stop_cvserve(server)

    print(format_table(serving))
    print(f"\n{'conc':>5} {'serving tok/s':>14} {'offline tok/s':>14} {'ratio':>6}")
    for r in serving:
        c = r["concurrency"]
        print(f"{c:>5} {r['output_tok_per_s']:>14.1f} {offline[c]:>14.1f} {r['output_tok_per_s'] / offline[c]:>6.2f}")
    if args.json:
        commit = git_commit()
        report = {"bench": "serving_cpu", "shape": shape, "dtype": args.dtype, "device": "cpu",
                  "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                  "cpu": platform.processor() or platform.machine(), "command": command_line(),
                  "commit": commit, "input_len": input_len, "output_len": output_len,
                  "fake_step_ms": args.fake_step_ms,
                  "offline_tok_s": offline, "serving": serving}
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
