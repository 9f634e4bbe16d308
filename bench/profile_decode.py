"""Where a decode step's time goes at a given batch size: torch profiler over a few engine steps (GPU kernels
by total time, and the host's share), on a random-weight model.

    python bench/profile_decode.py --batch 256 --context 1024          # on the GPU machine
    python bench/profile_decode.py --tiny                               # a CPU rehearsal
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from random_checkpoint import random_checkpoint, shape_config  # noqa: E402

from cvllm.engine.config import EngineConfig  # noqa: E402
from cvllm.engine.llm_engine import LLMEngine  # noqa: E402
from cvllm.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    shape = "tiny" if args.tiny else args.shape
    batch, context = (8, 64) if args.tiny else (args.batch, args.context)
    dtype = torch.bfloat16
    vocab = shape_config(shape, dtype)["vocab_size"]
    engine = LLMEngine(EngineConfig(model=random_checkpoint(shape, dtype, device), backend=device, dtype=dtype,
                                    max_num_seqs=batch, max_model_len=context + 64 + args.steps,
                                    max_num_batched_tokens=8192))
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=args.temperature, max_tokens=64, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), torch.randint(10, vocab, (context,), generator=g).tolist(), params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                          for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()                     # no synchronisation per step: async scheduling overlaps consecutive steps
    started = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync()
    walls = [(time.perf_counter() - started) / args.steps]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        sync()
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
    print(f"{shape} on {device}: batch {batch}, context {context}: median engine step "
          f"{statistics.median(walls) * 1e3:.2f} ms ({batch / statistics.median(walls):.0f} tok/s); "
          f"profiled {args.steps} steps above")


if __name__ == "__main__":
    main()
