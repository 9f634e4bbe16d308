"""Reference K-quant bytes from llama.cpp for the K-quant tests (tests/data/kquant_golden.npz).

Quantizes seeded float32 inputs of several distributions to Q2_K..Q6_K with ggml's own
``ggml_quantize_chunk`` (no importance matrix, so ggml takes its ``quantize_row_*_K_ref`` path),
called through ctypes in the libggml-base shared library that llama-cpp-python bundles. The .npz holds
the inputs, ggml's bytes for every type and the llama-cpp-python version, so the tests need neither.

Run once in a scratch venv (llama-cpp-python is not a project dependency):

    python -m venv /tmp/llamacpp && /tmp/llamacpp/bin/pip install llama-cpp-python numpy
    /tmp/llamacpp/bin/python plugins/quant-gguf/tools/make_kquant_golden.py
"""

from __future__ import annotations

import ctypes
from importlib.metadata import version
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "kquant_golden.npz"

# ggml_type ids and bytes per 256-element super-block
K_TYPES = {"Q2_K": (10, 84), "Q3_K": (11, 110), "Q4_K": (12, 144), "Q5_K": (13, 176), "Q6_K": (14, 210)}
ROWS, COLS = 8, 512


def load_ggml() -> ctypes.CDLL:
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    candidates = sorted(lib_dir.glob("libggml-base.so*")) + sorted(lib_dir.glob("libggml.so*"))
    for path in candidates:
        lib = ctypes.CDLL(str(path))
        if hasattr(lib, "ggml_quantize_chunk"):
            lib.ggml_quantize_chunk.restype = ctypes.c_size_t
            lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
            return lib
    raise RuntimeError(f"no libggml with ggml_quantize_chunk under {lib_dir}")


def special_rows(rng: np.random.Generator) -> np.ndarray:
    """Rows where the all-zero, constant and one-signed branches of the algorithm decide the bytes."""
    rows = np.zeros((ROWS, COLS), np.float32)
    rows[0, 256:] = rng.standard_normal(256) * 1e-17  # below GROUP_MAX_EPS (1e-15): treated as all zero
    rows[1] = 1.5  # constant positive: min clamps to 0
    rows[2] = -0.7  # constant negative
    rows[3, :256] = rng.standard_normal(256)  # first super-block random, second all zero
    rows[4] = rng.standard_normal(COLS) * (rng.random(COLS) < 0.1)  # sparse: many all-zero sub-blocks
    rows[5] = np.abs(rng.standard_normal(COLS))  # positive only
    rows[6] = -np.abs(rng.standard_normal(COLS))  # negative only
    rows[7] = rng.standard_normal(COLS)
    rows[7, ::16] = 0  # one zero per 16-element sub-block
    rows[7, 32:48] = 0  # and one whole zero sub-block
    return rows


# Rows of a seeded 512 x 1024 draw (distribution, row, half) where a rarely taken step decides the bytes.
# SQRT_SENSITIVE: the Q4_K / Q5_K scale search hits a near tie, so a float32 square root one ulp off in the
# weights changes the result. REFINE_SENSITIVE: the fifth (last) refinement pass of Q3_K's make_q3_quants
# still moves a quant (the last row is a plain one).
SQRT_SENSITIVE = [("t1", 77, 1), ("t1", 128, 1), ("t1", 42, 0), ("t1", 2, 1), ("t1", 98, 0),
                  ("unif", 160, 0), ("unif", 298, 0), ("sparse", 124, 0)]
REFINE_SENSITIVE = [("normal", 125, 0), ("normal", 430, 1), ("unif", 62, 0), ("unif", 384, 0),
                    ("lognorm", 122, 1), ("weightlike", 95, 0), ("weightlike", 482, 0), ("normal", 0, 0)]


def picked_rows(picks: list[tuple[str, int, int]]) -> np.ndarray:
    rng = np.random.default_rng(7)
    shape = (512, 1024)
    draws = {"normal": rng.standard_normal(shape), "t1": rng.standard_t(1, shape)}
    draws["unif"] = rng.uniform(-1, 1, shape) + rng.uniform(-1, 1, (512, 1))
    draws["grid"] = rng.integers(-4, 5, shape) * 0.5
    draws["sparse"] = rng.standard_normal(shape) * (rng.random(shape) < 0.05)
    draws["lognorm"] = rng.standard_normal(shape) * np.exp(rng.normal(0, 4, (512, 1)))
    draws["weightlike"] = rng.standard_normal(shape) * 0.02
    return np.stack([draws[name][row, half * COLS:(half + 1) * COLS] for name, row, half in picks])


def inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(20261130)
    shape = (ROWS, COLS)
    cases = {
        "normal": rng.standard_normal(shape),
        "uniform_offset": rng.uniform(-1, 1, shape) + 0.3,
        "student_t2": rng.standard_t(2, shape),  # heavy tails: one outlier dominates a block
        "special": special_rows(rng),
        "tiny": rng.standard_normal(shape) * 1e-6,  # scales fall into f16 subnormals
        "large": rng.standard_normal(shape) * 300.0,
        "integer_grid": rng.integers(-8, 9, shape).astype(np.float64),  # exact ties for nearest_int
        "row_scaled": rng.standard_normal(shape) * np.exp(rng.normal(0, 2, (ROWS, 1))),
        "sqrt_sensitive": picked_rows(SQRT_SENSITIVE),
        "refine_sensitive": picked_rows(REFINE_SENSITIVE),
    }
    return {name: np.ascontiguousarray(x, dtype=np.float32) for name, x in cases.items()}


def quantize(lib: ctypes.CDLL, x: np.ndarray, type_id: int, block_bytes: int) -> np.ndarray:
    rows, cols = x.shape
    out = np.zeros((rows, cols // 256 * block_bytes), np.uint8)
    written = lib.ggml_quantize_chunk(type_id, x.ctypes.data, out.ctypes.data, 0, rows, cols, None)
    assert written == out.nbytes, (written, out.nbytes)
    return out


def main() -> None:
    lib = load_ggml()
    cases = inputs()
    arrays: dict[str, np.ndarray] = {"case_names": np.array(list(cases)),
                                     "llama_cpp_python_version": np.array(version("llama-cpp-python"))}
    for name, x in cases.items():
        arrays[f"x/{name}"] = x
        for qtype, (type_id, block_bytes) in K_TYPES.items():
            arrays[f"{qtype}/{name}"] = quantize(lib, x, type_id, block_bytes)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
