"""What rounding only the LM head costs, on the demo model and real text (issue 18: ``CVLLM_ISQ_LM_HEAD=fp8``):
the table (SmolLM2's tied 49152 x 576 embedding, as its GGUF holds it) rounded to e4m3 with a scale a row (--isq fp8's
rounding) and to GGUF types, against the table as it is, everything else unchanged (a float32 engine).

    python bench/lm_head_rounding.py --json out.json

Per form: the mean and largest |change| of the logprob of each text's actual next token, and at how many positions
the greedy choice stays the same. The table is already Q4_1 (16 levels a 32-value block): a type at least that fine
(Q8_0) changes almost nothing, so the figures compare forms; a bf16 checkpoint's head would lose somewhat more.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import git_commit  # noqa: E402

TEXTS = [
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after the "
    "engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "print([fibonacci(i) for i in range(10)])\n",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to synthesize foods "
    "from carbon dioxide and water. It generally involves the green pigment chlorophyll.",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter and his three "
    "daughters. Every morning he went into the woods with his axe.",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    from cvllm import LLM
    from cvllm.demo import demo_model_path
    from cvllm_fp8.linear_method import dequantize, quantize_rows
    from cvllm_gguf.dequant import dequantize as gguf_dequantize
    from cvllm_gguf.quant_types import GGMLType
    from cvllm_gguf.quantize import quantize

    llm = LLM(str(demo_model_path()), dtype="float32", num_kv_blocks=256)
    tokenizer, model = llm.get_tokenizer(), llm.llm_engine.runner.model
    table = model.model.embed_tokens(torch.arange(model.lm_head.num_embeddings)).float()
    prompts = [tokenizer.encode(text) for text in TEXTS]
    reference = llm.llm_engine.prompt_logits(prompts)
    forms = {"fp8 (e4m3, a scale a row)": dequantize(*quantize_rows(table)), "bf16": table.bfloat16().float()}
    for qtype in (GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q4_0):
        forms[qtype.name] = gguf_dequantize(quantize(table, qtype), qtype, tuple(table.shape)).float()
    result = {"commit": git_commit(), "positions": sum(map(len, prompts)), "forms": {}}
    for name, rounded in forms.items():
        model.lm_head.compute_logits = lambda hidden, rounded=rounded: hidden.float() @ rounded.T
        changes, same = [], 0
        for ids, want, got in zip(prompts, reference, llm.llm_engine.prompt_logits(prompts)):
            following = torch.tensor(ids[1:])[:, None]
            changes.append((want.log_softmax(-1)[:-1].gather(1, following)
                            - got.log_softmax(-1)[:-1].gather(1, following)).abs().flatten())
            same += int((want.argmax(-1) == got.argmax(-1)).sum())
        change = torch.cat(changes)
        result["forms"][name] = {"table_relative_error": round(float((rounded - table).norm() / table.norm()), 4),
                                 "mean_abs_logprob_change": round(float(change.mean()), 4),
                                 "max_abs_logprob_change": round(float(change.max()), 4), "greedy_same": same}
    llm.shutdown()
    print(f"{'head':28} {'table rel. err':>14} {'mean |d lp|':>11} {'max |d lp|':>10} {'greedy same':>11}")
    for name, row in result["forms"].items():
        print(f"{name:28} {row['table_relative_error']:14.4f} {row['mean_abs_logprob_change']:11.4f} "
              f"{row['max_abs_logprob_change']:10.4f} {row['greedy_same']:>6}/{result['positions']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
