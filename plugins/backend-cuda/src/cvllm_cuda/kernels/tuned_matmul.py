"""Matmul tiles measured best per GPU, written by bench/tune_matmul.py (each entry names the commit, date and
result file of its sweep).

TUNED_GEMV, one-token GEMV tiles (kernels/gemv.py): {gpu name: {(out_features, in_features, dtype):
(block_n, block_k, num_warps, num_stages)}}; gemv.gemv_config reads them, missing keys take its default.
TUNED_QUANT_GEMV, one-token low-bit GEMV tiles (kernels/quant_gemv.py, quant_gemv_int8.py), from
bench/tune_quant_gemv.py: {gpu name: {quant_gemv_key(...): (block_n, block_w, num_warps, num_stages, programs per SM
the K split aims at)}}; missing keys take the kernels' defaults.
TUNED_SKINNY, few-row matmul tiles (kernels/skinny_gemm.py): {gpu name: {(block_m, out_features, in_features,
dtype): (block_n, block_k, num_warps, num_stages[, split_k])}}, only where the sweep measured the kernel faster
than cuBLAS; linear.linear() runs cuBLAS for every shape without an entry."""

TUNED_GEMV: dict[str, dict[tuple[int, int, str], tuple[int, int, int, int]]] = {
    # bench/tune_matmul.py at b223536, 2026-12-01 (results/2026-12-01-h200-tune_matmul-b223536.json)
    "NVIDIA H200": {
        (1024, 2048, "bfloat16"): (4, 2048, 4, 1),
        (1024, 3072, "bfloat16"): (2, 1024, 4, 3),
        (4096, 1024, "bfloat16"): (4, 1024, 4, 3),
        (6144, 1024, "bfloat16"): (8, 512, 4, 3),
        (6144, 4096, "bfloat16"): (2, 2048, 2, 1),
        (28672, 4096, "bfloat16"): (4, 2048, 4, 1),
        (128256, 4096, "bfloat16"): (4, 2048, 4, 1),
    },
}

TUNED_SKINNY: dict[str, dict[tuple[int, int, int, str], tuple[int, ...]]] = {
    # bench/tune_matmul.py at b223536, 2026-12-01 (results/2026-12-01-h200-tune_matmul-b223536.json)
    "NVIDIA H200": {
        (16, 4096, 1024, "bfloat16"): (64, 128, 4, 5),
        (16, 4096, 4096, "bfloat16"): (64, 256, 4, 4),
        (16, 6144, 1024, "bfloat16"): (64, 128, 4, 5),
        (16, 6144, 4096, "bfloat16"): (64, 128, 4, 5),
        (16, 128256, 4096, "bfloat16"): (128, 128, 8, 3),
        (32, 4096, 1024, "bfloat16"): (64, 128, 4, 5),
        (32, 4096, 4096, "bfloat16"): (64, 128, 4, 5),
        (32, 6144, 1024, "bfloat16"): (64, 128, 4, 5),
        (32, 6144, 4096, "bfloat16"): (64, 128, 4, 4),
        (32, 128256, 4096, "bfloat16"): (128, 128, 8, 4),
        # split-K, from bench/tune_matmul.py --skip-gemv --row-tiles 64 --shapes "llama qkv,llama o,llama down" at
        # dcf7bfb, 2026-12-02 (results/2026-12-02-h200-tune_matmul-skinny64-dcf7bfb.json): 33.5 us against cuBLAS
        # 35.9 (qkv 0.96x and o 1.00x there: cuBLAS kept)
        (64, 4096, 14336, "bfloat16"): (64, 128, 4, 4, 2),
        (64, 6144, 1024, "bfloat16"): (64, 128, 4, 5),
        (64, 28672, 4096, "bfloat16"): (128, 128, 8, 4),
        (64, 128256, 4096, "bfloat16"): (128, 128, 8, 4),
    },
}


def quant_gemv_key(out_features: int, in_features: int, layout, int8_kernel: bool) -> tuple[int, int, int, int, bool]:
    """TUNED_QUANT_GEMV's key of a weight shape in a plane layout (quant_planes.QuantLayout) for the GEMV that runs it
    (``int8_kernel``: quant_gemv_int8's, else the float one): the planes' widths and the kernel decide the tiles, not
    the factors' groups. (Keyed by the kernel, not by the layout's ``int8_activations``: a GGUF layout runs the float
    GEMV under CVLLM_QUANT_INT8_ACTIVATIONS=0, and must not take the int8 kernel's tiles there.)"""
    return (out_features, in_features, layout.low_bits, layout.high_bits, int8_kernel)


TUNED_QUANT_GEMV: dict[str, dict[tuple[int, int, int, int, bool], tuple[int, int, int, int, int]]] = {
    # python bench/tune_quant_gemv.py --layouts L --configs <BN 16/32/64, BW 32/64/128, warps 4/8, stages 3/5>
    # --pps 1,4 at 4ae0d84, 2026-12-04 (each shape alone, 8 copies in a CUDA graph; the winners' outputs checked
    # against the defaults'); kept where the best beat the default by more than 3%: Q4_K o 8.0 -> 7.2 us, down
    # 16.7 -> 15.5; GPTQ-4bit g128 (the float GEMV) down 20.0 -> 19.0. Everything else was within 3% of the
    # defaults (Q8_0's defaults now are its winners)
    "NVIDIA H200": {
        (4096, 4096, 4, 0, True): (32, 128, 8, 3, 4),
        (4096, 14336, 4, 0, True): (32, 128, 8, 3, 1),
        (4096, 14336, 4, 0, False): (32, 32, 4, 3, 4),
    },
}
