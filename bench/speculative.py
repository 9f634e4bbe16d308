"""Issue 22's speculative-decoding benchmark on a real model: copy-heavy tasks at batch 1.

    python bench/speculative.py --json OUT.json                          # the demo model, n-gram drafts
    python bench/speculative.py --model TARGET --draft-model DRAFT      # draft-model speculation on the tasks

Demo: SmolLM2-135M-Instruct (the demo GGUF), greedy, batch 1, on copy-heavy chat tasks (rewrite a given text with
one change; edit a given function; repeat a text): output tok/s without and with speculation (of the whole call,
and of the decode phase after the first token: "decode", which a prompt's prefill does not dilute; "paired": the
median ratio of runs made back to back, the two engines taking turns), the acceptance rate
and the mean tokens a verify step yields, and whether the outputs are the same token for token (in exact arithmetic
they are; in bf16 or a quantized model on a GPU, the verify step's kernels round differently from a decode step's,
so a near-tie may go the other way: docs/speculative.md). What a verify step costs on a large model, by batch size:
bench/verify_cost.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import git_commit  # noqa: E402

from cvllm import LLM, SamplingParams  # noqa: E402
from cvllm.testing.requirements import demo_model  # noqa: E402

TEXT = ("The committee met on Tuesday to review the budget for the new library. After a long discussion, the "
        "members agreed to increase the funding for children's books, to extend the opening hours on weekends, "
        "and to hire two more librarians before the end of the year. The chair thanked everyone for their work.\n\n"
        "The new library will open in the spring. Its reading room faces the river, and the old post office next "
        "door will become a workshop where children can learn to build and repair things. The architects said the "
        "building will use less energy than the old one, thanks to its thick walls and large windows.\n\n"
        "Volunteers are still needed for the opening week. Anyone who wants to help can write to the committee "
        "before the end of the month, or come to the next meeting, which will take place in the town hall.")
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


KV_POOL_BYTES = 2 << 30   # each engine's KV pool: a task's few hundred tokens need a few MB

class FirstToken:
    """A step observer: when the first step that returned a token ended (the prompt's prefill, read back)."""
    device_timing = False

    def __init__(self):
        self.at = None

    def on_step(self, record) -> None:
        if self.at is None and record.num_outputs:
            self.at = time.perf_counter()


def timed_generate(llm: LLM, prompts, params) -> tuple[list, float, float]:
    """The outputs, the whole call's seconds, and the seconds after the first token (batch 1: the decode phase)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    with llm.llm_engine.observers.observing(FirstToken()) as first:
        outputs = llm.generate(prompts, params) if not isinstance(prompts[0], list) else llm.chat(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    ended = time.perf_counter()
    return outputs, ended - started, ended - (first.at or started)


COUNTERS = ("spec_draft_tokens", "spec_accepted_tokens", "spec_verifications", "steps", "spec_guesses",
            "spec_guess_misses", "spec_lagged_steps")


def run_pair(make_llm, prompts, params, spec: dict, repeat: int = 1) -> dict:
    """The same prompts one at a time (batch 1) without and with speculation, each ``repeat`` times: its median
    time counts (a demo task decodes for ~0.1 s on the H200). Both engines live at once and take turns, run by run,
    the first of a pair alternating: the same code's plain tok/s moved 600-1,290 between calls on the H200, so
    measuring one engine's runs after the other's would let a drift inside the call pass for a speedup. Also
    ``paired_speedup``: the median of each pair's time ratio."""
    method = spec["method"]
    names = ("plain", method)
    llms = {}
    try:
        for name, config in zip(names, (None, spec)):
            llms[name] = make_llm(config)
            for _ in range(2):   # warm-up: kernels and graphs, then the shapes of a prompt the prefix cache holds
                timed_generate(llms[name], prompts[:1], params)
        before = {name: [getattr(llm.llm_engine.stats, c) for c in COUNTERS] for name, llm in llms.items()}
        seconds = {name: [[] for _ in prompts] for name in names}
        decode_seconds = {name: [[] for _ in prompts] for name in names}
        outputs = {name: [None] * len(prompts) for name in names}
        for i, prompt in enumerate(prompts):
            for r in range(repeat):   # greedy: the same tokens every time
                for name in (names if r % 2 == 0 else names[::-1]):
                    out, took, decoding = timed_generate(llms[name], [prompt], params)
                    seconds[name][i].append(took)
                    decode_seconds[name][i].append(decoding)
                    outputs[name][i] = list(out[0].outputs[0].token_ids)
        result = {name: summary(llms[name], before[name], outputs[name], seconds[name], decode_seconds[name], repeat)
                  for name in names}
    finally:
        for llm in llms.values():
            llm.shutdown()
    result["same_outputs"] = outputs["plain"] == outputs[method]
    result["speedup"] = round(result[method]["tok_s"] / result["plain"]["tok_s"], 3)
    if result["plain"]["decode_tok_s"] and result[method]["decode_tok_s"]:
        result["decode_speedup"] = round(result[method]["decode_tok_s"] / result["plain"]["decode_tok_s"], 3)
    # tokens per second of each pair's runs (their outputs may differ in length: a near-tie on a GPU)
    ratios = [(len(outputs[method][i]) / b) / (len(outputs["plain"][i]) / a)
              for i in range(len(prompts)) for a, b in zip(seconds["plain"][i], seconds[method][i])]
    result["paired_speedup"] = round(statistics.median(ratios), 3)
    return result


def summary(llm, before: list, outputs: list, seconds: list, decode_seconds: list, repeat: int) -> dict:
    """One engine's figures over the prompts: the median run of each prompt counts."""
    tokens = sum(len(o) for o in outputs)
    wall = sum(statistics.median(s) for s in seconds)
    decode_wall = sum(statistics.median(s) for s in decode_seconds)
    stats = llm.llm_engine.stats
    drafted, accepted, verifications, steps, guesses, misses, lagged = (
        (getattr(stats, c) - b) / repeat for c, b in zip(COUNTERS, before))   # a run's
    return {"async_scheduling": llm.llm_engine.async_scheduling,   # (the engine's, default or not)
            "tok_s": round(tokens / wall, 1),
            "tok_s_runs": [[round(len(o) / t, 1) for t in s] for o, s in zip(outputs, seconds)], "tokens": tokens,
            # after the first token (the prompt's prefill and its first step excluded): decode tok/s
            "decode_tok_s": round((tokens - len(outputs)) / decode_wall, 1) if decode_wall else None,
            "wall_s": round(wall, 3), "steps": steps, "ms_per_step": round(1e3 * wall / steps, 3),
            "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "mean_tokens_per_verify": round(1 + accepted / verifications, 2) if verifications else None,
            # async scheduling: next steps launched on a guessed outcome, and how many were wrong (void)
            "guesses": guesses, "guess_misses": misses,
            # device drafts: verify steps launched a step behind on inputs the device computed (ngram_device.py)
            "lagged_steps": lagged}


def command_flags(argv: list[str]) -> list[str]:
    """The flags that shaped the run, for the record: all but where its JSON went."""
    flags, skip = [], False
    for arg in argv:
        if not skip and not arg.startswith("--json"):
            flags.append(arg)
        skip = arg == "--json"
    return flags


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--draft-token-cost", type=float,
                    help="speculative_config's draft_token_cost (default: the backend's; 0: always K drafts)")
    ap.add_argument("--model", help="the target (default: the demo model)")
    ap.add_argument("--draft-model", help="the draft_model method's draft: a checkpoint with the target's tokenizer")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="launch each step before the last one is read back (the GPU's default; speculator.py)")
    ap.add_argument("--repeat", type=int, default=5, help="runs of each task; the median counts")
    ap.add_argument("--prompt-lookup-min", type=int, default=1,
                    help="the n-gram method's shortest suffix looked up (1: any earlier occurrence of the last token)")
    drafts = ap.add_mutually_exclusive_group()
    drafts.add_argument("--device-drafts", action="store_true",
                        help="n-gram drafts looked up on the device, verify steps launched a step behind "
                             "(ngram_device.py; the CUDA backend's default)")
    drafts.add_argument("--host-drafts", action="store_true", help="n-gram drafts looked up on the host")
    ap.add_argument("--json")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
            "prompt_lookup_min": args.prompt_lookup_min}
    if args.device_drafts or args.host_drafts:
        spec["device_drafts"] = args.device_drafts
    if args.draft_model:
        spec = {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": args.k}
    if args.draft_token_cost is not None:
        spec["draft_token_cost"] = args.draft_token_cost
    method = spec["method"]
    path = args.model or str(demo_model())
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    results = {}
    async_scheduling = args.async_scheduling or None   # (None: the backend's default)
    # both engines live at once (run_pair): a KV pool each that leaves room for the other
    memory = {"kv_cache_memory": KV_POOL_BYTES}
    for name, task in TASKS.items():
        results[name] = run_pair(
            lambda s: LLM(path, speculative_config=s, async_scheduling=async_scheduling, **memory),
            [[{"role": "user", "content": task}]], params, spec, args.repeat)
    print(f"{'task':<10}{'plain tok/s':>12}{method + ' tok/s':>18}{'speedup':>9}{'paired':>8}{'decode':>8}"
          f"{'accept':>8}{'tok/verify':>11}{'same':>6}")
    for name, r in results.items():
        print(f"{name:<10}{r['plain']['tok_s']:>12}{r[method]['tok_s']:>18}{r['speedup']:>9}{r['paired_speedup']:>8}"
              f"{r.get('decode_speedup')!s:>8}{r[method]['acceptance_rate']!s:>8}"
              f"{r[method]['mean_tokens_per_verify']!s:>11}{r['same_outputs']!s:>6}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "benchmark": "speculative", "commit": git_commit(), "date": datetime.date.today().isoformat(),
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "command": " ".join(["python bench/speculative.py", *command_flags(sys.argv[1:])]),
            "k": args.k, "max_tokens": args.max_tokens, "repeat": args.repeat,
            "async_scheduling_flag": args.async_scheduling,
            "device_drafts": True if args.device_drafts else False if args.host_drafts else None,
            "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
