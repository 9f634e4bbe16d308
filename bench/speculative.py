"""Issue 22's speculative-decoding benchmark (n-gram drafts).

    python bench/speculative.py --json OUT.json                 # the demo model, copy-heavy tasks, batch 1
    python bench/speculative.py --verify-cost --json OUT.json   # one verify step of K drafts against a decode step

Demo: SmolLM2-135M-Instruct (the demo GGUF), greedy, batch 1, on copy-heavy chat tasks (rewrite a given text with
one change; edit a given function): output tok/s without and with n-gram speculation, the acceptance rate and the
mean tokens a verify step yields; the outputs must be the same token for token.

Verify cost: a Llama-3-8B shape with random weights (on CUDA; a tiny shape on the CPU), batch 1 at a 1024-token
context. The prompt repeats a phrase, so the n-gram proposes K drafts every step, and the random model rejects
them (mostly): the time per engine step with speculation over the time per plain decode step is the cost of a
verify step of K drafts in decode steps (target ≤ 1.15 for K = 4).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import git_commit  # noqa: E402

from cvllm import LLM, SamplingParams  # noqa: E402

TEXT = ("The committee met on Tuesday to review the budget for the new library. After a long discussion, the "
        "members agreed to increase the funding for children's books, to extend the opening hours on weekends, "
        "and to hire two more librarians before the end of the year. The chair thanked everyone for their work.")
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
'''
TASKS = {
    "rewrite": f"Rewrite the following text exactly, but change Tuesday to Friday:\n\n{TEXT}",
    "code_edit": f"Here is a Python function:\n\n{CODE}\nRewrite the whole function with the variable `subtotal` "
                 f"renamed to `net_total`. Keep everything else the same.",
    "repeat": f"Repeat this text word for word:\n\n{TEXT}",
}


def timed_generate(llm: LLM, prompts, params) -> tuple[list, float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params) if not isinstance(prompts[0], list) else llm.chat(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return outputs, time.perf_counter() - started


def run_pair(make_llm, prompts, params, spec: dict) -> dict:
    """The same prompts one at a time (batch 1) without and with speculation."""
    result = {}
    for name, config in (("plain", None), ("ngram", spec)):
        llm = make_llm(config)
        timed_generate(llm, prompts[:1], params)   # warm-up (kernels, graphs)
        stats = llm.llm_engine.stats
        before = (stats.spec_draft_tokens, stats.spec_accepted_tokens, stats.spec_verifications, stats.steps)
        tokens, wall, outputs = 0, 0.0, []
        for prompt in prompts:
            out, seconds = timed_generate(llm, [prompt], params)
            outputs.append(list(out[0].outputs[0].token_ids))
            tokens += len(outputs[-1])
            wall += seconds
        drafted, accepted, verifications, steps = (after - b for after, b in zip(
            (stats.spec_draft_tokens, stats.spec_accepted_tokens, stats.spec_verifications, stats.steps), before))
        result[name] = {"tok_s": round(tokens / wall, 1), "tokens": tokens, "wall_s": round(wall, 3), "steps": steps,
                        "ms_per_step": round(1e3 * wall / steps, 3),
                        "outputs": outputs, "draft_tokens": drafted, "accepted_tokens": accepted,
                        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
                        "mean_tokens_per_verify": round(1 + accepted / verifications, 2) if verifications else None}
        llm.shutdown()
    result["same_outputs"] = result["plain"].pop("outputs") == result["ngram"].pop("outputs")
    result["speedup"] = round(result["ngram"]["tok_s"] / result["plain"]["tok_s"], 3)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verify-cost", action="store_true")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if args.verify_cost:
        from random_checkpoint import random_checkpoint

        shape, dtype = ("llama3-8b", torch.bfloat16) if device == "cuda" else ("tiny", torch.float32)
        checkpoint = random_checkpoint(shape, dtype, device)
        phrase = list(range(100, 116))
        prompts = [{"prompt_token_ids": phrase * 64}]   # 1024 tokens
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        # every step drafts (the acceptance floor off): each verify step costs K + 1 positions and yields 1 token
        spec = {**spec, "prompt_lookup_min": 1, "min_acceptance_rate": 0.0}
        results = {"verify_cost": run_pair(lambda s: LLM(checkpoint, dtype=str(dtype).removeprefix("torch."),
                                                         speculative_config=s), prompts * 3, params, spec)}
        r = results["verify_cost"]
        # per step, whatever was accepted (the prefill step of each prompt is in both counts)
        r["verify_step_in_decode_steps"] = round(r["ngram"]["ms_per_step"] / r["plain"]["ms_per_step"], 3)
        print(f"{shape}: decode step {r['plain']['ms_per_step']} ms, verify step of {args.k} drafts "
              f"{r['ngram']['ms_per_step']} ms = {r['verify_step_in_decode_steps']} decode steps (acceptance "
              f"{r['ngram']['acceptance_rate']}, {r['ngram']['tok_s']} against {r['plain']['tok_s']} tok/s)")
    else:
        from cvllm.testing.requirements import demo_model

        path = str(demo_model())
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        results = {}
        for name, task in TASKS.items():
            results[name] = run_pair(lambda s: LLM(path, speculative_config=s),
                                     [[{"role": "user", "content": task}]], params, spec)
        print(f"{'task':<10}{'plain tok/s':>12}{'ngram tok/s':>12}{'speedup':>9}{'accept':>8}{'tok/verify':>11}"
              f"{'same':>6}")
        for name, r in results.items():
            print(f"{name:<10}{r['plain']['tok_s']:>12}{r['ngram']['tok_s']:>12}{r['speedup']:>9}"
                  f"{r['ngram']['acceptance_rate']!s:>8}{r['ngram']['mean_tokens_per_verify']!s:>11}"
                  f"{r['same_outputs']!s:>6}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "benchmark": "speculative", "commit": git_commit(), "date": datetime.date.today().isoformat(),
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "command": "python bench/speculative.py" + (" --verify-cost" if args.verify_cost else ""),
            "k": args.k, "max_tokens": args.max_tokens, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
