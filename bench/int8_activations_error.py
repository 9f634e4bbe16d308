"""Low-bit weights on x rounded to int8 per 32 inputs (llama.cpp's numerics: the CUDA backend's default for GGUF types
at up to 5 rows, opt-in for GPTQ/AWQ as W4A8) against the same weights on float x (W4A16), on the demo model: greedy
continuations compared as bench/kv_fp8_error.py compares an FP8 KV cache (reported, not asserted).

    python bench/int8_activations_error.py --backend cuda --dtype bfloat16     # the kernels, switch off / on
    python bench/int8_activations_error.py --json bench/results/<day>-cpu-int8_activations_error-<commit>.json

On CUDA the two runs differ only in CVLLM_QUANT_INT8_ACTIVATIONS (0, then the default 1). The CPU backend computes
GGUF layers on float x; there the rounding is emulated: float32 weights and x, and x rounded in torch
(``dequantized_activations``, the kernels' reference) before every GGUF product of up to 5 rows, the tied LM head's
too, as the CUDA path does. Prefill (more rows) stays on float x in both. ``--yardstick`` compares instead the same
model on float x in bfloat16 against float32 (the CPU backend; both W4A16): the noise floor to read the first against.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from kv_fp8_error import report, run  # noqa: E402

from cvllm.demo import demo_model_path  # noqa: E402

SWITCH = "CVLLM_QUANT_INT8_ACTIVATIONS"


def round_inputs_on_cpu() -> None:
    """Make the CPU's GGUF products take x as the int8 GEMV rounds it (for up to its MAX_ROWS rows)."""
    from cvllm_cuda.kernels.int8_activations import BLOCK, dequantized_activations
    from cvllm_cuda.kernels.quant_gemv_int8 import MAX_ROWS
    from cvllm_gguf.linear_method import GGUFLinearMethod
    from cvllm_gguf.quant_types import FLOAT_DTYPES
    from cvllm_gguf.table_method import GGUFTableMethod

    def rounding(apply):
        def apply_rounded(self, layer, x, bias):
            rows = x.numel() // x.shape[-1]
            if rows <= MAX_ROWS and x.shape[-1] % BLOCK == 0 and self.qtype not in FLOAT_DTYPES:
                x = dequantized_activations(x).to(x.dtype)
            return apply(self, layer, x, bias)
        return apply_rounded

    for method in (GGUFLinearMethod, GGUFTableMethod):
        method.apply = rounding(method.apply)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF file (default: the demo model, cvllm fetch-demo)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dtype", default=None, help="default: float32 on the CPU (exact products), auto on a GPU")
    ap.add_argument("--backend")
    ap.add_argument("--yardstick", action="store_true", help="bfloat16 against float32 on float x instead (CPU)")
    ap.add_argument("--json")
    args = ap.parse_args()
    model = args.model or str(demo_model_path())
    if args.yardstick:
        args.dtype = "float32"
        base = run(model, "auto", args)
        report("dtype_yardstick", model, args, base, run(model, "auto", argparse.Namespace(**{**vars(args),
                                                                                              "dtype": "bfloat16"})))
        return
    cuda = args.backend == "cuda"
    args.dtype = args.dtype or ("auto" if cuda else "float32")
    if not cuda and args.dtype != "float32":
        ap.error("on the CPU the emulation needs --dtype float32 (the exact float32 products)")
    os.environ[SWITCH] = "0"
    base = run(model, "auto", args)
    os.environ[SWITCH] = "1"
    if not cuda:
        round_inputs_on_cpu()
    report("int8_activations_error", model, args, base, run(model, "auto", args))


if __name__ == "__main__":
    main()
