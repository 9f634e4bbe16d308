"""Sweep the Triton matmuls' tiles on this GPU against cuBLAS: the one-token GEMV (kernels/gemv.py) and the
few-row skinny GEMM (kernels/skinny_gemm.py); time the whole batch-1 matmul chain of a Llama-3-8B shape.

    python bench/tune_matmul.py --json $OUT/tune_matmul.json --write $OUT/tuned_matmul.py   # on the GPU machine
    python bench/tune_matmul.py --tiny                                                      # CPU rehearsal

Shapes are the bf16 layers of decode steps: Llama-3-8B's qkv, o, gate_up, down and lm_head, Qwen3-0.6B's four
projections. Each time is the median over CUDA-graph replays that cycle through weight copies larger than
the L2 (a 33 MB o_proj would otherwise be read from cache), shown as the weight bytes streamed per second.

GEMV: a tile is committed for a shape where it beats gemv.DEFAULT_CONFIG by more than 2%. Skinny GEMM (tiles
with and without split-K), per row tile (16, 32, 64 rows: batches of 2-16, 17-32, 33-64): committed only where
its best tile beats cuBLAS by more than 2% at every batch size of that tile measured (2, 4, 8, 16; 32; 64),
since the engine falls back to cuBLAS for every (tile, shape) without an entry. The chain is every projection
of the 32 layers plus the lm_head, each layer its own weights (15 GB), in one graph: the matmul-only ceiling of
batch-1 decode (cuBLAS's: 241 tok/s, docs/benchmarks.md), with programmatic dependent launch (kernels/pdl.py) on and
off. ``--skip-skinny`` / ``--skip-gemv`` keep that committed table; ``--shapes`` and ``--row-tiles`` sweep a part of
the shapes or row tiles, and ``--write`` then replaces only the entries of what was swept:

    python bench/tune_matmul.py --skip-gemv --row-tiles 64 --shapes "llama qkv,llama o,llama down" --write ...

``--weight-dtype float8_e4m3fn`` sweeps the GEMV over FP8 weights instead (``--isq fp8`` and FP8 checkpoints with one
scale a row take it at batch 1: x in bf16, a byte a weight, so wider K steps than bf16's are candidates); its
"cuBLAS" column is then the bf16 matmul of the same shape (twice the bytes), and the skinny GEMM is not swept (more
rows take torch._scaled_mm).

    python bench/tune_matmul.py --weight-dtype float8_e4m3fn --skip-skinny \
        --shapes "llama qkv,llama o,llama gate_up,llama down" --write ..."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import command_line, git_commit  # noqa: E402

SHAPES = {  # name: (out_features, in_features)
    "llama qkv": (6144, 4096), "llama o": (4096, 4096), "llama gate_up": (28672, 4096),
    "llama down": (4096, 14336), "llama lm_head": (128256, 4096),
    "qwen3-0.6b qkv": (4096, 1024), "qwen3-0.6b o": (1024, 2048), "qwen3-0.6b gate_up": (6144, 1024),
    "qwen3-0.6b down": (1024, 3072),
}
TINY_SHAPES = {"tiny a": (64, 128), "tiny b": (96, 256)}
ROW_TILES = {16: [2, 4, 8, 16], 32: [32], 64: [64]}   # skinny row tile: the batch sizes timed for it
L2_BYTES = 60e6  # the H200's 50 MB L2, rounded up


def gemv_candidates(tiny: bool, wide: bool = False):
    """GEMV tiles to time (``wide``: one-byte weights, K steps up to 4096 too)."""
    from cvllm_cuda.kernels.gemv import DEFAULT_CONFIG, MatmulTile

    if tiny:
        return [MatmulTile(16, 32, 2, 1), DEFAULT_CONFIG]
    tiles = [(1, 2048), (2, 1024), (2, 2048), (4, 512), (4, 1024), (4, 2048), (8, 256), (8, 512), (8, 1024),
             (16, 256)] + ([(1, 4096), (2, 4096), (4, 4096), (8, 2048)] if wide else [])
    found = [MatmulTile(n, k, w, s) for n, k in tiles for w in (1, 2, 4) for s in (1, 3)
             if n * k // (32 * w) <= 256]   # fp32 accumulator elements per thread: more would spill
    return found + [DEFAULT_CONFIG] if DEFAULT_CONFIG not in found else found


def skinny_candidates(tiny: bool, row_tile: int):
    from cvllm_cuda.kernels.gemv import MatmulTile

    if tiny:
        return [MatmulTile(16, 32, 4, 1)]
    tiles = [(32, 128, 4), (32, 256, 4), (64, 64, 4), (64, 128, 4), (64, 256, 4), (128, 64, 4), (128, 128, 8)]
    # split-K for the layers whose N / block_n programs leave SMs idle (4096 / 64 = 64 on 132)
    split = [(32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 128, 4, 3), (64, 256, 4, 3), (128, 128, 8, 3)]
    found = [MatmulTile(n, k, w, s) for n, k, w in tiles for s in (3, 4, 5)]
    found += [MatmulTile(n, k, w, s, splits) for n, k, w, s in split for splits in (2, 4, 8)]
    return [t for t in found if t.num_stages * (t.block_n + row_tile) * t.block_k * 2 <= 200_000]   # shared memory


def time_ms(fn, calls: int) -> float:
    """GPU time of one of ``calls`` launches in ``fn``: CUDA-graph replays (plain launches would time the host)."""
    fn()  # compiles outside the graph
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3 / calls
    import triton

    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") / calls


def per_launch_ms(kernel, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """``kernel(x, w)`` once per weight copy, timed as above: ms per launch."""
    return time_ms(lambda: [kernel(x, w) for w in weights], len(weights))


def weight_copies(n: int, k: int, device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    copies = max(2, math.ceil(3 * L2_BYTES / (n * k * dtype.itemsize))) if device == "cuda" else 1
    return [(torch.randn(n, k, device=device) * k ** -0.5).to(dtype) for _ in range(copies)]


def sweep(run, configs: list) -> dict:
    """{config: ms} for the configs that compile; ``run(config)`` launches once per weight copy."""
    timed = {}
    for config in configs:
        try:
            timed[config] = run(config)
        except Exception as e:   # a tile the compiler rejects (registers, shared memory): not a candidate
            print(f"  skip {astuple(config)}: {type(e).__name__}", file=sys.stderr)
    return timed


def tune_gemv(shapes: dict, device: str, dtype: torch.dtype, tiny: bool, result: dict,
              weight_dtype: torch.dtype | None = None) -> tuple[dict, dict]:
    """``weight_dtype`` float8_e4m3fn: FP8 weights with their row scales, x in ``dtype``."""
    from cvllm_cuda.kernels.gemv import DEFAULT_CONFIG, gemv

    weight_dtype = weight_dtype or dtype
    fp8 = weight_dtype == torch.float8_e4m3fn
    entries, best_configs, all_ms = {}, {}, {}
    print(f"GEMV, one token, {str(weight_dtype).removeprefix('torch.')} weights\n"
          f"{'shape':20s} {'cuBLAS':>16s} {'default':>16s} {'best':>16s}  best (n, k, warps, stages)")
    for name, (n, k) in shapes.items():
        weights = weight_copies(n, k, device, weight_dtype)
        x = torch.randn(1, k, device=device, dtype=dtype)
        scale = torch.full((n,), 1.0, device=device) if fp8 else None
        cublas = per_launch_ms(F.linear, x, [copy.to(dtype) for copy in weights] if fp8 else weights)
        timed = sweep(lambda c, x=x, weights=weights, scale=scale: per_launch_ms(
                          lambda a, w: gemv(a, w, config=c, scale=scale), x, weights),
                      gemv_candidates(tiny, wide=fp8))
        best = min(timed, key=timed.get)
        nbytes = n * k * weight_dtype.itemsize
        print(f"{name:20s} " + " ".join(f"{ms * 1e3:7.1f}us {n * k * size / ms / 1e9:4.2f}TB/s" for ms, size in
                                        ((cublas, dtype.itemsize), (timed[DEFAULT_CONFIG], weight_dtype.itemsize),
                                         (timed[best], weight_dtype.itemsize))) + f"  {astuple(best)}")
        result["gemv"][name] = {"out_features": n, "in_features": k, "weight_bytes": nbytes, "cublas_us": cublas * 1e3,
                                "default_us": timed[DEFAULT_CONFIG] * 1e3, "best": astuple(best),
                                "best_us": timed[best] * 1e3,
                                "top": [(astuple(c), timed[c] * 1e3) for c in sorted(timed, key=timed.get)[:8]]}
        best_configs[(n, k)], all_ms[name] = best, timed
        if timed[best] < 0.98 * timed[DEFAULT_CONFIG] and best != DEFAULT_CONFIG:
            entries[(n, k, str(weight_dtype).removeprefix("torch."))] = astuple(best)
    # the one tile closest to each shape's best: what gemv.DEFAULT_CONFIG should be
    common = set.intersection(*(set(t) for t in all_ms.values()))
    overall = min(common, key=lambda c: statistics.geometric_mean([t[c] / min(t.values()) for t in all_ms.values()]))
    result["gemv_best_overall"] = astuple(overall)
    print(f"one tile for all shapes: {astuple(overall)}")
    return entries, best_configs


def tune_skinny(shapes: dict, device: str, dtype: torch.dtype, tiny: bool, result: dict,
                row_tiles: dict) -> tuple[dict, set]:
    """The entries that won and the keys swept (an entry not won is dropped from the table: cuBLAS runs it)."""
    from cvllm_cuda.kernels.skinny_gemm import skinny_gemm

    entries, swept = {}, set()
    row_tiles = {16: [4]} if tiny else row_tiles
    print(f"\nskinny GEMM, per row tile\n{'shape':20s} {'tile':>4s}  cuBLAS (rows: us)              best       "
          "gain  best (n, k, warps, stages)")
    for name, (n, k) in shapes.items():
        weights = weight_copies(n, k, device, dtype)
        for tile, batch_sizes in row_tiles.items():
            xs = {m: torch.randn(m, k, device=device, dtype=dtype) for m in batch_sizes}
            cublas = {m: per_launch_ms(F.linear, x, weights) for m, x in xs.items()}
            timed = sweep(lambda c, x=xs[batch_sizes[-1]], weights=weights:
                          per_launch_ms(lambda a, w: skinny_gemm(a, w, None, c), x, weights),
                          skinny_candidates(tiny, tile))
            best = min(timed, key=timed.get)
            gain = min(cublas.values()) / timed[best]
            cells = " ".join(f"{m}:{ms * 1e3:.1f}" for m, ms in cublas.items())
            print(f"{name:20s} {tile:4d}  {cells:30s} {timed[best] * 1e3:7.1f}us {gain:5.2f}x  {astuple(best)}")
            result["skinny"][f"{name} / {tile}"] = {
                "row_tile": tile, "out_features": n, "in_features": k,
                "cublas_us": {m: ms * 1e3 for m, ms in cublas.items()}, "best": astuple(best),
                "best_us": timed[best] * 1e3, "gain_vs_cublas": gain,
                "top": [(astuple(c), timed[c] * 1e3) for c in sorted(timed, key=timed.get)[:6]]}
            swept.add((tile, n, k, result["dtype"]))
            if gain > 1.02:
                entries[(tile, n, k, result["dtype"])] = astuple(best)
    return entries, swept


def chain_ms(layers: int, device: str, dtype: torch.dtype, use_gemv: bool, configs: dict) -> float:
    """One token through every projection of a Llama-3-8B shape, each layer its own weights: ms per token."""
    from cvllm_cuda.kernels.gemv import gemv

    shapes = [SHAPES[f"llama {p}"] for p in ("qkv", "o", "gate_up", "down")]
    weights = [[torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5 for n, k in shapes] for _ in range(layers)]
    lm_head = torch.randn(*SHAPES["llama lm_head"], device=device, dtype=dtype) * 0.02
    x = torch.randn(1, 4096, device=device, dtype=dtype) * 0.1
    mid = torch.randn(1, 14336, device=device, dtype=dtype) * 0.1

    def matmul(inp, w):
        return gemv(inp, w, config=configs.get(tuple(w.shape))) if use_gemv else F.linear(inp, w)

    def step():
        for qkv, o, gate_up, down in weights:   # inputs of the right widths; the math is not the point
            matmul(x, qkv)
            matmul(x, o)
            matmul(x, gate_up)
            matmul(mid, down)
        matmul(x, lm_head)

    return time_ms(step, 1)


def time_chain(device: str, dtype: torch.dtype, best_configs: dict, result: dict) -> None:
    from cvllm_cuda.kernels import pdl

    chain = {}
    for key, use_gemv, use_pdl in [("cublas", False, True), ("gemv_tuned", True, True),
                                   ("gemv_tuned_no_pdl", True, False)]:
        os.environ["CVLLM_PDL"] = "1" if use_pdl else "0"
        pdl._enabled.cache_clear()
        chain[key] = chain_ms(32, device, dtype, use_gemv, best_configs)
        torch.cuda.empty_cache()
    os.environ.pop("CVLLM_PDL")
    pdl._enabled.cache_clear()
    result["chain_ms_per_token"] = chain
    print("\nmatmul chain of one Llama-3-8B token (32 layers + lm_head, 15 GB):")
    for key, ms in chain.items():
        print(f"  {key:18s} {ms:6.3f} ms  {1e3 / ms:6.1f} tok/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--write", type=Path, help="write tuned_matmul.py here with this GPU's entries merged in")
    ap.add_argument("--tiny", action="store_true", help="CPU rehearsal: Triton's interpreter, two small shapes")
    ap.add_argument("--skip-skinny", action="store_true")
    ap.add_argument("--skip-gemv", action="store_true")
    ap.add_argument("--shapes", help="comma-separated names of SHAPES to sweep (default: all)")
    ap.add_argument("--row-tiles", help="comma-separated skinny row tiles to sweep, of 16, 32, 64 (default: all)")
    ap.add_argument("--weight-dtype", choices=["bfloat16", "float8_e4m3fn"], default="bfloat16",
                    help="float8_e4m3fn: the GEMV over FP8 weights (with --skip-skinny)")
    args = ap.parse_args()
    if args.weight_dtype != "bfloat16" and not args.skip_skinny:
        ap.error("--weight-dtype float8_e4m3fn sweeps the GEMV only: add --skip-skinny")
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    gpu = "cpu (interpreter)" if args.tiny else torch.cuda.get_device_name()
    shapes = TINY_SHAPES if args.tiny else SHAPES
    if args.shapes:
        shapes = {name: shapes[name] for name in args.shapes.split(",")}
    row_tiles = {int(t): ROW_TILES[int(t)] for t in args.row_tiles.split(",")} if args.row_tiles else ROW_TILES
    result = {"bench": "tune_matmul", "gpu": gpu, "commit": git_commit(), "date": datetime.date.today().isoformat(),
              "command": command_line(), "dtype": str(dtype).removeprefix("torch."),
              "gemv": {}, "skinny": {}}
    gemv, skinny = (None, None), (None, None)   # (entries that won, keys swept); None: not swept
    weight_dtype = dtype if args.weight_dtype == "bfloat16" else getattr(torch, args.weight_dtype)
    result["weight_dtype"] = str(weight_dtype).removeprefix("torch.")
    if not args.skip_gemv:
        gemv_entries, best_configs = tune_gemv(shapes, device, dtype, args.tiny, result, weight_dtype)
        gemv = (gemv_entries, {(n, k, result["weight_dtype"]) for n, k in shapes.values()})
        if not args.tiny and not args.shapes and weight_dtype == dtype:
            time_chain(device, dtype, best_configs, result)
    if not args.skip_skinny:
        skinny = tune_skinny(shapes, device, dtype, args.tiny, result, row_tiles)
    result["entries"] = {"gemv": {repr(k): v for k, v in (gemv[0] or {}).items()},
                         "skinny": {repr(k): v for k, v in (skinny[0] or {}).items()}}
    print(f"\nentries for {gpu!r}: "
          + ("GEMV not swept" if gemv[0] is None else f"{len(gemv[0])} GEMV") + ", "
          + ("skinny not swept" if skinny[0] is None else f"{len(skinny[0])} skinny: {sorted(skinny[0])}"))
    if args.write and not args.tiny:
        provenance = (f"bench/tune_matmul.py at {result['commit']}, {result['date']} "
                      f"(results/{result['date']}-h200-tune_matmul-{result['commit']}.json)")
        args.write.write_text(module_text(gpu, gemv, skinny, provenance))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def module_text(gpu: str, gemv: tuple, skinny: tuple, provenance: str) -> str:
    """tuned_matmul.py with this GPU's swept keys replaced by the entries that won (other keys and other GPUs'
    kept; a table not swept, (None, None), kept whole); the rest of the file (its other tables: the low-bit GEMV's,
    tune_quant_gemv.py's) as it is."""
    import cvllm_cuda.kernels.tuned_matmul as module

    text = Path(module.__file__).read_text()
    for table_name, committed, (entries, swept), key_type, value_type in [
            ("TUNED_GEMV", module.TUNED_GEMV, gemv, "tuple[int, int, str]", "tuple[int, int, int, int]"),
            ("TUNED_SKINNY", module.TUNED_SKINNY, skinny, "tuple[int, int, int, str]", "tuple[int, ...]")]:
        if entries is None:   # not swept: its text (comments included) stays
            continue
        kept = {key: value for key, value in committed.get(gpu, {}).items() if key not in swept}
        tables = {**committed, gpu: {**kept, **entries}}
        lines = [f"{table_name}: dict[str, dict[{key_type}, {value_type}]] = {{"]
        for name, table in sorted(tables.items()):
            partial = any(key not in swept for key in committed.get(gpu, {}))
            lines += [f"    # {provenance}" + ("; the keys it did not sweep as committed before" if partial else "")
                      if name == gpu else "    # (kept from the committed table)",
                      f'    "{name}": {{']
            lines += [f"        {key_text(key)}: {value!r}," for key, value in sorted(table.items())]
            lines.append("    },")
        lines.append("}\n")
        # the table's text: from its line to the first "}" line after it
        start = text.index(f"\n{table_name}: dict[") + 1
        end = text.index("\n}\n", start) + 3
        text = text[:start] + "\n".join(lines) + text[end:]
    return text


def key_text(key: tuple) -> str:
    """``(4096, 1024, 'bfloat16')`` as the formatter writes it: ``(4096, 1024, "bfloat16")``."""
    return "(" + ", ".join(f'"{part}"' if isinstance(part, str) else str(part) for part in key) + ")"


def astuple(config) -> tuple[int, ...]:
    """The table's value: (block_n, block_k, num_warps, num_stages), and split_k after them when it is not 1."""
    tile = (config.block_n, config.block_k, config.num_warps, config.num_stages)
    return tile if config.split_k == 1 else (*tile, config.split_k)


if __name__ == "__main__":
    main()
