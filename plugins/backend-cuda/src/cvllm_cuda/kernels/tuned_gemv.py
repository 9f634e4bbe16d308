"""GEMV tiles (kernels/gemv.py) measured best per GPU, written by bench/tune_gemv.py (its output names the
command, commit and date of each entry): {gpu name: {(out_features, in_features, dtype): (block_n, block_k,
num_warps, num_stages)}}. gemv.gemv_config reads them; missing keys take its default."""

TUNED_GEMV: dict[str, dict[tuple[int, int, str], tuple[int, int, int, int]]] = {}
