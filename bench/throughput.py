"""nano-vllm's throughput benchmark on the H200: a Qwen3-0.6B shape (random bf16 weights on the device),
256 requests with prompt and output lengths uniform in 100..1024 (seeded), ignore_eos, all submitted at
once to the offline engine. The reference, measured in the same run: Hugging Face transformers
``generate`` on the same config (random weights, bf16, eager) with a left-padded batch of 64 prompts of
~512 tokens and 64 new tokens each.

    python bench/throughput.py --json $OUT/throughput.json     # on the H200 (one device call)
    python bench/throughput.py --tiny                         # a CPU rehearsal on a tiny Qwen3 shape

Output tok/s = generated tokens over the wall time from the first request submitted to the last token
(nano-vllm's number). Prefill tok/s = prompt tokens over the wall time of a separate run of fresh
prompts with one output token each. Both engine runs come after a warm-up batch.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import command_line, git_commit  # noqa: E402
from random_checkpoint import hf_model, random_checkpoint, shape_config  # noqa: E402

from cvllm.engine.build import build_engine  # noqa: E402
from cvllm.engine.config import EngineConfig  # noqa: E402
from cvllm.engine.llm_engine import LLMEngine  # noqa: E402
from cvllm.sampling_params import SamplingParams  # noqa: E402

# Quoted from nano-vllm's README (same workload, RTX 4070 laptop): neither can be carried to the GPU machine.
QUOTED = {"nano_vllm_rtx4070_laptop_tok_s": 1434, "vllm_rtx4070_laptop_tok_s": 1362}


def workload(n: int, low: int, high: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) per request, both lengths uniform in [low, high]."""
    rng = random.Random(seed)
    return [([rng.randrange(10, vocab) for _ in range(rng.randint(low, high))], rng.randint(low, high))
            for _ in range(n)]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_batch(engine: LLMEngine, requests: list[tuple[list[int], int]], temperature: float, tag: str,
              device: str) -> dict:
    """Submit every request at once and step the engine until all finish."""
    sync(device)
    started = time.perf_counter()
    for i, (ids, out_len) in enumerate(requests):
        engine.add_request(f"{tag}-{i}", ids, SamplingParams(temperature=temperature, max_tokens=out_len,
                                                             ignore_eos=True))
    generated = steps = 0
    while engine.has_unfinished():
        generated += len(engine.step())
        steps += 1
    sync(device)
    wall = time.perf_counter() - started
    for i in range(len(requests)):
        engine.release_request(f"{tag}-{i}")
    expected = sum(out_len for _, out_len in requests)
    if generated != expected:     # ignore_eos: every request must run to its max_tokens
        raise RuntimeError(f"{tag}: generated {generated} tokens, expected {expected}")
    return {"wall_s": wall, "output_tokens": generated, "prompt_tokens": sum(len(ids) for ids, _ in requests),
            "steps": steps}


def hf_generate_tok_s(shape: str, batch: int, prompt_len: int, new_tokens: int, device: str, repeats: int,
                      model=None) -> dict:
    """transformers' eager ``generate`` on the same config with random weights (``model``, or one built here):
    a left-padded batch of prompts of prompt_len ± 1/8, exactly new_tokens each; output tok/s over the whole
    call (median)."""
    cfg = shape_config(shape, torch.bfloat16)
    own_model = model is None
    if own_model:
        model = hf_model(shape, device)
    rng = random.Random(1)
    lengths = [rng.randint(prompt_len - prompt_len // 8, prompt_len + prompt_len // 8) for _ in range(batch)]
    width = max(lengths)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for row, n in enumerate(lengths):       # left padding: every prompt ends at the last column
        ids[row, width - n:] = torch.tensor([rng.randrange(10, cfg["vocab_size"]) for _ in range(n)])
        mask[row, width - n:] = 1
    ids, mask = ids.to(device), mask.to(device)
    kwargs = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0)
    times = []
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)      # warm-up
        for _ in range(repeats):
            sync(device)
            started = time.perf_counter()
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
            sync(device)
            times.append(time.perf_counter() - started)
    if out.shape[1] != width + new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens per row, not {new_tokens}")
    if own_model:
        del model
    return {"output_tok_s": batch * new_tokens / statistics.median(times), "batch": batch,
            "mean_prompt_len": sum(lengths) / batch, "new_tokens": new_tokens, "wall_s": statistics.median(times)}


def gpu_name(backend: str) -> str:
    return torch.cuda.get_device_name() if backend == "cuda" else "cpu"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU rehearsal: tiny Qwen3 shape, 8 short requests")
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100, help="shortest prompt and output")
    ap.add_argument("--max-len", type=int, default=1024, help="longest prompt and output")
    ap.add_argument("--temperature", type=float, default=0.6, help="nano-vllm's benchmark samples at 0.6")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, help="default: the backend's")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    ap.add_argument("--isq", metavar="TYPE", help="quantize the random weights in situ (q4k, gptq, fp8 ...)")
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--hf-prompt-len", type=int, default=512)
    ap.add_argument("--hf-new-tokens", type=int, default=64)
    ap.add_argument("--hf-repeats", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true", help="leave out the transformers reference")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the result file here")
    args = ap.parse_args()
    if args.tiny:
        device, shape = "cpu", args.shape if args.shape.startswith("tiny") else "tiny-qwen3"
        num, low, high, max_seqs = 8, 10, 40, 8
        hf_batch, hf_prompt, hf_new = 8, 32, 8
    else:
        device, shape = "cuda", args.shape
        num, low, high, max_seqs = args.num_requests, args.min_len, args.max_len, args.max_num_seqs
        hf_batch, hf_prompt, hf_new = args.hf_batch, args.hf_prompt_len, args.hf_new_tokens
    dtype = torch.bfloat16
    vocab = shape_config(shape, dtype)["vocab_size"]

    started = time.perf_counter()
    engine = build_engine(EngineConfig(
        model=random_checkpoint(shape, dtype, device, seed=args.seed), backend=device, dtype=dtype,
        max_num_seqs=max_seqs, max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=2 * high,
        kv_cache_memory=None if device == "cuda" else 64 << 20, enforce_eager=args.enforce_eager,
        seed=args.seed, kv_cache_dtype=args.kv_cache_dtype, isq=args.isq))
    load_s = time.perf_counter() - started
    # Warm-up (compilation, autotuning, allocator): a small mixed batch, then the prefill run, which
    # draws prompts of every length the measured run has (fresh ones: no prefix-cache hits later).
    run_batch(engine, [(ids, 16) for ids, _ in workload(min(8, num), low, high, vocab, args.seed + 2)],
              args.temperature, "warm", device)
    prefill = run_batch(engine, [(ids, 1) for ids, _ in workload(num, low, high, vocab, args.seed + 1)],
                        args.temperature, "prefill", device)
    preempted = engine.stats.preemptions
    main_run = run_batch(engine, workload(num, low, high, vocab, args.seed), args.temperature, "bench", device)
    preemptions = engine.stats.preemptions - preempted
    engine_settings = {"max_num_seqs": engine.scheduler.config.max_num_seqs,
                       "max_num_batched_tokens": engine.scheduler.config.max_num_batched_tokens,
                       "max_model_len": engine.max_model_len, "cuda_graphs": hasattr(engine.runner.decode_forward,
                                                                                     "graphs")}
    del engine
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()

    measured = {"output_tok_s": main_run["output_tokens"] / main_run["wall_s"],
                "prefill_tok_s": prefill["prompt_tokens"] / prefill["wall_s"],
                "wall_s": main_run["wall_s"]}
    result: dict = {
        "bench": "throughput", "shape": shape, "dtype": "bfloat16",
        "gpu": gpu_name(device),
        "command": command_line(), "commit": git_commit(),
        "date": datetime.date.today().isoformat(), "load_s": load_s,
        "workload": {"requests": num, "length_range": [low, high], "temperature": args.temperature,
                     "ignore_eos": True, "output_tokens": main_run["output_tokens"],
                     "prompt_tokens": main_run["prompt_tokens"], "steps": main_run["steps"],
                     "preemptions": preemptions, "seed": args.seed},
        "engine": engine_settings, "measured": measured, "reference": {}, "quoted": QUOTED,
    }
    if not args.skip_hf:
        hf = hf_generate_tok_s(shape, hf_batch, hf_prompt, hf_new, device, repeats=1 if args.tiny else args.hf_repeats)
        result["reference"]["hf_generate_output_tok_s"] = hf.pop("output_tok_s")
        result["reference_workload"] = hf
        result["ratio_vs_hf"] = measured["output_tok_s"] / result["reference"]["hf_generate_output_tok_s"]
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))

    print(f"\n{shape} on {result['gpu']}: {num} requests, lengths {low}..{high}, "
          f"{main_run['output_tokens']} output tokens in {main_run['wall_s']:.2f}s, load {load_s:.1f}s")
    print(f"  {'cvllm output tok/s':40s} {measured['output_tok_s']:12.1f}")
    print(f"  {'cvllm prefill tok/s':40s} {measured['prefill_tok_s']:12.1f}")
    if "ratio_vs_hf" in result:
        print(f"  {f'HF generate output tok/s (batch {hf_batch})':40s} "
              f"{result['reference']['hf_generate_output_tok_s']:12.1f}")
        print(f"  {'ratio vs HF (target >= 10)':40s} {result['ratio_vs_hf']:12.2f}")


if __name__ == "__main__":
    main()
