"""The FP8 tests' checkpoints: FP8 copies of a tiny float checkpoint in each scheme a release uses (transformers'
"fp8" with 128x128 scale blocks or one scale per tensor, llm-compressor's compressed-tensors per channel / tensor /
block), each beside the float checkpoint of its dequantized weights, and ``--isq fp8``'s rounding as a float copy."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cvllm.testing.checkpoints import greedy_logprobs
from cvllm_fp8.linear_method import dequantize, quantize_rows

PROMPTS = [[1, 5, 9, 23, 7, 11, 3, 4, 99, 100, 17, 2, 8], [4, 8, 15, 16, 23, 42]]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# every projection's inputs and outputs whole 128-blocks (k/v: 2 heads of 64)
WIDE = {"hidden_size": 256, "intermediate_size": 512}


def quantize_blocks(w: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    out, inp = w.shape
    padded = torch.zeros(math.ceil(out / rows) * rows, math.ceil(inp / cols) * cols)
    padded[:out, :inp] = w
    blocks = padded.view(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view_as(padded)[:out, :inp]
    return q.contiguous(), scale


def write_fp8(base, out, scheme: str, static: bool = False) -> None:
    """An FP8 copy of the float checkpoint ``base`` and, beside it, the float checkpoint of its dequantized weights
    (``out`` + "-float")."""
    state, floats = load_file(base / "model.safetensors"), {}
    quantized = {}
    for name, w in state.items():
        if not (name.endswith(".weight") and name.split(".")[-2] in LINEARS):
            quantized[name] = floats[name] = w
            continue
        prefix = name.removesuffix(".weight")
        if scheme in ("fp8-block", "ct-block"):
            q, scale = quantize_blocks(w, 128, 128)
            scale_rows = scale.repeat_interleave(128, dim=0)[:w.shape[0]]
            key = "weight_scale_inv" if scheme == "fp8-block" else "weight_scale"
        elif scheme in ("fp8-tensor", "ct-tensor"):
            scale = (w.abs().max() / 448).reshape(1 if scheme == "ct-tensor" else ())
            q = (w / scale).to(torch.float8_e4m3fn)
            scale_rows, key = scale.reshape(1, 1).expand(w.shape[0], 1), "weight_scale"
        else:   # ct-channel
            q, scale = quantize_rows(w)
            scale_rows, key = scale, "weight_scale"
        quantized[name], quantized[f"{prefix}.{key}"] = q, scale.to(torch.float32)
        if static:
            quantized[f"{prefix}.input_scale"] = torch.tensor([0.02])
        floats[name] = dequantize(q, scale_rows.to(torch.float32))
    for directory, tensors in ((out, quantized), (out.with_name(out.name + "-float"), floats)):
        directory.mkdir(parents=True)
        for file in base.iterdir():
            if file.is_file() and file.suffix != ".safetensors":
                shutil.copy(file, directory / file.name)
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    scheme_kind, granularity = scheme.split("-")
    if scheme_kind == "fp8":
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static" if static else "dynamic"}
        if granularity == "block":
            qc["weight_block_size"] = [128, 128]
    else:
        weights = {"num_bits": 8, "type": "float", "strategy": granularity, "dynamic": False, "symmetric": True}
        if granularity == "block":
            weights["block_structure"] = [128, 128]
        group = {"targets": ["Linear"], "weights": weights}
        if static:
            group["input_activations"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group},
              "ignore": ["lm_head"]}
    config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config))


def run(path, **options):
    return greedy_logprobs(path, PROMPTS, 8, dtype="float32", num_kv_blocks=32, **options)


def rounded_copy(base, out, also: tuple[str, ...] = ()) -> None:
    """``base``'s checkpoint with its linear layers' weights (and the tensors ``also`` names) rounded as --isq fp8
    rounds them (a scale a row): what an --isq fp8 model computes, as a float checkpoint."""
    state = load_file(base / "model.safetensors")
    for name, w in state.items():
        if (name.endswith(".weight") and name.split(".")[-2] in LINEARS) or name in also:
            state[name] = dequantize(*quantize_rows(w))
    shutil.copytree(base, out)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                               reason="needs a CUDA device (and TRITON_INTERPRET unset)")
