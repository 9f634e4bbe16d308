"""Sweep the paged-attention tile sizes on this GPU and print the TUNED entry for
plugins/backend-cuda/src/cvllm_cuda/kernels/tuned_configs.py (bf16, head_dim 128: the Llama-3 / Qwen3 shapes
of the benchmarks).

    python bench/tune_attention.py --json $OUT/tune_attention.json     # on the GPU machine

Workloads are what the engine launches: decode batches (Llama-3-8B heads 32/8 at 256 x 1k, 256 x 2k,
64 x 1.5k and a split-KV batch of one at 1k; Qwen3-0.6B heads 16/8 at 256 x 800) and mixed prefill steps
(8 fresh 1024-token prompts beside 248 decodes at 1k context; one 1024-token prompt alone). Each config's
time is the median over CUDA-graph replays that cycle through K/V caches larger than the L2; a config is scored by the
geometric mean of its times over the default config's, and only a config that wins every workload of its
kind by noise-free margin is worth committing (the table shows each one's times)."""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
from common import command_line, git_commit  # noqa: E402

from cvllm_cuda.kernels.kv_cache import empty_value_cache  # noqa: E402
from cvllm_cuda.kernels.paged_attention import AttentionConfig, attention_config, paged_attention  # noqa: E402

BLOCK_SIZE, HEAD_DIM, DTYPE = 16, 128, torch.bfloat16


def workload(query_lens: list[int], contexts: list[int], heads: int, kv_heads: int, generator,
             kv_dtype: torch.dtype = DTYPE, values_by_dim: bool = False) -> dict:
    """One launch's inputs; an FP8 cache (``kv_dtype`` float8_e4m3fn) holds e4m3 values with per-head scales, its
    V laid out by key as the engine allocates it (``values_by_dim``: as K, the layout before)."""
    seq_lens = [c + q for c, q in zip(contexts, query_lens)]
    blocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks)
    # pages in random order, as a running engine's would be
    order = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    at = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[at:at + n]
        at += n
    cache = (num_blocks, BLOCK_SIZE, kv_heads, HEAD_DIM)
    copies = max(1, math.ceil(3 * 60e6 / (2 * math.prod(cache) * 2)))   # K+V of all copies > 3x the L2
    fp8 = kv_dtype == torch.float8_e4m3fn

    def values() -> torch.Tensor:
        v = torch.randn(cache, device="cuda", dtype=DTYPE).to(kv_dtype)
        return v if values_by_dim or not fp8 else empty_value_cache(cache, kv_dtype, v.device).copy_(v)

    caches = [(torch.randn(cache, device="cuda", dtype=DTYPE).to(kv_dtype), values()) for _ in range(min(copies, 4))]
    kv_scales = tuple(torch.full((kv_heads,), 0.05, device="cuda") for _ in range(2)) if fp8 else None
    return {"q": torch.randn(sum(query_lens), heads, HEAD_DIM, device="cuda", dtype=DTYPE), "caches": caches,
            "query_start_loc": torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device="cuda"),
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), "tables": tables.cuda(),
            "max_query_len": max(query_lens), "kv_scales": kv_scales,
            "kv_bytes": sum(seq_lens) * kv_heads * HEAD_DIM * 2 * caches[0][0].element_size()}


def time_ms(w: dict, config: AttentionConfig | None, splits: int | None = None) -> float:
    """GPU time of one launch: replays of a CUDA graph that runs the launch once over each cache copy (a plain
    launch costs ~0.1 ms of host time here, which would hide the kernel's own time on small workloads). ``splits``:
    the launch's num_splits (its combining kernel included), None for paged_attention's choice."""
    def run():
        for k, v in w["caches"]:
            paged_attention(w["q"], k, v, w["query_start_loc"], w["seq_lens"], w["tables"], w["max_query_len"],
                            HEAD_DIM ** -0.5, None, None, config=config, kv_scales=w["kv_scales"], num_splits=splits)
    run()   # compiles outside the graph
    return triton.testing.do_bench_cudagraph(run, rep=100, return_mode="median") / len(w["caches"])


def parse_configs(text: str | None) -> list[AttentionConfig] | None:
    """``"16,64,2,3 16,128,8,2 16,64,2,3,168"`` -> configs (block_m, block_n, num_warps, num_stages[, max registers
    a thread])."""
    if not text:
        return None
    return [AttentionConfig(*map(int, item.split(","))) for item in text.split()]


def candidates(decode: bool) -> list[AttentionConfig]:
    if decode:
        # (one stage: no software pipeline; for an FP8 cache a third fewer instructions a key on sm_90, session 30)
        return [AttentionConfig(16, n, w, s) for n in (32, 64, 128) for w in (2, 4, 8) for s in (1, 2, 3, 4)]
    return [AttentionConfig(m, n, w, s) for m in (64, 128) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--decode", help="only these decode configs, e.g. '16,64,2,3 16,128,8,2' (m,n,warps,stages"
                                     "[,max registers a thread])")
    ap.add_argument("--prefill", help="only these prefill configs, likewise")
    ap.add_argument("--kv-dtype", choices=["bfloat16", "fp8"], default="bfloat16",
                    help="fp8: e4m3 caches (--kv-cache-dtype fp8), decode workloads; entries spelled float8_e4m3fn")
    ap.add_argument("--values-by-dim", action="store_true",
                    help="fp8: V laid out as K (the layout before kv_cache.empty_value_cache), for an A/B run")
    ap.add_argument("--splits", type=int, help="decode workloads cut each sequence's keys into this many slices "
                                               "(split-KV, the combining kernel timed too), not paged_attention's "
                                               "choice (1 for these batches): the last wave of equal-length "
                                               "programs filled or not")
    ap.add_argument("--write", type=Path, help="write tuned_configs.py here with this GPU's entries merged in")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    kv = torch.float8_e4m3fn if args.kv_dtype == "fp8" else DTYPE
    by_dim = args.values_by_dim
    workloads = {
        True: {"llama 256x1k": workload([1] * 256, [1024] * 256, 32, 8, g, kv, by_dim),
               "llama 256x2k": workload([1] * 256, [2048] * 256, 32, 8, g, kv, by_dim),
               "llama 64x1.5k": workload([1] * 64, [1536] * 64, 32, 8, g, kv, by_dim),
               "llama 1x1k (split)": workload([1], [1024], 32, 8, g, kv, by_dim),
               "qwen3 256x800": workload([1] * 256, [800] * 256, 16, 8, g, kv, by_dim)},
        False: {"mixed 8x1024+248": workload([1024] * 8 + [1] * 248, [0] * 8 + [1024] * 248, 32, 8, g),
                "prefill 1x1024": workload([1024], [0], 32, 8, g)},
    }
    if args.kv_dtype == "fp8":
        del workloads[False], workloads[True]["llama 1x1k (split)"]
    gpu = torch.cuda.get_device_name()
    result = {"bench": "tune_attention", "gpu": gpu, "commit": git_commit(), "date": datetime.date.today().isoformat(),
              "command": command_line(), "head_dim": HEAD_DIM, "dtype": "bfloat16",
              "kv_dtype": args.kv_dtype, "values_by_dim": by_dim, "decode_splits": args.splits, "kinds": {}}
    entries = {}
    for decode, named in workloads.items():
        default = attention_config(HEAD_DIM, DTYPE, decode, torch.device("cuda"), fp8_cache=args.kv_dtype == "fp8")
        splits = args.splits if decode else None
        base = {name: time_ms(w, default, splits) for name, w in named.items()}
        rows = []
        chosen = parse_configs(args.decode if decode else args.prefill)
        for config in chosen or candidates(decode):
            try:
                times = {name: time_ms(w, config, splits) for name, w in named.items()}
            except Exception as e:     # a config the compiler rejects (shared memory): not a candidate
                print(f"  skip {config}: {type(e).__name__}", file=sys.stderr)
                continue
            score = math.exp(sum(math.log(times[n] / base[n]) for n in named) / len(named))
            rows.append((score, config, times))
        rows.sort(key=lambda r: r[0])
        kind = "decode" if decode else "prefill"
        print(f"\n{kind} (best of {len(rows)} configs first):")
        print("  " + " | ".join(named))
        print(f"  {'default ' + str(astuple(default)):28s} {1.0:6.3f} {cells(named, base)}")
        for score, config, times in rows[:6]:
            print(f"  {str(astuple(config)):28s} {score:6.3f} {cells(named, times)}")
        best_score, best, best_times = rows[0]
        result["kinds"][kind] = {"default": astuple(default), "default_ms": base, "best": astuple(best),
                                 "best_ms": best_times, "score": best_score,
                                 "top": [(astuple(c), s, t) for s, c, t in rows[:10]]}
        # commit only a real gain (2% is above run-to-run noise), and no tile timed at splits the engine does not take
        if best_score < 0.98 and best != default and not splits:
            entries[(HEAD_DIM, "float8_e4m3fn" if args.kv_dtype == "fp8" else "bfloat16", decode)] = astuple(best)
    print(f"\nTUNED entry for {gpu!r} (commit {result['commit']}, {result['date']}):")
    print(f"    {gpu!r}: {{" + ", ".join(f"{k!r}: {v!r}" for k, v in entries.items()) + "},")
    result["entries"] = {repr(k): v for k, v in entries.items()}
    if args.write:
        from cvllm_cuda.kernels.tuned_configs import TUNED
        args.write.write_text(module_text({**TUNED, gpu: {**TUNED.get(gpu, {}), **entries}},
                                          f"{result['command']} at {result['commit']}, {result['date']}"))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def module_text(tuned: dict, provenance: str) -> str:
    """tuned_configs.py with ``tuned`` as its table."""
    import cvllm_cuda.kernels.tuned_configs as module

    doc = module.__doc__.strip()
    lines = [f'"""{doc}"""', "", "TUNED: dict[str, dict[tuple[int, str, bool], tuple[int, ...]]] = {"]
    for gpu, entries in sorted(tuned.items()):
        lines.append(f"    # {provenance}")
        lines.append(f'    "{gpu}": {{')
        lines += [f'        ({head_dim}, "{dtype}", {decode}): {value!r},'
                  for (head_dim, dtype, decode), value in sorted(entries.items())]
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines) + "\n"


def cells(named: dict, times: dict) -> str:
    """Each workload's time and the K/V bytes it streamed per second."""
    return " ".join(f"{times[n] * 1e3:8.1f}us {named[n]['kv_bytes'] / times[n] / 1e9:4.2f}TB/s" for n in named)


def astuple(config: AttentionConfig) -> tuple[int, ...]:
    base = (config.block_m, config.block_n, config.num_warps, config.num_stages)
    return base + ((config.max_registers,) if config.max_registers else ())


if __name__ == "__main__":
    main()
