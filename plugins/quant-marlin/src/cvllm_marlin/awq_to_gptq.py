"""An AWQ checkpoint (AutoAWQ's GEMM layout) rewritten in GPTQ's layout (``cvllm convert SRC OUT --to gptq`` on
an AWQ source): the job of candle-vllm's convert_awq_marlin.py, for tools that read GPTQ but not AWQ.

Nothing is requantized. AWQ keeps, per layer, the 4-bit integers q [in, out] and zeros z [groups, out] packed along
the output dimension in its interleaved order, and fp16 scales s [groups, out], with W[i, o] = s * (q - z) for the
group of input i (packing.py); GPTQ's "gptq" (v1) format holds the same q packed along the input dimension, each
zero stored minus one, the same scales, and g_idx = i // group_size. So the copy is asymmetric GPTQ, 4-bit, AWQ's
group size, and computes exactly what the AWQ checkpoint does. A layer's three tensors may sit in different shards:
its qzeros and scales are read where they are and written beside its qweight.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open

from cvllm.checkpoint.hf_dir import weight_files
from cvllm_marlin.config import parse_awq_config
from cvllm_marlin.packing import pack_columns, pack_rows, unpack_awq
from cvllm_marlin.rewrite import rewrite, write_config

logger = logging.getLogger(__name__)


def awq_layer_as_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                      group_size: int) -> dict[str, torch.Tensor]:
    """One AWQ layer's tensors as GPTQ v1's (qweight, qzeros, scales, g_idx)."""
    q = unpack_awq(qweight)                       # [in, out]
    z = unpack_awq(qzeros)                        # [groups, out]
    in_features = q.shape[0]
    if in_features % 8:
        raise ValueError(f"{in_features} input features: GPTQ packs inputs eight to a word")
    g_idx = torch.zeros(in_features, dtype=torch.int32) if group_size == -1 else \
        (torch.arange(in_features) // group_size).to(torch.int32)
    if int(g_idx[-1]) >= scales.shape[0] or z.shape[0] != scales.shape[0]:
        raise ValueError(f"{in_features} inputs in groups of {group_size} need {int(g_idx[-1]) + 1} groups; "
                         f"qzeros has {z.shape[0]}, scales {scales.shape[0]}")
    return {"qweight": pack_rows(q, 4), "qzeros": pack_columns((z - 1) & 0xF, 4), "scales": scales, "g_idx": g_idx}


def repack_awq(src: Path, out: Path, config: dict, options: dict) -> None:
    awq = parse_awq_config(config["quantization_config"], f"{src}: quantization_config")
    wanted = {"bits": (options.get("bits"), 4), "group_size": (options.get("group_size"), awq.group_size)}
    for option, (given, kept) in wanted.items():
        if given is not None and given != kept:
            raise ValueError(f"--{option.replace('_', '-')} {given}: an AWQ checkpoint is repacked, not requantized "
                             f"(its {option} {kept} is kept)")
    if options.get("sym"):
        raise ValueError("--sym: an AWQ checkpoint's zero points are kept, so its GPTQ copy is asymmetric")
    where: dict[str, Path] = {}   # every tensor's shard
    for file in weight_files(src):
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt") as f:
                where.update(dict.fromkeys(f.keys(), file))

    def partner(name: str, f) -> torch.Tensor:
        if name not in where:
            raise ValueError(f"{src}: {name} is missing (an AWQ layer has qweight, qzeros and scales)")
        if name in f.keys():
            return f.get_tensor(name)
        with safe_open(str(where[name]), framework="pt") as other:
            return other.get_tensor(name)

    def repack(name: str, tensor: torch.Tensor, f) -> dict[str, torch.Tensor] | None:
        module, _, part = name.rpartition(".")
        if part in ("qzeros", "scales") and f"{module}.qweight" in where:
            return {}   # written beside its qweight
        if part != "qweight":
            return None
        try:
            tensors = awq_layer_as_gptq(tensor, partner(f"{module}.qzeros", f), partner(f"{module}.scales", f),
                                        awq.group_size)
        except ValueError as e:
            raise ValueError(f"{src}: {module}: {e}") from None
        return {f"{module}.{key}": value for key, value in tensors.items()}

    layers = rewrite(src, out, repack, "Repacking AWQ as GPTQ")
    write_config(out, config, {"quant_method": "gptq", "bits": 4, "group_size": awq.group_size, "sym": False,
                               "desc_act": False, "checkpoint_format": "gptq"})
    logger.info("%d AWQ layers repacked as GPTQ (4-bit, groups of %d, asymmetric)", layers, awq.group_size)
