"""Makes smollm2_greedy.json: transformers' greedy continuations of the SmolLM2-135M-Instruct Q4_1 GGUF.

transformers dequantizes the GGUF to float32 (with the gguf package) and runs its own Llama; its
greedy tokens are the oracle for cvllm's exact (float32) path. Loading takes ~20 s, so the result
is committed and the test only runs cvllm. Needs transformers (5.24), gguf (0.19), accelerate.

    python plugins/quant-gguf/tools/make_smollm2_greedy.py /path/to/SmolLM2-135M-Instruct.Q4_1.gguf

EOS is not special here (as with ignore_eos): each step takes the argmax of all logits, and the
margin between the best and second-best logit is recorded so near-ties are visible.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

NEW_TOKENS = 32
CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "Name three primary colors."]
TEXTS = ["The quick brown fox", "def fibonacci(n):\n", "Once upon a time, in a small village by the river,"]


@torch.inference_mode()
def greedy(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    ids, margins = [], []
    out = model(torch.tensor([prompt]), use_cache=True)
    for _ in range(NEW_TOKENS):
        logits = out.logits[0, -1].float()
        top = torch.topk(logits, 2)
        ids.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        out = model(torch.tensor([[ids[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return ids, margins


def main(gguf_path: str) -> None:
    path = Path(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    cases = []
    for question in CHATS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        cases.append({"kind": "chat", "text": question, "prompt_token_ids": ids})
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        cases.append({"kind": "text", "text": text, "prompt_token_ids": ids})
    for case in cases:
        case["output_token_ids"], margins = greedy(model, case["prompt_token_ids"])
        case["min_logit_margin"] = round(min(margins), 4)
        case["output_text"] = tokenizer.decode(case["output_token_ids"])
        print(case["text"], "->", repr(case["output_text"]), "min margin", case["min_logit_margin"])
    head = {"model": path.name, "made_by": "transformers " + transformers.__version__ + ", float32",
            "new_tokens": NEW_TOKENS}
    lines = [json.dumps(case, ensure_ascii=False) for case in cases]  # one case per line
    text = json.dumps(head)[:-1] + ', "cases": [\n' + ",\n".join(lines) + "\n]}\n"
    (Path(__file__).parent.parent / "tests" / "data" / "smollm2_greedy.json").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1])
