"""Offline greedy throughput of the engine on a random-weight Llama-shaped model.

    python bench/offline_throughput.py                      # SmolLM2-135M shape on CPU, batch 1 and 16
    python bench/offline_throughput.py --tiny               # a seconds-long rehearsal
    python bench/offline_throughput.py --json out.json

Reports, per batch size: prefill tok/s, decode tok/s (output tokens over decode wall time) and the
median decode step time. Prompts are random token ids; generation ignores EOS.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import command_line, git_commit  # noqa: E402
from random_checkpoint import write_random_llama  # noqa: E402

from cvllm import LLM, SamplingParams  # noqa: E402


def run(llm: LLM, batch: int, prompt_len: int, output_len: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    prompts = [{"prompt_token_ids": torch.randint(10, vocab, (prompt_len,), generator=g).tolist()}
               for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine = llm.llm_engine
    for p in prompts:
        engine.add_request(f"b{batch}-{id(p)}", p["prompt_token_ids"], params)
    step_times, prefill_time, generated = [], 0.0, 0
    while engine.has_unfinished():
        is_prefill = any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.waiting) or \
            any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running)
        t = time.perf_counter()
        out = engine.step()
        dt = time.perf_counter() - t
        if is_prefill:
            prefill_time += dt
        else:
            step_times.append(dt)
            generated += len(out)
    for p in list(engine.requests):
        engine.release_request(p)
    decode_time = sum(step_times)
    return {
        "batch": batch, "prompt_len": prompt_len, "output_len": output_len,
        "prefill_tok_s": batch * prompt_len / prefill_time,
        "decode_tok_s": generated / decode_time,
        "median_step_ms": 1000 * statistics.median(step_times),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model, short run (rehearsal)")
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    shape = "tiny" if args.tiny else args.shape
    output_len = 8 if args.tiny else args.output_len
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_llama(Path(tmp) / shape, shape, getattr(torch, args.dtype))
        llm = LLM(str(path), dtype=args.dtype, max_num_seqs=64, max_num_batched_tokens=4096)
        vocab = llm.llm_engine.checkpoint.config.vocab_size
        run(llm, 1, 16, 4, vocab)  # warm-up
        results = [run(llm, int(b), args.prompt_len, output_len, vocab) for b in args.batches.split(",")]
    commit = git_commit()
    report = {"bench": "offline_throughput", "shape": shape, "dtype": args.dtype, "device": "cpu",
              "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
              "command": command_line(), "commit": commit, "results": results}
    print(f"{'batch':>5} {'prefill tok/s':>14} {'decode tok/s':>13} {'step ms':>8}")
    for r in results:
        print(f"{r['batch']:>5} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.1f} {r['median_step_ms']:>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
