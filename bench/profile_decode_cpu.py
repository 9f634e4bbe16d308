"""Where a CPU decode step's time goes (issue 24, item 2): torch profiler over engine decode steps of the demo
model (SmolLM2-135M GGUF), by op and grouped into the step's parts, with the op count per step.

    python bench/profile_decode_cpu.py --batch 1 --context 128 [--threads 2] [--out profile.txt]

The prompts are prefilled first (outside the profile); the profiled generate call's prefill is a prefix-cache hit
of one partial block, the rest of its steps decode.
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from cvllm import LLM, SamplingParams
from cvllm.testing.requirements import demo_model

PARTS = (  # (part, predicate on an op's name and input shapes)
    ("LM head (bf16 matmul over the vocabulary)", lambda name, shapes: name == "aten::mm" and "49152" in shapes),
    ("LM head (int4 planes of the Q8_0 embedding)", lambda name, shapes: "int4pack" in name and "98304" in shapes),
    ("int4 linears", lambda name, shapes: "int4pack" in name),
    ("attention (gather + SDPA)", lambda name, shapes: "scaled_dot_product" in name or name == "aten::index_select"),
    ("attention (float32 reference ops)", lambda name, shapes: name in ("aten::bmm", "aten::masked_fill_",
                                                                       "aten::_softmax", "aten::nan_to_num_")),
    ("RMSNorm", lambda name, shapes: "rms_norm" in name),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--out")
    args = ap.parse_args()
    llm = LLM(str(demo_model()), max_num_seqs=max(args.batch, 1), max_model_len=args.context + args.steps + 64)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = [{"prompt_token_ids": [(7 + b * 131 + t * 31) % 49000 + 1 for t in range(args.context - 1)]}
               for b in range(args.batch)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.steps + 4, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True)
    steps = llm.llm_engine.stats.steps
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - started
    steps = llm.llm_engine.stats.steps - steps
    llm.shutdown()

    out = io.StringIO()
    events = prof.key_averages(group_by_input_shape=True)
    total = sum(e.self_cpu_time_total for e in events)
    ops = sum(e.count for e in events)
    out.write(f"demo model, batch {args.batch}, context {args.context}, torch threads {torch.get_num_threads()}, "
              f"load {os.getloadavg()[0]:.2f}: {steps} steps ({steps - 1} decode) in {wall * 1e3:.0f} ms with the "
              f"profiler on; ops' self CPU {total / 1e3 / steps:.2f} ms a step, {ops / steps:.0f} aten op calls a step "
              "(nested ones included)\n")
    parts = collections.Counter()
    for e in events:
        shapes = str(e.input_shapes)
        part = next((p for p, match in PARTS if match(e.key, shapes)), "everything else (per-op overhead)")
        parts[part] += e.self_cpu_time_total
    for part, us in parts.most_common():
        out.write(f"  {us / 1e3 / steps:7.2f} ms a step  {us / total:6.1%}  {part}\n")
    out.write(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=44,
                           max_shapes_column_width=64))
    print(out.getvalue())
    if args.out:
        Path(args.out).write_text(f"python bench/profile_decode_cpu.py {' '.join(sys.argv[1:])}\n" + out.getvalue())


if __name__ == "__main__":
    main()
