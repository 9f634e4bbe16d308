"""``cvllm convert SRC OUT --to gptq``: an unquantized Hugging Face checkpoint rewritten as a GPTQ checkpoint
(AutoGPTQ's "gptq" format, which cvllm, vLLM and transformers read), quantized by round-to-nearest (rtn.py; 4 bits,
symmetric, groups of 128 unless told otherwise). The job candle-vllm's convert scripts do for its Marlin path.

Every 2-D ``*_proj.weight`` of the decoder layers whose inputs are whole groups becomes ``qweight`` (int32 [in /
pack, out], inputs packed into words in order), ``qzeros`` (int32 [groups, out / pack], each zero stored minus one
as the "gptq" format does), ``scales`` (fp16 [groups, out]) and ``g_idx`` (int32 [in], i // group_size), MoE
experts' per-expert projections included (moe.py loads them); embeddings, the LM head, norms, routers and
everything else are copied unchanged. One tensor is in memory at a
time; the output keeps the source's shard files (and index), config.json gains ``quantization_config``, and the
tokenizer and other files are copied.

An AWQ checkpoint (AutoAWQ's GEMM layout, the job of candle-vllm's convert_awq_marlin.py) is repacked instead, not
requantized: the same integers, zeros and scales in GPTQ's layout (awq_to_gptq.py), asymmetric, so the copy computes
exactly what the AWQ checkpoint does.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from cvllm_marlin.awq_to_gptq import repack_awq
from cvllm_marlin.packing import pack_columns, pack_rows
from cvllm_marlin.rewrite import rewrite, write_config
from cvllm_marlin.rtn import quantize_rtn

logger = logging.getLogger(__name__)

DEFAULTS = {"bits": 4, "group_size": 128, "sym": True}


def quantizable(name: str, tensor: torch.Tensor, group_size: int) -> bool:
    """A decoder layer's projection weight with whole groups of inputs (an MoE expert's too)."""
    return (name.endswith("_proj.weight") and ".layers." in name and tensor.dim() == 2
            and tensor.is_floating_point() and (group_size == -1 or tensor.shape[1] % group_size == 0)
            and tensor.shape[0] % (32 // 4) == 0)


def gptq_tensors(prefix: str, weight: torch.Tensor, bits: int, group_size: int, sym: bool) -> dict:
    rtn = quantize_rtn(weight, bits, group_size, sym)
    in_features = weight.shape[1]
    zeros = (rtn.zeros.to(torch.int64) - 1) & ((1 << bits) - 1)   # the "gptq" (v1) format stores zero - 1
    return {
        f"{prefix}.qweight": pack_rows(rtn.q.t(), bits),
        f"{prefix}.qzeros": pack_columns(zeros, bits),
        f"{prefix}.scales": rtn.scales,
        f"{prefix}.g_idx": (torch.arange(in_features) // rtn.group_size).to(torch.int32),
    }


def convert_to_gptq(src: Path, out: Path, options: dict) -> None:
    config = json.loads((src / "config.json").read_text())
    quant = config.get("quantization_config")
    if quant and quant.get("quant_method") == "awq":
        repack_awq(src, out, config, options)
        return
    settings = {key: value if (value := options.get(key)) is not None else default
                for key, default in DEFAULTS.items()}
    bits, group_size, sym = settings["bits"], settings["group_size"], settings["sym"]
    if bits not in (4, 8):
        raise ValueError(f"--bits {bits}: gptq conversion writes 4 or 8 bits")
    if group_size != -1 and (group_size < 32 or group_size % 32):
        raise ValueError(f"--group-size {group_size}: a multiple of 32, or -1")
    if quant:
        raise ValueError(f"{src} is already quantized ({quant.get('quant_method')}); an unquantized or AWQ "
                         f"checkpoint converts to gptq")

    def quantize(name: str, tensor: torch.Tensor, f) -> dict[str, torch.Tensor] | None:
        if not quantizable(name, tensor, group_size):
            return None
        return gptq_tensors(name.removesuffix(".weight"), tensor, bits, group_size, sym)

    quantized = rewrite(src, out, quantize, "Quantizing to GPTQ")
    write_config(out, config, {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym,
                               "desc_act": False, "checkpoint_format": "gptq"})
    logger.info("%d projections to %d-bit, groups of %d", quantized, bits, group_size)
    if not quantized:
        logger.warning("no projection had whole groups of %d inputs: the copy is unquantized", group_size)
