"""What the speculative-decoding tests share (test_speculative.py, test_speculative_async.py,
test_speculative_device.py): the engine settings, prompts that n-gram drafts copy from, a run's outputs and stats."""

from __future__ import annotations

import torch

from cvllm import LLM, SamplingParams

ENGINE = {"dtype": "float32", "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 128}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# two tokens favoured far above the rest: the output is made of them, so drafts copied from it are often right (and
# sometimes wrong)
BIAS = {300: 100.0, 301: 100.0}


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a random phrase: drafts copied from them are often right, and often wrong."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(n):
        phrase = torch.randint(3, 512, (int(torch.randint(3, 9, (1,), generator=generator)),), generator=generator)
        prompts.append(phrase.repeat(4).tolist() + torch.randint(3, 512, (2,), generator=generator).tolist())
    return prompts


def run(path, prompts, params, speculative: dict | None, **engine):
    """Each prompt's completions as (token ids, finish reason, text), and the engine's stats."""
    llm = LLM(model=str(path), **{**ENGINE, **engine}, speculative_config=speculative)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [[(list(c.token_ids), c.finish_reason, c.text) for c in out.outputs] for out in outputs], \
        llm.llm_engine.stats


def stops_and_lengths_match(path, speculative: dict, **engine) -> list:
    """Requests that end at a stop string, and at max_tokens, where those fall inside accepted drafts, each run alone
    (as one engine serves them one after another) with ``speculative`` and without: asserts the same tokens, finish
    reasons and texts; returns the speculating engines' stats (one for the stops, one for the lengths)."""
    prompts = repetitive_prompts(5, seed=3)
    free, _ = run(path, prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logit_bias=BIAS),
                  None)
    stops = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logit_bias=BIAS, stop=[out[0][2][20:26]])
             for out in free]
    lengths = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logit_bias=BIAS, logprobs=3)
               for n in (1, 2, 7, 13, 29)]
    stats = []
    for params, reason in ((stops, "stop"), (lengths, "length")):
        plain = [run(path, [p], s, None)[0][0][0] for p, s in zip(prompts, params)]
        llm = LLM(model=str(path), **{**ENGINE, **engine}, speculative_config=speculative)
        spec = [llm.generate([{"prompt_token_ids": p}], s)[0].outputs[0] for p, s in zip(prompts, params)]
        assert [(list(c.token_ids), c.finish_reason, c.text) for c in spec] == plain
        assert all(c.finish_reason == reason for c in spec)
        stats.append(llm.llm_engine.stats)
    return stats
