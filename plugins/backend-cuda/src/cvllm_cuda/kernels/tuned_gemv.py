"""GEMV tiles (kernels/gemv.py) measured best per GPU, written by bench/tune_gemv.py (its output names the
command, commit and date of each entry): {gpu name: {(out_features, in_features, dtype): (block_n, block_k,
num_warps, num_stages)}}. gemv.gemv_config reads them; missing keys take its default."""

TUNED_GEMV: dict[str, dict[tuple[int, int, str], tuple[int, int, int, int]]] = {
    # bench/tune_gemv.py at 5817599, 2026-12-01 (bench/results/2026-12-01-h200-tune_gemv-5817599.json)
    "NVIDIA H200": {
        (1024, 2048, "bfloat16"): (4, 1024, 4, 3),
        (1024, 3072, "bfloat16"): (4, 1024, 8, 1),
        (4096, 1024, "bfloat16"): (4, 512, 2, 1),
        (4096, 4096, "bfloat16"): (4, 1024, 2, 3),
        (4096, 14336, "bfloat16"): (4, 1024, 2, 1),
        (6144, 1024, "bfloat16"): (4, 512, 2, 3),
        (6144, 4096, "bfloat16"): (4, 512, 2, 3),
    },
}
