"""The demo model's LM head from its quantized embedding (int4 planes, plugins/quant-gguf int4planes.py) against the
exact float32 product and against a bf16 copy of the table (issue 24): logit error and top-1 agreement over real
hidden states, and the cost of one head call at 1, 4 and 16 rows.

    python bench/cpu_lm_head_error.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --json out.json

The hidden states are the final-norm outputs of the bf16 engine generating greedily from a few prompts (captured at
the head); "exact" is hidden (as float32) times the dequantized table in float32.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import git_commit  # noqa: E402

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain what a compiler does.",
           "List three prime numbers and say why they are prime.", "Translate 'good morning' to Spanish.",
           "Tell me a short story about a robot."]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args()
    os.environ.setdefault("CVLLM_GGUF_QUANTIZED_TABLES", "1")
    torch.set_num_threads(2)
    from cvllm import LLM, SamplingParams
    from cvllm_gguf.dequant import dequantize
    from cvllm_gguf.reader import open_gguf_files

    llm = LLM(args.gguf, dtype="bfloat16", num_kv_blocks=256)
    model = llm.llm_engine.runner.model
    table = model.lm_head.tied_to[0] if model.lm_head.tied_to else model.lm_head
    assert table.gguf_compute == "int4planes", "run with CVLLM_GGUF_QUANTIZED_TABLES=1 on the bf16 path"
    captured: list[torch.Tensor] = []
    original = model.compute_logits
    model.compute_logits = lambda hidden: (captured.append(hidden.detach().clone()), original(hidden))[1]
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    llm.chat(chats, SamplingParams(temperature=0, max_tokens=args.tokens))
    model.compute_logits = original
    hidden = torch.cat(captured).bfloat16()

    gguf = open_gguf_files(args.gguf)[0]
    info = next(t for t in gguf.tensors if t.name == "token_embd.weight")
    weight = dequantize(gguf.raw(info), info.qtype, info.shape)
    exact = hidden.float() @ weight.float().t()
    bf16_copy = (hidden @ weight.bfloat16().t()).float()
    planes = model.compute_logits(hidden).float()

    def stats(logits: torch.Tensor) -> dict:
        err = (logits - exact).abs()
        return {"mean_abs_error": round(float(err.mean()), 5), "max_abs_error": round(float(err.max()), 4),
                "top1_agreement": round(float((logits.argmax(-1) == exact.argmax(-1)).float().mean()), 4)}

    def cost(rows: int, call) -> float:
        x = hidden[:rows].contiguous()
        call(x)
        start = time.perf_counter()
        for _ in range(20):
            call(x)
        return round((time.perf_counter() - start) / 20 * 1e3, 3)

    wb = weight.bfloat16()
    result = {"commit": git_commit(), "rows": hidden.shape[0],
              "scales_dtype": str(table.int4_planes.scales_zeros.dtype),
              "planes": stats(planes), "bf16_copy": stats(bf16_copy),
              "ms_per_call": {str(m): {"planes": cost(m, model.compute_logits),
                                       "bf16_copy": cost(m, lambda x: x @ wb.t())} for m in (1, 4, 16)},
              "load_avg": os.getloadavg()[0], "capability": torch.backends.cpu.get_cpu_capability()}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
