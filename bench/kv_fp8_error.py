"""FP8 KV cache against the model's own dtype on the demo model (issue 18 item 5): greedy continuations of a few
chat prompts with ``kv_cache_dtype="fp8"`` and with "auto", reported, not asserted: how many tokens agree before
the first difference, and the mean / max |difference| of the chosen tokens' logprobs over the agreeing prefix.

    python bench/kv_fp8_error.py --json bench/results/<day>-cpu-kv_fp8_error-<commit>.json     # CPU, demo model
    python bench/kv_fp8_error.py --backend cuda --dtype bfloat16                               # on a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import command_line, git_commit  # noqa: E402

from cvllm import LLM, SamplingParams  # noqa: E402
from cvllm.demo import demo_model_path  # noqa: E402

PROMPTS = ["Explain how a hash table works, with an example.", "Write a short story about a lighthouse keeper.",
           "List the planets of the solar system and one fact about each.",
           "What are the differences between TCP and UDP?"]


def run(model: str, kv: str, args) -> list[tuple[list[int], list[float]]]:
    """Greedy continuations of PROMPTS: per prompt its tokens and their logprobs."""
    llm = LLM(model, kv_cache_dtype=kv, dtype=args.dtype, backend=args.backend)
    try:
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, logprobs=0)
        outputs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    finally:
        llm.shutdown()
    return [(list(o.outputs[0].token_ids), [e[t].logprob for e, t in zip(o.outputs[0].logprobs,
                                                                      o.outputs[0].token_ids)]) for o in outputs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="default: the demo model (cvllm fetch-demo)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--backend")
    ap.add_argument("--json")
    args = ap.parse_args()
    model = args.model or str(demo_model_path())
    report("kv_fp8_error", model, args, run(model, "auto", args), run(model, "fp8", args))


def report(bench: str, model: str, args, base: list, other: list) -> dict:
    """Per prompt, how many greedy tokens ``other`` agrees with ``base`` on before the first difference, and the
    mean / max |difference| of the chosen tokens' logprobs over that prefix; printed, and written to --json."""
    rows = []
    for (tokens_a, lp_a), (tokens_b, lp_b) in zip(base, other):
        agree = next((i for i, (a, b) in enumerate(zip(tokens_a, tokens_b)) if a != b), len(tokens_a))
        diffs = [abs(a - b) for a, b in zip(lp_a[:agree], lp_b[:agree])] or [0.0]
        rows.append({"agree_tokens": agree, "mean_abs_dlogprob": statistics.mean(diffs),
                     "max_abs_dlogprob": max(diffs)})
    result = {"bench": bench, "model": Path(model).name, "backend": args.backend or "default",
              "dtype": args.dtype, "tokens": args.tokens, "prompts": PROMPTS, "per_prompt": rows,
              "mean_abs_dlogprob": statistics.mean(r["mean_abs_dlogprob"] for r in rows),
              "agree_fraction": sum(r["agree_tokens"] for r in rows) / (args.tokens * len(rows)),
              "command": command_line(), "commit": git_commit()}
    for r in rows:
        print(f"agree {r['agree_tokens']:4d}/{args.tokens}  mean |dlogprob| {r['mean_abs_dlogprob']:.4f}  "
              f"max {r['max_abs_dlogprob']:.4f}")
    print(f"mean |dlogprob| {result['mean_abs_dlogprob']:.4f}, tokens agreeing before the first difference "
          f"{result['agree_fraction']:.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
