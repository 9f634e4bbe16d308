"""Batch-1 latency on a Llama-3-8B shape (random bf16 weights on the device): TTFT and decode tok/s at
1k and 4k context, the share of each decode step the GPU sits idle, and the references docs/benchmarks.md
quotes (the copy-bandwidth ceiling, HF transformers ``generate`` on the same config) measured in the same run.

    python bench/latency.py --json $OUT/latency.json          # on the H200 (one device call)
    python bench/latency.py --tiny                            # a CPU rehearsal on a tiny shape
    python bench/latency.py --skip-hf --contexts 1024 --tensor-parallel-size 2    # over 2 GPUs (NCCL)
    python bench/latency.py --tiny --tensor-parallel-size 2   # the same code path on the CPU (gloo)

Decode tok/s = generated tokens over the wall time of the decode steps (after the first token).
GPU idle share = 1 - (GPU time of one decode step, timed with CUDA events on the replayed graph) /
(wall time of one engine step): what host work between steps costs.

With ``--tensor-parallel-size N`` the engine splits the model over N ranks (one process per GPU: this process is
rank 0, the others are spawned, sent the in-memory checkpoint and draw the same random weights from the same seed).
The GPU idle share is left out there (replaying rank 0's graph alone would wait in its all-reduce for ranks that
do not replay theirs); the ceiling is the copy rate over one rank's shard of the weights (collectives excluded).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import command_line, git_commit, graph_replay_ms  # noqa: E402
from random_checkpoint import hf_model, random_checkpoint, shape_config  # noqa: E402

from cvllm.engine.build import build_engine  # noqa: E402
from cvllm.engine.config import EngineConfig  # noqa: E402
from cvllm.engine.llm_engine import LLMEngine  # noqa: E402
from cvllm.sampling_params import SamplingParams  # noqa: E402


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def ttft_ms(engine: LLMEngine, length: int, vocab: int, device: str, repeats: int) -> float:
    times = []
    for r in range(repeats + 1):   # the first round compiles the prefill kernels for this length
        engine.add_request(f"ttft-{length}-{r}", prompt(length, vocab, r), SamplingParams(temperature=0, max_tokens=1))
        sync(device)
        started = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        sync(device)
        if r:
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def decode(engine: LLMEngine, context: int, tokens: int, vocab: int, device: str) -> dict:
    engine.add_request(f"decode-{context}", prompt(context, vocab, 7), SamplingParams(temperature=0, max_tokens=tokens,
                                                                                       ignore_eos=True))
    for _ in range(4):                   # the prefill and the first tokens; the first replays warm up
        engine.step()
    # no synchronisation per step: with async scheduling a step returns while the GPU still runs the next
    sync(device)
    started, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        tokens += len(engine.step())
    sync(device)
    step_s = (time.perf_counter() - started) / tokens
    return {"tok_s": 1 / step_s, "step_ms": step_s * 1e3}


def print_profile(run, *orders: str, rows: int = 22) -> None:
    """cProfile of ``run()``, the top ``rows`` functions by each of ``orders``."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    stats = pstats.Stats(profiler)
    for order in orders:
        stats.sort_stats(order).print_stats(rows)


def profile_host(engine: LLMEngine, context: int, vocab: int) -> None:
    engine.add_request("profile", prompt(context, vocab, 9), SamplingParams(temperature=0, max_tokens=70,
                                                                            ignore_eos=True))
    for _ in range(5):
        engine.step()

    def rest() -> None:
        while engine.has_unfinished():
            engine.step()

    print_profile(rest, "tottime")


def profile_prefill(engine: LLMEngine, length: int, vocab: int) -> None:
    """Where the host's time goes in the prefill of prompts of ``length`` tokens (one token generated each): cProfile
    of three of them after two to compile, by own time and by cumulative time. A chunk longer than the graphs'
    (CVLLM_GRAPH_CHUNK_TOKENS, or 0 to see short ones) runs eagerly, a launch at a time."""
    def prefill(seed: int) -> None:
        engine.add_request(f"prefill-{seed}", prompt(length, vocab, 100 + seed), SamplingParams(temperature=0,
                                                                                              max_tokens=1))
        while engine.has_unfinished():
            engine.step()

    for seed in range(2):
        prefill(seed)
    print_profile(lambda: [prefill(seed) for seed in range(2, 5)], "tottime", "cumulative", rows=25)


def copy_bandwidth_tb_s() -> float:
    x = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)   # 2 GiB, far past the L2
    y = torch.empty_like(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    y.copy_(x)
    times = []
    for _ in range(10):
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * x.numel() * x.element_size() / statistics.median(times) / 1e12   # bytes read + written


def hf_generate_tok_s(shape: str, context: int, tokens: int, device: str, dtype: torch.dtype) -> float:
    """transformers' eager generate on the same config, random weights: decode tok/s after the first token."""
    cfg = shape_config(shape, dtype)
    model = hf_model(shape, device, dtype)
    ids = torch.tensor([prompt(context, cfg["vocab_size"], 3)], device=device)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)      # warm-up
        sync(device)
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        sync(device)
        first = time.perf_counter() - started
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens + 1, min_new_tokens=tokens + 1, **kwargs)
        sync(device)
        total = time.perf_counter() - started
    del model
    return tokens / (total - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU rehearsal on the tiny shape (or a --shape tiny-...)")
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--hf-tokens", type=int, default=64)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--skip-hf", action="store_true", help="leave out the transformers reference")
    ap.add_argument("--profile-host", action="store_true",
                    help="print where the host's time goes in batch-1 decode steps (cProfile, by own time)")
    ap.add_argument("--profile-prefill", type=int, metavar="TOKENS",
                    help="print where the host's time goes in the prefill of prompts of TOKENS tokens (cProfile)")
    ap.add_argument("--no-tuned", action="store_true",
                    help="attention and the low-bit GEMVs with the default tiles, not this GPU's tuned ones (an A/B)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                    help="split the model over N ranks (GPUs; processes with gloo under --tiny)")
    ap.add_argument("--isq", metavar="TYPE",
                    help="quantize the random weights in situ as they load (q4k, q8_0 ...): the quantized decode path")
    ap.add_argument("--model", metavar="PATH",
                    help="a checkpoint (directory or GGUF file, e.g. bench/random_gguf.py's) instead of random weights "
                    "of --shape; its shape is named after the file")
    ap.add_argument("--json")
    args = ap.parse_args()
    tp = args.tensor_parallel_size
    if args.model and not args.skip_hf:
        ap.error("--model needs --skip-hf (the transformers reference draws random weights of --shape)")
    if tp > 1 and args.no_tuned:
        ap.error("--no-tuned clears the tuned tiles in this process only, not in the other ranks")
    device = "cpu" if args.tiny else "cuda"
    shape = args.shape if args.tiny and args.shape.startswith("tiny") else "tiny" if args.tiny else args.shape
    contexts = [64, 256] if args.tiny else [int(c) for c in args.contexts.split(",")]
    dtype = torch.bfloat16
    if args.model:
        shape = Path(args.model).name

    if args.no_tuned:
        from cvllm_cuda.kernels.paged_attention import SPARSE_DECODE_CONFIGS, TUNED_CONFIGS
        from cvllm_cuda.kernels.tuned_matmul import TUNED_QUANT_GEMV
        TUNED_CONFIGS.clear()
        SPARSE_DECODE_CONFIGS.clear()
        TUNED_QUANT_GEMV.clear()
    started = time.perf_counter()
    model = args.model or random_checkpoint(shape, dtype, device)
    engine = build_engine(EngineConfig(model=model, backend=device, dtype=dtype,
                                       max_num_seqs=4, max_model_len=max(contexts) + args.decode_tokens + 16,
                                       kv_cache_memory=8 << 30 if device == "cuda" else 64 << 20,
                                       enforce_eager=args.enforce_eager, tensor_parallel_size=tp, isq=args.isq))
    load_s = time.perf_counter() - started
    vocab = engine.runner.model.config.vocab_size
    result: dict = {"bench": "latency", "shape": shape, "device": torch.cuda.get_device_name() if device == "cuda"
                    else "cpu", "dtype": "bfloat16", "isq": args.isq, "enforce_eager": args.enforce_eager,
                    "tuned_attention": not args.no_tuned, "tensor_parallel_size": tp, "load_s": load_s,
                    "command": command_line(), "measured": {}, "ceiling": {}, "reference": {}}
    result["cuda_graphs"] = hasattr(engine.runner.decode_forward, "graphs")
    measured = result["measured"]
    for context in contexts:
        measured[f"ttft_ms_{context}"] = ttft_ms(engine, context, vocab, device, repeats=3 if args.tiny else 5)
        d = decode(engine, context, args.decode_tokens, vocab, device)
        measured[f"decode_tok_s_{context}"], measured[f"decode_step_ms_{context}"] = d["tok_s"], d["step_ms"]
    measured["bs1_decode_tok_s"] = measured[f"decode_tok_s_{contexts[0]}"]
    if args.profile_host:
        profile_host(engine, contexts[0], vocab)
    if args.profile_prefill:
        profile_prefill(engine, args.profile_prefill, vocab)
    if device == "cuda" and tp == 1:
        gpu_ms = graph_replay_ms(engine, 1)    # the graph's buffers hold the last decode run's step: compare with it
        if gpu_ms is not None:
            measured["gpu_step_ms_bs1"] = gpu_ms
            measured["gpu_idle_share_bs1"] = 1 - gpu_ms / measured[f"decode_step_ms_{contexts[-1]}"]
    if device == "cuda":
        # rank 0's shard under tensor parallelism: every rank streams its own at the same time. Buffers count too:
        # a quantized layer's planes are buffers
        model = engine.runner.model
        tied = model.config.get("tie_word_embeddings")
        tensors = [*model.named_parameters(), *model.named_buffers()]
        held = {t.data_ptr(): t.untyped_storage().nbytes() for _, t in tensors if t.device.type == "cuda" and t.numel()}
        # a MoE step reads only the routed experts' weights: top_k of every E (at batch 1)
        experts = model.config.get("num_experts") or model.config.get("n_routed_experts")
        routed = model.config.get("num_experts_per_tok", 1) / experts if experts else 1.0
        weights = sum(t.numel() * t.element_size() * (routed if ".experts." in n else 1.0) for n, t in tensors
                      if t.device.type == "cuda" and ("embed_tokens" not in n or tied))
        bandwidth = copy_bandwidth_tb_s()
        result["ceiling"] = {"copy_tb_s": bandwidth, "streamed_weight_gb": weights / 1e9,
                             "bs1_decode_tok_s": bandwidth * 1e12 / weights}
        # everything the model holds on the device (a quantized layer that keeps a dequantized copy shows here)
        result["model_memory_gb"] = sum(held.values()) / 1e9
    engine.shutdown()   # the other ranks' processes end here, and their devices' memory is free again
    del engine
    if device == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_hf:
        result["reference"]["hf_generate_bs1_decode_tok_s"] = hf_generate_tok_s(shape, contexts[0], args.hf_tokens,
                                                                               device, dtype)
    result["commit"] = git_commit()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"\n{shape}{f' isq={args.isq}' if args.isq else ''} on {result['device']}{f', TP={tp}' if tp > 1 else ''} "
          f"({'graphs' if result['cuda_graphs'] else 'eager'}), load {load_s:.1f}s")
    for key, value in {**measured, **{f"ceiling.{k}": v for k, v in result["ceiling"].items()},
                       **{f"reference.{k}": v for k, v in result["reference"].items()}}.items():
        print(f"  {key:36s} {value:10.3f}")
    if result.get("model_memory_gb") is not None:
        print(f"  {'model_memory_gb':36s} {result['model_memory_gb']:10.3f}")


if __name__ == "__main__":
    main()
