"""Matmul tiles measured best per GPU, written by bench/tune_matmul.py (each entry names the commit, date and
result file of its sweep).

TUNED_GEMV, one-token GEMV tiles (kernels/gemv.py): {gpu name: {(out_features, in_features, dtype):
(block_n, block_k, num_warps, num_stages)}}; gemv.gemv_config reads them, missing keys take its default.
TUNED_SKINNY, few-row matmul tiles (kernels/skinny_gemm.py): {gpu name: {(block_m, out_features, in_features,
dtype): (block_n, block_k, num_warps, num_stages)}}, only where the sweep measured the kernel faster than
cuBLAS; linear.linear() runs cuBLAS for every shape without an entry."""

TUNED_GEMV: dict[str, dict[tuple[int, int, str], tuple[int, int, int, int]]] = {
    # bench/tune_gemv.py (now tune_matmul.py) at 5817599, 2026-12-01 (results/2026-12-01-h200-tune_gemv-5817599.json)
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

TUNED_SKINNY: dict[str, dict[tuple[int, int, int, str], tuple[int, int, int, int]]] = {}
