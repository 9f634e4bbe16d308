"""Asynchronous speculative steps against synchronous ones, on a simulated device: what the overlap of host and device
work is worth when a step's device time is about the host's (issue 22: SmolLM2-135M on the H200, ~1 ms a step).

    python bench/speculative_overlap.py --json OUT.json

The engine runs for real (scheduler, speculator, step inputs built by step_inputs.py, the sampler, output deltas),
on a model whose forward pass costs nothing on the host and ``--decode-ms`` (``--verify-ms`` for a verify step) on a
simulated device: a clock that starts each launched step when the previous one has finished, and a readback that
sleeps until the step it reads has. So the host's work overlaps the device's exactly where the engine launches a
step before waiting for the last one. The model: a "copy model" whose next token is a fixed permutation of the last
one, except at positions a hash picks (``--deviate`` of them): outputs that repeat with now and then a change, which
n-gram drafts copy from. Batch 1, greedy; each configuration's outputs must equal plain decoding's.

Also reported: the median microseconds of a step() call, apart for steps that verify drafts; with ``--decode-ms 0
--verify-ms 0`` that is the engine's host time per step alone (issue 22: on a small model it bounds tok/s).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import git_commit  # noqa: E402

from cvllm.backends.cpu import CpuBackend  # noqa: E402
from cvllm.checkpoint.base import Checkpoint  # noqa: E402
from cvllm.config import ModelConfig  # noqa: E402
from cvllm.engine.block_manager import BlockManager  # noqa: E402
from cvllm.engine.config import EngineConfig  # noqa: E402
from cvllm.engine.executor import InProcessExecutor  # noqa: E402
from cvllm.engine.llm_engine import LLMEngine  # noqa: E402
from cvllm.engine.sampler import Sampler  # noqa: E402
from cvllm.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from cvllm.engine.step_inputs import build_host_step, to_device  # noqa: E402
from cvllm.engine_process.deltas import DeltaBuilder  # noqa: E402
from cvllm.sampling_params import SamplingParams  # noqa: E402

VOCAB, BLOCK, CYCLE = 4096, 16, 64


def copy_permutation(seed: int) -> torch.Tensor:
    """The copy model's next token after each token: cycles of ``CYCLE`` tokens, so a text it writes repeats."""
    order = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))
    index = torch.arange(VOCAB)
    permutation = torch.empty(VOCAB, dtype=torch.long)
    permutation[order] = order[index - index % CYCLE + (index + 1) % CYCLE]
    return permutation


class SimulatedDevice(CpuBackend):
    """The CPU backend whose readback waits for a simulated device clock: each forward pass occupies the device for
    its time from when both it is launched and the device is free."""

    def __init__(self):
        super().__init__()
        self.free_at = 0.0
        self.busy_s = 0.0

    def launch(self, seconds: float) -> None:
        start = max(time.perf_counter(), self.free_at)
        self.free_at = start + seconds
        self.busy_s += seconds

    def start_readback(self, tensors):
        done_at = self.free_at   # the step just launched (a stream runs in order)

        def wait():
            remaining = done_at - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
            return tensors
        return wait


class CopyModelRunner:
    """Builds each step's inputs as ModelRunner does (the host's share of the work), computes the copy model's
    one-hot logits at the sampled rows, and charges the device clock."""

    def __init__(self, device: SimulatedDevice, decode_s: float, verify_s: float, deviate: int, seed: int,
                 launch_s: float = 0.0, paraphrase: tuple[int, int] = (0, 0)):
        self.device, self.decode_s, self.verify_s, self.deviate = device, decode_s, verify_s, deviate
        self.launch_s = launch_s
        self.paraphrase_every, self.paraphrase_len = paraphrase
        self.block_size, self.num_blocks = BLOCK, 0
        self.reads_host_lengths = False   # (it reads its inputs only: device drafts may run on it)
        self.permutation = copy = copy_permutation(seed).tolist()
        # a paraphrase's next token: two of the copy's skipped each time, so its words are the text's (a lookup of the
        # last token finds them: a wrong guess) in an order not seen before
        self.other = [copy[copy[copy[t]]] for t in range(VOCAB)]

    def kv_bytes_per_block(self) -> int:
        return 1

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def prepare(self, batch, previous_tokens=None):
        host = build_host_step(batch, BLOCK, previous_tokens.rows if previous_tokens else None)
        if previous_tokens is None:
            return to_device(host, self.device, BLOCK)
        return to_device(host, self.device, BLOCK, previous_tokens.ids, None, previous_tokens.positions)

    def run(self, batch, all_logits=False, extra_indices=None, previous_tokens=None):
        return self.forward(batch, self.prepare(batch, previous_tokens), all_logits, extra_indices)

    def forward(self, batch, inputs, all_logits=False, extra_indices=None):
        input_ids, positions, _, logits_indices = inputs
        # in Python on the few sampled rows: torch ops here would charge the host for a forward pass it does not run
        ids, pos, nxt = input_ids.tolist(), positions.tolist(), []
        for row in logits_indices.tolist():
            token = self.permutation[ids[row]]
            if (pos[row] * 2654435761 % 1000003) % self.deviate == 0:   # a change of the text here: a token skipped
                token = self.permutation[token]
            if self.paraphrase_every and (pos[row] // self.paraphrase_len * 2654435761 % 1000003) \
                    % self.paraphrase_every == 0:   # a stretch that says it in an order of its own
                token = self.other[ids[row]]
            nxt.append(token)
        logits = torch.zeros(len(nxt), VOCAB)
        logits[range(len(nxt)), nxt] = 1.0
        if self.launch_s:   # the CUDA runner's upload and graph launch: host work before the device can start
            until = time.perf_counter() + self.launch_s
            while time.perf_counter() < until:
                pass
        self.device.launch(self.verify_s if batch.num_draft_chunk_tokens else self.decode_s)
        return logits


def make_engine(args, async_scheduling: bool, speculative: dict | None) -> LLMEngine:
    device = SimulatedDevice()
    config = ModelConfig(vocab_size=VOCAB, max_position_embeddings=4096, architectures=["CopyModel"])
    checkpoint = Checkpoint(Path("copy-model"), config, lambda: iter(()))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=4096),
                          BlockManager(2048, BLOCK, True))
    runner = CopyModelRunner(device, args.decode_ms / 1e3, args.verify_ms / 1e3, args.deviate, args.seed,
                             args.launch_ms / 1e3, (args.paraphrase_every, args.paraphrase_len))
    executor = InProcessExecutor(runner, Sampler(), device, VOCAB)
    engine_config = EngineConfig(model=checkpoint, async_scheduling=async_scheduling,
                                 speculative_config=speculative)
    return LLMEngine(engine_config, checkpoint, device, torch.float32, executor, scheduler)


def prompt(args, index: int) -> list[int]:
    """A text of ``--prompt-tokens`` that the copy model would continue (its own output from a random start, without
    changes): what n-gram drafts copy from."""
    generator = torch.Generator().manual_seed(args.seed + index)
    permutation = copy_permutation(args.seed)
    tokens = [int(torch.randint(VOCAB, (1,), generator=generator))]
    for _ in range(args.prompt_tokens - 1):
        tokens.append(int(permutation[tokens[-1]]))
    return tokens


def run(args, async_scheduling: bool, speculative: dict | None) -> dict:
    engine = make_engine(args, async_scheduling, speculative)
    deltas = DeltaBuilder(engine)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    outputs, wall, steps = [], 0.0, 0
    # per step() call, by what it launched: a batch without drafts, one verifying drafts, or nothing (a sequence sat
    # the step out: speculator.py's hold)
    step_us: dict[str, list[float]] = {"plain": [], "verify": [], "empty": []}
    for index in range(args.requests + 1):   # the first request warms up
        started = time.perf_counter()
        engine.add_request(str(index), prompt(args, index), params)
        while engine.has_unfinished():
            began = time.perf_counter()
            deltas.deltas(engine.step())   # (the engine core's per-step output work)
            if index:
                steps += 1
                batch = engine.last_batch
                kind = "empty" if not batch.seqs else "verify" if batch.num_draft_chunk_tokens else "plain"
                step_us[kind].append((time.perf_counter() - began) * 1e6)
        if index:
            wall += time.perf_counter() - started
            outputs.append(engine.requests[str(index)][0].output_token_ids)
        deltas.forget(str(index))
        engine.release_request(str(index))
    stats = engine.stats
    tokens = sum(map(len, outputs))
    return {"tok_s": round(tokens / wall, 1), "ms_per_step": round(1e3 * wall / steps, 3), "steps": steps,
            "tokens": tokens, "acceptance_rate": round(stats.spec_accepted_tokens / stats.spec_draft_tokens, 3)
            if stats.spec_draft_tokens else None, "guesses": stats.spec_guesses,
            "guess_misses": stats.spec_guess_misses, "overlapped_steps": stats.overlapped_steps,
            "lagged_steps": stats.spec_lagged_steps,
            "us_per_step_median": {kind: round(statistics.median(t), 1) if t else None for kind, t in step_us.items()},
            "outputs": outputs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode-ms", type=float, default=1.0, help="device time of a decode step")
    ap.add_argument("--verify-ms", type=float, default=1.15, help="device time of a verify step (K = 4: 1.15x)")
    ap.add_argument("--deviate", type=int, default=12, help="one position in this many changes the copied text")
    ap.add_argument("--paraphrase-every", type=int, default=0,
                    help="one stretch of --paraphrase-len positions in this many takes the text's tokens in an "
                         "order not seen before (the demo model paraphrasing its input); 0: none")
    ap.add_argument("--paraphrase-len", type=int, default=20)
    ap.add_argument("--launch-ms", type=float, default=0.0,
                    help="host time a launched step takes before the device can start it: the CUDA runner's input "
                         "upload and graph launch (0.43 ms on the H200's host for the demo model, session 25)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    # drafts looked up on the device (ngram_device.py: here by the CPU backend's host search, in the host's time),
    # each drafting sequence verifying K
    device = {**spec, "device_drafts": True}
    configs = {"plain sync": (False, None), "plain async": (True, None), "ngram sync": (False, spec),
               "ngram async": (True, spec), "ngram device": (True, device)}
    results = {name: run(args, *config) for name, config in configs.items()}
    reference = results["plain sync"]["outputs"]
    print(f"{'':<13}{'tok/s':>8}{'ms/step':>9}{'steps':>7}{'accept':>8}{'guesses':>9}{'missed':>8}{'same':>6}"
          f"{'us plain':>10}{'us verify':>10}")
    for name, r in results.items():
        r["same_outputs"] = r.pop("outputs") == reference
        median = r["us_per_step_median"]
        print(f"{name:<13}{r['tok_s']:>8}{r['ms_per_step']:>9}{r['steps']:>7}{r['acceptance_rate']!s:>8}"
              f"{r['guesses']:>9}{r['guess_misses']:>8}{r['same_outputs']!s:>6}{median['plain']!s:>10}"
              f"{median['verify']!s:>10}")
    print("us plain / us verify: median microseconds of a step() call (with its output deltas) that launched a batch "
          "without drafts / one verifying drafts")
    base = results["plain async"]["tok_s"]
    print(f"ngram sync {results['ngram sync']['tok_s'] / base:.2f}x, ngram async "
          f"{results['ngram async']['tok_s'] / base:.2f}x, ngram device {results['ngram device']['tok_s'] / base:.2f}x "
          f"plain async's tok/s ({results['ngram device']['lagged_steps']} lagged steps)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "benchmark": "speculative_overlap", "commit": git_commit(), "date": datetime.date.today().isoformat(),
            "device": f"simulated ({args.decode_ms} ms decode, {args.verify_ms} ms verify, {args.launch_ms} ms "
                      f"launch), host: this CPU",
            "command": " ".join(["python bench/speculative_overlap.py", *(a for a in sys.argv[1:])]),
            "args": vars(args), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
