"""Host cost of ``ModelRunner.prepare`` for a decode batch (the per-step input building that must stay well
under a GPU step): N sequences of 1-2k tokens, CPU device, one torch thread. No model is built.

    python bench/prepare_cpu.py --seqs 256 [--packed | --staged]

``--staged``: the step written into the CUDA graphs' input region instead (cvllm_cuda/staging.py, a CPU stand-in:
the twin's bytes are copied to a CPU region where the GPU would take one DMA transfer), so what is timed is the
host's share of staging.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from torch import nn

from cvllm.backends.cpu import CpuBackend
from cvllm.engine.model_runner import ModelRunner
from cvllm.engine.scheduler import ScheduledBatch
from cvllm.engine.sequence import Sequence
from cvllm.sampling_params import SamplingParams


class PackingBackend(CpuBackend):
    """A device that is not the CPU, so the runner packs the step's inputs for one upload; on the meta device the
    upload copies nothing (engine/upload.py), so what is timed is the packing."""
    device = torch.device("meta")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--packed", action="store_true",
                    help="also pack the inputs for a device as a GPU backend's step does (the copy itself left out)")
    ap.add_argument("--staged", action="store_true",
                    help="write the inputs where the CUDA graphs read them (staging.py), as CVLLM_STAGE_STEP_INPUTS=1")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # prepare() needs no model: an empty module has no layers, so no weights and no KV cache
    runner = ModelRunner(nn.Module(), PackingBackend() if args.packed else CpuBackend(), args.block_size,
                         torch.float32)
    rng = random.Random(0)
    seqs = []
    for i in range(args.seqs):
        n = rng.randrange(1024, 2048)
        seq = Sequence(i, str(i), [rng.randrange(1000) for _ in range(n)], SamplingParams())
        first = i * (2048 // args.block_size + 1)
        seq.block_table.extend(range(first, first + -(-(n + 1) // args.block_size)))
        seq.num_computed_tokens = n - 1
        seqs.append(seq)
    batch = ScheduledBatch(seqs, [1] * len(seqs), 0, len(seqs), list(range(len(seqs))))
    if args.staged:
        from cvllm_cuda.staging import StepStaging

        runner.staging = StepStaging(torch.device("cpu"), args.seqs, args.seqs, 2048 // args.block_size + 2)
    for _ in range(20):
        runner.prepare(batch)
    started = time.perf_counter()
    for _ in range(args.repeats):
        runner.prepare(batch)
    print(f"prepare: {(time.perf_counter() - started) / args.repeats * 1e3:.3f} ms a step "
          f"({args.seqs} decodes of 1-2k tokens, "
          f"{'staged' if args.staged else 'packed for a device' if args.packed else 'CPU device'}, "
          f"{args.threads} thread(s))")


if __name__ == "__main__":
    main()
