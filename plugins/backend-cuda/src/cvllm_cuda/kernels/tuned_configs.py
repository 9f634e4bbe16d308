"""Attention tile sizes measured best per GPU, written by bench/tune_attention.py (its output names the
command, commit and date of each entry): {gpu name: {(head_dim, dtype, decode): (block_m, block_n,
num_warps, num_stages)}}. paged_attention.attention_config reads them; missing keys take its defaults."""

TUNED: dict[str, dict[tuple[int, str, bool], tuple[int, int, int, int]]] = {}
