"""Issue 21's structured-output benchmark: 64 streams of 1024-token prompts, max_tokens 256, every request under
the same bounded JSON schema (bench/schemas/bounded_answer.json), against the same requests unconstrained, on a
Llama-3-8B shape with random bf16 weights; and the compile time per request of the schemas in bench/schemas/.

    python bench/structured_throughput.py --json $OUT/structured.json     # on the H200 (one device call)
    python bench/structured_throughput.py --tiny                          # a CPU rehearsal on a tiny shape

The model's vocabulary: a byte-level BPE trained here on the Python standard library's sources (~123k tokens, a
realistic trie for llguidance; the logits stay 128256 wide, as a padded vocabulary does). A random model under a
grammar writes until the grammar ends, so the constrained run's outputs are shorter than 256: the unconstrained
run is given each request's constrained output length (ignore_eos), so both runs generate the same tokens in the
same batch shapes and the ratio of their output tok/s is the cost of the masks alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import random
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import git_commit  # noqa: E402
from random_checkpoint import random_checkpoint  # noqa: E402

from cvllm.engine.build import build_engine  # noqa: E402
from cvllm.engine.config import EngineConfig  # noqa: E402
from cvllm.sampling_params import SamplingParams  # noqa: E402
from cvllm.structured_output import StructuredOutputsParams  # noqa: E402
from cvllm.structured_output.params import _compile, grammar_text  # noqa: E402
from cvllm.tokenizer import Tokenizer  # noqa: E402

SCHEMAS = Path(__file__).parent / "schemas"


def stdlib_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on the standard library's sources; id 0 is the end token."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  special_tokens=["<|end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator((p.read_text(encoding="utf-8", errors="replace") for p in files), trainer)
    return Tokenizer(hf, eos_token="<|end|>")


def compile_times(tokenizer: Tokenizer, vocab: int, repeats: int) -> dict:
    """Per schema: grammar text + matcher + first mask, cold (the grammar cache cleared), in ms."""
    from llguidance import LLMatcher, LLTokenizer
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    ll = LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=vocab, eos_token=[0])
    mask = allocate_token_bitmask(1, vocab)
    result = {}
    for path in sorted(SCHEMAS.glob("*.json")):
        schema = json.loads(path.read_text())
        try:
            StructuredOutputsParams(json=schema)
        except ValueError as e:   # a keyword llguidance does not implement: the server's 400
            result[path.stem] = {"rejected": str(e)}
            continue
        times = []
        for _ in range(repeats):
            _compile.cache_clear()
            started = time.perf_counter()
            matcher = LLMatcher(ll, grammar_text(StructuredOutputsParams(json=schema)), log_level=0)
            fill_next_token_bitmask(matcher, mask)
            times.append((time.perf_counter() - started) * 1e3)
            assert not matcher.is_error(), matcher.get_error()
        times.sort()
        result[path.stem] = {"p50_ms": round(statistics.median(times), 3),
                             "p99_ms": round(times[min(len(times) - 1, int(len(times) * 0.99))], 3)}
    return result


def run(engine, prompts: list[list[int]], params: list[SamplingParams], tag: str, device: str) -> dict:
    grammars = engine.grammars
    mask_s = []
    if grammars is not None:   # time each step's mask fill
        fill = grammars.bitmask

        def timed(seqs):
            started = time.perf_counter()
            out = fill(seqs)
            mask_s.append(time.perf_counter() - started)
            return out
        grammars.bitmask = timed
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for i, (ids, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"{tag}-{i}", ids, p)
    lengths: dict[str, int] = {}
    while engine.has_unfinished():
        for seq in engine.step():
            lengths[seq.request_id] = seq.num_output_tokens
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - started
    texts = {}
    for i in range(len(prompts)):
        seq = engine.requests[f"{tag}-{i}"][0]
        texts[i] = (seq.output_token_ids, seq.finish_reason)
        engine.release_request(f"{tag}-{i}")
    if grammars is not None:
        grammars.bitmask = fill
    out = [len(texts[i][0]) for i in range(len(prompts))]
    return {"wall_s": round(wall, 3), "output_tokens": sum(out), "output_tok_s": round(sum(out) / wall, 1),
            "lengths": out, "outputs": texts, "mask_ms_per_step": round(1e3 * statistics.mean(mask_s), 3)
            if mask_s else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a CPU rehearsal on a tiny shape")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--schema", default=str(SCHEMAS / "bounded_answer.json"))
    ap.add_argument("--compile-repeats", type=int, default=20)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    shape, dtype = ("tiny", torch.float32) if device == "cpu" else ("llama3-8b", torch.bfloat16)
    if args.tiny:
        args.num_requests, args.prompt_len = min(args.num_requests, 8), min(args.prompt_len, 64)
    started = time.perf_counter()
    checkpoint = random_checkpoint(shape, dtype, device)
    vocab = checkpoint.config.vocab_size
    tokenizer = stdlib_tokenizer(min(vocab, 128256))
    print(f"tokenizer: {tokenizer.vocab_size} tokens (logits {vocab}) in {time.perf_counter() - started:.1f} s")
    compiles = compile_times(tokenizer, vocab, args.compile_repeats)
    checkpoint = dataclasses.replace(checkpoint, tokenizer=tokenizer)
    engine = build_engine(EngineConfig(model=checkpoint, dtype=str(dtype).removeprefix("torch."),
                                       max_num_seqs=args.num_requests, backend=device))
    rng = random.Random(0)
    top = tokenizer.vocab_size

    def fresh_prompts() -> list[list[int]]:   # each run its own: no run may hit the prefix cache of another
        return [[rng.randrange(1, top) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]

    schema = json.loads(Path(args.schema).read_text())
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens,
                                  structured_outputs={"json": schema}) for i in range(args.num_requests)]
    # warm-up at the measured batch size, both ways: graphs, kernels of every shape, the grammar tokenizer
    run(engine, fresh_prompts(), constrained, "warmup-schema", device)
    run(engine, fresh_prompts(), [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens // 4,
                                                 ignore_eos=True) for i in range(args.num_requests)],
        "warmup-free", device)
    with_schema = run(engine, fresh_prompts(), constrained, "schema", device)
    free = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
            for i, n in enumerate(with_schema["lengths"])]
    without = run(engine, fresh_prompts(), free, "free", device)
    valid = 0
    for ids, reason in with_schema["outputs"].values():
        try:
            json.loads(tokenizer.decode(ids))
            valid += reason == "stop"
        except json.JSONDecodeError:
            pass
    for r in (with_schema, without):
        r.pop("outputs")
        lengths = r.pop("lengths")
        r["mean_output_len"] = round(statistics.mean(lengths), 1)
    ratio = with_schema["output_tok_s"] / without["output_tok_s"]
    print(f"{'run':<14}{'tok/s':>10}{'wall s':>9}{'mean len':>10}{'mask ms/step':>14}")
    for name, r in (("json schema", with_schema), ("unconstrained", without)):
        print(f"{name:<14}{r['output_tok_s']:>10}{r['wall_s']:>9}{r['mean_output_len']:>10}"
              f"{r['mask_ms_per_step'] if r['mask_ms_per_step'] is not None else '-':>14}")
    print(f"ratio {ratio:.3f} (target >= 0.9); outputs that parse and ended by the grammar: {valid}/"
          f"{args.num_requests}")
    print("compile (grammar + matcher + first mask), ms:", json.dumps(compiles))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "benchmark": "structured_throughput", "commit": git_commit(), "date": datetime.date.today().isoformat(),
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "shape": shape,
            "command": "python bench/structured_throughput.py" + (" --tiny" if args.tiny else ""),
            "requests": args.num_requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
            "schema": Path(args.schema).name, "tokenizer_vocab": tokenizer.vocab_size, "logits_vocab": vocab,
            "with_schema": with_schema, "unconstrained_same_lengths": without, "ratio": round(ratio, 3),
            "valid_outputs": valid, "compile_ms": compiles}, indent=2) + "\n")


if __name__ == "__main__":
    main()
