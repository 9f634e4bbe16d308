"""Attention tile sizes measured best per GPU, written by bench/tune_attention.py (its output names the
command, commit and date of each entry): {gpu name: {(head_dim, dtype, decode): (block_m, block_n,
num_warps, num_stages)}}. paged_attention.attention_config reads them; missing keys take its defaults."""

TUNED: dict[str, dict[tuple[int, str, bool], tuple[int, int, int, int]]] = {
    # python bench/tune_attention.py at f3ba065, 2026-12-01 (results in
    # bench/results/2026-12-01-h200-tune_attention.json). Decode: 2 warps, 3 stages stream K/V at 4.0-4.2 TB/s
    # (256 x 1k: 268 vs 293 us, 256 x 2k: 508 vs 557 us, 64 x 1.5k: 108 vs 114 us, Qwen3 256 x 800: 212 vs
    # 231 us), chosen on those four bandwidth-bound workloads (that run timed launches with events, and a
    # one-sequence launch measured host time). Mixed prefill step (8 x 1024 prompts + 248 decodes): 725 vs 799 us.
    "NVIDIA H200": {
        (128, "bfloat16", False): (64, 32, 4, 2),
        (128, "bfloat16", True): (16, 64, 2, 3),
    },
}
