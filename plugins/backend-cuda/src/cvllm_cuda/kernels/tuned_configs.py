"""Attention tile sizes measured best per GPU, written by bench/tune_attention.py (its output names the
command, commit and date of each entry): {gpu name: {(head_dim, dtype, decode): (block_m, block_n,
num_warps, num_stages[, max registers a thread])}}, dtype the queries' or "float8_e4m3fn" for an FP8 cache's
entries. paged_attention.attention_config reads them; missing keys take its defaults."""

TUNED: dict[str, dict[tuple[int, str, bool], tuple[int, ...]]] = {
    # python bench/tune_attention.py at f3ba065, 2026-12-01 (results in
    # bench/results/2026-12-01-h200-tune_attention.json). Decode: 2 warps, 3 stages stream K/V at 4.0-4.2 TB/s
    # (256 x 1k: 268 vs 293 us, 256 x 2k: 508 vs 557 us, 64 x 1.5k: 108 vs 114 us, Qwen3 256 x 800: 212 vs
    # 231 us), chosen on those four bandwidth-bound workloads (that run timed launches with events, and a
    # one-sequence launch measured host time). Mixed prefill step (8 x 1024 prompts + 248 decodes): 725 vs 799 us.
    "NVIDIA H200": {
        (128, "bfloat16", False): (64, 32, 4, 2),
        (128, "bfloat16", True): (16, 64, 2, 3),
        # python bench/tune_attention.py --kv-dtype fp8 --decode "16,64,2,3 16,64,2,3,168 ..." at 5c9bebb, 2026-12-04
        # (results/2026-12-04-h200-tune_attention-fp8-caps-5c9bebb.json): an FP8 cache, 168 registers a thread
        # (6 programs an SM, not 4): 256 x 1k 232.8 -> 206.8 us, 256 x 2k 448.1 -> 398.7, Qwen3 256 x 800 183.1 ->
        # 166.3; 128 registers and other tiles lost. Capped only past one wave (paged_attention.UNCAPPED_WAVE)
        (128, "float8_e4m3fn", True): (16, 64, 2, 3, 168),
    },
    # python bench/tune_attention.py --kv-dtype fp8 --decode "16,64,2,3,168 16,64,2,3" at 688d3bb, 2026-12-06
    # (results/2026-12-06-h100-tune_attention-fp8-688d3bb.json; session 33's wider sweep,
    # results/2026-12-05-h100-tune_attention-fp8-tiles-5a33988.json, chose the same tile): an FP8 cache's decode in
    # 2 warps, 3 stages against the default (16, 64, 4, 2): 256 x 1k 230.0 vs 274.2 us, 256 x 2k 433.3 vs 521.9,
    # 64 x 1.5k 89.7 vs 130.4, Qwen3 256 x 800 179.7 vs 212.1; the H200's register cap lost here (443.8 at 256 x 2k,
    # 107.8 at 64 x 1.5k). The H100's 16-bit caches are not swept: they take the defaults
    "NVIDIA H100 80GB HBM3": {
        (128, "float8_e4m3fn", True): (16, 64, 2, 3),
    },
}

# Decode launches whose grid (sequences x KV heads x splits) has no more programs than the GPU has SMs: batch 1
# above all, 8 KV heads cut into 16 key slices. With one program an SM, a program's own bytes in flight set
# the speed, so wider tiles and more warps win there: {gpu name: {(head_dim, dtype): (block_m, block_n, num_warps,
# num_stages)}}, from bench/tune_split_decode.py (which also times the slice count).
TUNED_SPARSE_DECODE: dict[str, dict[tuple[int, str], tuple[int, int, int, int]]] = {
    # python bench/tune_split_decode.py at dcf7bfb, 2026-12-02 (results/2026-12-02-h200-tune_split_decode-dcf7bfb.json):
    # per layer, combine included, 32 layers in a graph: 1 x 1k 10.58 -> 8.04 us, 1 x 4k 18.76 -> 14.75 us
    # (16 splits both, the default count; 8 splits 8.39 / 16.96 us); batch 16 (512 programs) keeps (16, 64, 2, 3)
    "NVIDIA H200": {
        (128, "bfloat16"): (16, 128, 4, 3),
    },
}
