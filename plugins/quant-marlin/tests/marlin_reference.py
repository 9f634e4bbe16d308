"""The tests' oracle: a small round-to-nearest GPTQ/AWQ quantizer and checkpoint writer, written from the formats'
descriptions independently of cvllm_marlin (its own bit packing, word by word), plus the float checkpoint whose
linear weights are exactly the dequantized values.

GPTQ: per (group, output) scale and zero from the group's min/max (GPTQ's own quantizer: the range always includes
0; sym puts the zero at the middle, (maxq + 1) / 2); act-order (desc_act) forms groups over a permutation of the
inputs and stores g_idx[i] = position of input i in that order // group_size, the weights in the original order.
AWQ: AutoAWQ's asymmetric min/max quantizer, groups of consecutive inputs.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cvllm.testing.checkpoints import make_checkpoint

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]   # AutoAWQ's GEMM packing: nibble k holds column AWQ_ORDER[k] of its 8


@dataclass
class Quantized:
    q: torch.Tensor        # int64 [in, out], 0 .. 2**bits - 1
    zeros: torch.Tensor    # int64 [groups, out]
    scales: torch.Tensor   # float16 [groups, out]
    g_idx: torch.Tensor    # int64 [in]

    def dequantized(self) -> torch.Tensor:
        """float32 [out, in]: scale * (q - zero), the scale as stored (fp16)."""
        g = self.g_idx
        return ((self.q - self.zeros[g]).to(torch.float32) * self.scales.to(torch.float32)[g]).t().contiguous()


def rtn(weight: torch.Tensor, bits: int, group_size: int, sym: bool, perm: torch.Tensor | None = None,
        awq: bool = False) -> Quantized:
    """Round-to-nearest of a float [out, in] weight with group scales (and zeros)."""
    out_features, in_features = weight.shape
    maxq = 2 ** bits - 1
    w = weight.t().to(torch.float32)                               # [in, out]
    order = torch.arange(in_features) if perm is None else perm   # quantization order of the inputs
    size = in_features if group_size == -1 else group_size
    position = torch.empty(in_features, dtype=torch.long)
    position[order] = torch.arange(in_features)
    g_idx = position // size
    groups = int(g_idx.max()) + 1
    q = torch.empty(in_features, out_features, dtype=torch.long)
    zeros = torch.empty(groups, out_features, dtype=torch.long)
    scales = torch.empty(groups, out_features, dtype=torch.float16)
    for g in range(groups):
        rows = (g_idx == g).nonzero().flatten()
        block = w[rows]
        lo, hi = block.min(0).values, block.max(0).values
        if awq:
            scale = ((hi - lo).clamp(min=1e-5) / maxq).to(torch.float16)
            zero = (-torch.round(lo / scale.float())).clamp(0, maxq)
        else:
            lo, hi = lo.clamp(max=0), hi.clamp(min=0)
            if sym:
                hi = torch.maximum(lo.abs(), hi)
                lo = torch.where(lo < 0, -hi, lo)
            scale = ((hi - lo).clamp(min=1e-6) / maxq).to(torch.float16)
            zero = torch.full_like(lo, (maxq + 1) // 2) if sym else torch.round(-lo / scale.float())
        zeros[g] = zero.to(torch.long)
        scales[g] = scale
        q[rows] = (torch.round(block / scale.float()) + zero).clamp(0, maxq).to(torch.long)
    return Quantized(q, zeros, scales, g_idx)


def _pack_word(values: list[int], bits: int) -> int:
    word = 0
    for k, v in enumerate(values):
        word |= (int(v) & ((1 << bits) - 1)) << (bits * k)
    return word - (1 << 32) if word >= 1 << 31 else word


def pack_along_input(q: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ qweight: word [r, o] holds inputs r*pack .. r*pack+pack-1 of output o, first in the lowest bits."""
    pack = 32 // bits
    rows, cols = q.shape[0] // pack, q.shape[1]
    out = torch.empty(rows, cols, dtype=torch.int32)
    for r in range(rows):
        for o in range(cols):
            out[r, o] = _pack_word(q[r * pack:(r + 1) * pack, o].tolist(), bits)
    return out


def pack_along_output(values: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """Word [r, c] holds outputs c*pack .. c*pack+pack-1 (nibble k: output c*pack + order[k])."""
    pack = 32 // bits
    order = order or list(range(pack))
    rows, cols = values.shape[0], values.shape[1] // pack
    out = torch.empty(rows, cols, dtype=torch.int32)
    for r in range(rows):
        row = values[r].tolist()
        for c in range(cols):
            out[r, c] = _pack_word([row[c * pack + k] for k in order], bits)
    return out


def gptq_tensors(quant: Quantized, bits: int, v1: bool = True) -> dict[str, torch.Tensor]:
    zeros = quant.zeros - 1 if v1 else quant.zeros   # AutoGPTQ's v1 format stores zero - 1
    return {"qweight": pack_along_input(quant.q, bits), "qzeros": pack_along_output(zeros, bits),
            "scales": quant.scales, "g_idx": quant.g_idx.to(torch.int32)}


def awq_tensors(quant: Quantized) -> dict[str, torch.Tensor]:
    return {"qweight": pack_along_output(quant.q, 4, AWQ_ORDER), "qzeros": pack_along_output(quant.zeros, 4, AWQ_ORDER),
            "scales": quant.scales}


def write_quantized(base: Path, out: Path, fmt: str, bits: int = 4, group_size: int = 32, sym: bool = True,
                    desc_act: bool = False, v1: bool = True, seed: int = 0, extra_config: dict | None = None,
                    keep_float: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Quantize the linear weights of the float checkpoint in ``base`` into a GPTQ (``fmt`` "gptq") or AWQ
    checkpoint directory ``out``; returns the float state dict with those weights replaced by their dequantized
    values (what the quantized checkpoint should compute). ``keep_float``: modules whose name contains one of these
    are left in floating point."""
    state = load_file(base / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    tensors, dequantized = {}, {}
    for name, tensor in state.items():
        module, _, suffix = name.rpartition(".")
        if suffix != "weight" or module.rpartition(".")[2] not in LINEARS or any(k in module for k in keep_float):
            tensors[name] = tensor
            dequantized[name] = tensor
            continue
        perm = torch.randperm(tensor.shape[1], generator=generator) if desc_act else None
        quant = rtn(tensor, bits, group_size, sym, perm, awq=fmt == "awq")
        packed = awq_tensors(quant) if fmt == "awq" else gptq_tensors(quant, bits, v1)
        tensors.update({f"{module}.{key}": value for key, value in packed.items()})
        dequantized[name] = quant.dequantized()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for file in base.iterdir():
        if file.is_file() and file.suffix != ".safetensors":
            shutil.copy(file, out / file.name)
    config = json.loads((base / "config.json").read_text())
    if fmt == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": bits, "group_size": group_size,
                                         "zero_point": True, "version": "gemm"}
    else:
        config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                                         "sym": sym, "desc_act": desc_act, "damp_percent": 0.01,
                                         "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    config["quantization_config"].update(extra_config or {})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return dequantized


def write_float(base: Path, out: Path, state: dict[str, torch.Tensor]) -> None:
    """A float checkpoint like ``base`` with ``state``'s weights."""
    out.mkdir(parents=True, exist_ok=True)
    for file in base.iterdir():
        if file.is_file() and file.suffix != ".safetensors":
            shutil.copy(file, out / file.name)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})


def tiny_pair(tmp_path: Path, fmt: str, **options):
    """(the transformers model with dequantized weights, quantized dir, float dir of the dequantized weights)."""
    base = tmp_path / "base"
    model = make_checkpoint(base, "llama")
    state = write_quantized(base, tmp_path / fmt, fmt, **options)
    write_float(base, tmp_path / "float", state)
    model.load_state_dict(state, strict=False)
    return model, tmp_path / fmt, tmp_path / "float"
