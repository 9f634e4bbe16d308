"""llguidance vs xgrammar for JSON-schema constrained decoding, measured on the CPU (issue 21).

A library that is not importable is reported as skipped, so this runs in any venv; xgrammar (it needs transformers,
triton and tvm-ffi) lives in a venv of its own. Run it in cvllm's venv first: that run builds the vocabularies and
tokenizes each schema's example ("examples"[0] of each bench/schemas file) and leaves them in cvllm's cache dir for
the other venv. Vocabularies: SmolLM2's 49k from the demo GGUF via cvllm's Tokenizer.token_bytes, and the 131k
Tekken one (Mistral NeMo's; a JSON file in the mistral-common wheel) with a byte-pair encoder written here.
Each run merges its numbers into bench/results/DATE-cpu-grammar-libraries.json and prints the table of all held.
Both libraries run with their defaults: flexible whitespace; xgrammar's strict_mode (no undeclared properties).

    python bench/grammar_libraries.py --tekken PATH/tekken_240911.json   # cvllm's venv: llguidance
    XG_VENV/bin/python bench/grammar_libraries.py                          # then xgrammar's venv
"""

from __future__ import annotations

import argparse
import base64
import importlib.metadata as metadata
import json
import math
import os
import pickle
import platform
import time
from datetime import date
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ARITH = '{s} expr\nexpr{d} term (("+" | "-") term)*\nterm{d} factor (("*" | "/") factor)*\nfactor{d} {num}\n'
FEATURES = {"regex": (r"\+[0-9]{1,3}-[0-9]{3}-[0-9]{4}", "+1-555-0123"),
            "choice": (["positive", "negative", "neutral"], "neutral"),
            "lark": (ARITH.format(s="start:", d=":", num='NUMBER | "(" expr ")"\nNUMBER: /[0-9]+/'), "(1+2)*34-5"),
            "gbnf": (ARITH.format(s="root ::=", d=" ::=", num='[0-9]+ | "(" expr ")"'), "(1+2)*34-5")}
# invalid instances (keyword, schema, top-level properties replaced in its example): enforced = refused
PROBES = [("multipleOf", "product_item", {"price": 24.999}), ("uniqueItems", "product_item", {"tags": ["a", "a"]}),
          ("if/then", "invoice", {"payment": {"method": "card"}}), ("minimum", "tool_get_weather", {"days": 0}),
          ("maxProperties", "invoice", {"metadata": {f"k{i}": "v" for i in range(11)}}),
          ("maxLength", "bounded_answer", {"answer": "x" * 101}), ("pattern", "person_record", {"phone": "12345"}),
          ("format: email", "pydantic_order", {"customer_email": "not-an-email"}),
          ("format: date-time", "github_issue", {"created_at": "yesterday"})]


def load_schemas() -> dict[str, tuple[dict, object]]:
    files = {p.stem: json.loads(p.read_text()) for p in sorted((HERE / "schemas").glob("*.json"))}
    return {name: ({k: v for k, v in s.items() if k != "examples"}, s["examples"][0]) for name, s in files.items()}


def texts(schemas) -> dict[str, str]:
    """What each vocabulary tokenizes: the examples, the probes and the grammar samples."""
    out = {f"schema:{name}": json.dumps(ex, ensure_ascii=False) for name, (_, ex) in schemas.items()}
    out |= {f"probe:{kw}": json.dumps({**schemas[name][1], **patch}, ensure_ascii=False) for kw, name, patch in PROBES}
    return out | {f"feature:{kind}": sample for kind, (_, sample) in FEATURES.items()}


def smollm2_vocab() -> dict:
    from cvllm.demo import demo_model_path
    from cvllm_gguf.checkpoint import open_gguf_checkpoint
    ckpt = open_gguf_checkpoint(demo_model_path(allow_fetch=True))
    tok = ckpt.tokenizer  # eos first, then llama.cpp's other end-of-generation ids
    eos = [tok.eos_token_id] + sorted(set(ckpt.generation_config["eos_token_id"]) - {tok.eos_token_id})
    return {"source": "SmolLM2-135M-Instruct demo GGUF, cvllm Tokenizer.token_bytes",
            "tokens": [tok.token_bytes(i) for i in range(tok.vocab_size)], "special": sorted(tok.special_ids),
            "eos": eos, "tokenizer_json": tok.tokenizer.to_str(), "encode": lambda s: tok.encode(s, False)}


def tekken_vocab(path: Path) -> dict:
    """Tekken: tiktoken-style ranks (id = 1000 specials + rank), pre-split by its regex, then byte-pair merges."""
    import regex
    spec = json.loads(path.read_text())
    n_special, size = spec["config"]["default_num_special_tokens"], spec["config"]["default_vocab_size"]
    ranked = [base64.b64decode(t["token_bytes"]) for t in spec["vocab"][:size - n_special]]
    ranks, pattern = {b: i for i, b in enumerate(ranked)}, regex.compile(spec["config"]["pattern"])

    def bpe(piece: bytes) -> list[int]:
        parts = [piece[i:i + 1] for i in range(len(piece))]
        while len(parts) > 1:
            rank, i = min((ranks.get(parts[i] + parts[i + 1], math.inf), i) for i in range(len(parts) - 1))
            if rank == math.inf:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return [n_special + ranks[p] for p in parts]

    names = {0: "<unk>", 1: "<s>", 2: "</s>"}
    return {"source": f"{path.name} (mistral-common 1.12.0 wheel), id = {n_special} specials + rank",
            "tokens": [names.get(i, f"<SPECIAL_{i}>").encode() for i in range(n_special)] + ranked,
            "special": list(range(n_special)), "eos": [2], "tokenizer_json": None,
            "encode": lambda s: [t for piece in pattern.findall(s) for t in bpe(piece.encode())]}


class LLGuidance:
    name = "llguidance"

    def __init__(self):
        import llguidance as llg
        import llguidance.torch as llt
        self.llg, self.version = llg, llg.__version__
        self.matcher = lambda ctx, grammar: llg.LLMatcher(ctx, grammar, log_level=0)
        self.fill, self.apply = llt.fill_next_token_bitmask, llt.apply_token_bitmask_inplace
        self.consume = lambda matcher, token: matcher.consume_token(token)
        pool = llg.LLExecutor(num_threads=os.cpu_count())
        self.fill_batch = lambda ms, bitmask: llt.fill_next_token_bitmask_par(
            pool, [(m, i) for i, m in enumerate(ms)], bitmask)

    def setup(self, vocab):
        class Vocab:  # what TokenizerWrapper reads: token bytes, special ids (never text), eos, an encoder
            eos_token_id, bos_token_id = vocab["eos"][0], None
            tokens, special_token_ids = vocab["tokens"], vocab["special"]

            def __call__(self, text):
                return vocab["encode"](text) if "encode" in vocab else []
        return self.llg.LLTokenizer(self.llg.TokenizerWrapper(Vocab()), eos_token=vocab["eos"])

    def grammar(self, ctx, kind, text, lenient=False, cached=False):
        if kind == "json":
            grammar = self.llg.LLMatcher.grammar_from_json_schema(text, overrides={"lenient": lenient})
        else:
            grammar = self.llg.grammar_from(kind, json.dumps(text) if kind == "choice" else text)
        matcher = self.matcher(ctx, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar, matcher


class XGrammar:
    name = "xgrammar"

    def __init__(self):
        import xgrammar as xgr
        self.xgr, self.version = xgr, metadata.version("xgrammar")
        self.matcher = lambda ctx, compiled: xgr.GrammarMatcher(compiled)
        self.fill = lambda matcher, bitmask: matcher.fill_next_token_bitmask(bitmask)
        self.consume = lambda matcher, token: matcher.accept_token(token)
        self.apply, batch = xgr.apply_token_bitmask_inplace, xgr.BatchGrammarMatcher()
        self.fill_batch = lambda ms, bitmask: batch.batch_fill_next_token_bitmask(ms, bitmask)

    def setup(self, vocab):
        """Special tokens as b"": xgrammar reads a raw token's bytes as text ("<|im_end|>" would match "<"...)."""
        special = set(vocab["special"])
        raw = [b"" if i in special else t for i, t in enumerate(vocab["tokens"])]
        info = self.xgr.TokenizerInfo(raw, self.xgr.VocabType.RAW, vocab_size=len(raw), stop_token_ids=vocab["eos"])
        return {False: self.xgr.GrammarCompiler(info, cache_enabled=False), True: self.xgr.GrammarCompiler(info)}

    def grammar(self, ctx, kind, text, lenient=False, cached=False):
        c = ctx[cached]
        compiled = {"json": lambda: c.compile_json_schema(json.dumps(text)), "regex": lambda: c.compile_regex(text),
                    "lark": lambda: c.compile_lark(text), "gbnf": lambda: c.compile_grammar(text),
                    "choice": lambda: c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in text))}[kind]()
        return compiled, self.xgr.GrammarMatcher(compiled)


def eager_apply(logits, bitmask):
    """No library: unpack the bits with shifts, then masked_fill_, in eager torch (what cvllm could do itself)."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    logits.masked_fill_(bits.view(bitmask.shape[0], -1)[:, :logits.shape[1]] == 0, float("-inf"))


def new_bitmask(vocab, rows=1) -> torch.Tensor:
    return torch.zeros(rows, (len(vocab["tokens"]) + 31) // 32, dtype=torch.int32)


def allowed(bitmask, token) -> bool:
    return bool((int(bitmask[0, token >> 5]) >> (token & 31)) & 1)


def walk(lib, matcher, ids, vocab) -> tuple[str, list[int], list[int]]:
    """Mask, check, consume each token, then check that an eos is allowed: ("accepted" or where it was refused,
    ns per mask, ns per consume)."""
    masks, consumes, bitmask, eos = [], [], new_bitmask(vocab), vocab["eos"]
    for i, token in enumerate([*ids, None]):
        t0 = time.perf_counter_ns()
        lib.fill(matcher, bitmask)
        t1 = time.perf_counter_ns()
        masks.append(t1 - t0)
        if token is None:
            return ("accepted" if any(allowed(bitmask, e) for e in eos) else "eos refused"), masks, consumes
        if not allowed(bitmask, token) or not lib.consume(matcher, token):
            return f"token {i} of {len(ids)} refused", masks, consumes
        consumes.append(time.perf_counter_ns() - t1)


def summary(ns: list[float], scale: float) -> dict:
    xs = sorted(ns)
    pick = lambda q: round(xs[min(len(xs) - 1, math.ceil(q * len(xs)) - 1)] / scale, 3)  # noqa: E731 (nearest rank)
    return {"mean": round(sum(xs) / len(xs) / scale, 3), "p50": pick(0.5), "p99": pick(0.99), "max": pick(1)}


def compile_json(lib, ctx, schema, row) -> tuple:
    """A rejected schema is a result; llguidance then tries its lenient mode (unknown keywords ignored)."""
    try:
        return lib.grammar(ctx, "json", schema)
    except Exception as e:  # noqa: BLE001
        row["error"] = str(e).splitlines()[0][:300]
        row["lenient"] = lib.name == "llguidance"
        return lib.grammar(ctx, "json", schema, lenient=True) if row["lenient"] else (None, None)


def measure_vocab(lib, vocab, schemas, args) -> dict:
    t0 = time.perf_counter()
    ctx = lib.setup(vocab)
    out = {"setup_s": round(time.perf_counter() - t0, 3), "schemas": {}}
    if lib.name == "llguidance" and vocab.get("tokenizer_json"):
        t0 = time.perf_counter()
        lib.llg.LLTokenizer(vocab["tokenizer_json"], eos_token=vocab["eos"])
        out["setup_from_tokenizer_json_s"] = round(time.perf_counter() - t0, 3)
    bitmask = new_bitmask(vocab)  # a special token must never stand for its text
    lib.fill(lib.grammar(ctx, "regex", r"[a-z<>|_\[\]]+")[1], bitmask)
    out["special_tokens_masked"] = not any(allowed(bitmask, s) for s in vocab["special"] if s not in vocab["eos"])
    for name, (schema, _) in schemas.items():
        ids = vocab["ids"][f"schema:{name}"]
        row = out["schemas"][name] = {"tokens": len(ids)}
        compiled, _ = compile_json(lib, ctx, schema, row)
        if compiled is None:
            continue
        lenient = row.get("lenient", False)
        row["compile_ms"] = summary([timed(lib.grammar, ctx, "json", schema, lenient) for _ in range(args.runs)], 1e6)
        if lib.name == "xgrammar":  # a second compile of the same schema: a hit in its cache
            row["compile_cached_ms"] = [timed(lib.grammar, ctx, "json", schema, cached=True) / 1e6 for _ in "12"][1]
        masks, consumes, first = [], [], []
        for _ in range(args.walks):  # a fresh matcher each time, as each request gets one
            row["walk"], m, c = walk(lib, lib.matcher(ctx, compiled), ids, vocab)
            masks, consumes, first = masks + m, consumes + c, first + m[:1]
        row["first_mask_ms"] = summary(first, 1e6)["p50"]
        row["mask_us"], row["consume_us"] = summary(masks, 1e3), summary(consumes, 1e3)
    compiled, ids = lib.grammar(ctx, "json", schemas["bounded_answer"][0])[0], vocab["ids"]["schema:bounded_answer"]
    matchers, bitmask, steps = [lib.matcher(ctx, compiled) for _ in range(64)], new_bitmask(vocab, 64), []
    for token in ids:  # 64 requests in lockstep, masks by the library's batch call (all cores)
        steps.append(timed(lib.fill_batch, matchers, bitmask))
        assert all([lib.consume(m, token) for m in matchers])
    out["batch64_bounded_answer_step_ms"] = summary(steps, 1e6)
    out["apply_64xV"] = apply_cost(lib.apply, len(vocab["tokens"]))
    return out


def timed(fn, *args, **kwargs) -> int:
    t0 = time.perf_counter_ns()
    fn(*args, **kwargs)
    return time.perf_counter_ns() - t0


def apply_cost(apply, size) -> dict:
    logits = torch.randn(64, size)
    mask = torch.randint(-2**31, 2**31 - 1, (64, (size + 31) // 32), dtype=torch.int32)
    first = timed(apply, logits, mask)  # llguidance's helper is torch.compile'd: its first call compiles
    calls = [timed(apply, logits, mask) for _ in range(40)][10:]
    return {"first_call_ms": round(first / 1e6, 1), "us": summary(calls, 1e3)}


def features(lib, vocab, schemas) -> dict:
    ctx, out = lib.setup(vocab), {}
    for kind, (text, _) in FEATURES.items():
        try:
            out[kind] = walk(lib, lib.grammar(ctx, kind, text)[1], vocab["ids"][f"feature:{kind}"], vocab)[0]
        except Exception as e:  # noqa: BLE001
            out[kind] = "error: " + str(e).splitlines()[0][:200]
    for keyword, name, _ in PROBES:
        _, matcher = compile_json(lib, ctx, schemas[name][0], {})
        verdict = walk(lib, matcher, vocab["ids"][f"probe:{keyword}"], vocab)[0] if matcher else "schema rejected"
        out[f"enforces {keyword}"] = verdict if verdict == "schema rejected" else verdict != "accepted"
    return out


def install_info(dist: str) -> dict:
    from packaging.requirements import Requirement
    size = lambda d: round(sum(f.size or 0 for f in d.files or []) / 2**20, 1)  # noqa: E731
    info, closure, todo = metadata.distribution(dist), {}, [dist]
    while todo:
        for req in map(Requirement, metadata.requires(todo.pop()) or []):
            if (req.marker and not req.marker.evaluate({"extra": ""})) or req.name in closure:
                continue
            try:
                closure[req.name] = size(metadata.distribution(req.name))
                todo.append(req.name)
            except metadata.PackageNotFoundError:
                closure[req.name] = None
    tags = [line[5:] for line in (info.read_text("WHEEL") or "").splitlines() if line.startswith("Tag: ")]
    return {"version": info.version, "wheel_tags": tags, "own_mb": size(info), "dependency_closure_mb": closure,
            "with_dependencies_mb": round(size(info) + sum(v or 0 for v in closure.values()), 1)}


def table(results) -> str:
    """Per vocabulary, a row per schema; "request" = compile p50 + tokens x (mask + consume) means: one request's
    grammar CPU time; "!" = the valid example was refused."""
    libs, lines = [n for n, r in results["libraries"].items() if "tokenizers" in r], []
    for vname, vocab in results["tokenizers"].items():
        per = {n: results["libraries"][n]["tokenizers"][vname] for n in libs}
        eager = results["apply_64xV_eager_torch"][vname]["us"]["p50"]
        lines += ["", f"{vname} ({vocab['size']} tokens); tokenizer setup: " + ", ".join(
            f"{n} {per[n]['setup_s']} s" for n in libs) + "; apply [64, V] mask p50: " + ", ".join(
            f"{n} {per[n]['apply_64xV']['us']['p50']:.0f} µs" for n in libs) + f", eager torch {eager:.0f} µs; "
            "bounded_answer masks for 64 requests, per step, mean/p99: " + ", ".join(
            f"{n} {per[n]['batch64_bounded_answer_step_ms']['mean']:.2f} / "
            f"{per[n]['batch64_bounded_answer_step_ms']['p99']:.2f} ms" for n in libs),
            "| schema | tokens | " + " | ".join(f"{n} compile p50/p99 ms | mask mean/p99 µs | request ms"
                                               for n in libs) + " |", "|---|---:|" + "---:|" * 3 * len(libs)]
        for schema in results["schemas"]:
            cells = []
            for n in libs:
                r = per[n]["schemas"][schema]
                c, m = r.get("compile_ms"), r.get("mask_us")
                cells.append(f"{c['p50']:.2f} / {c['p99']:.2f}" + " lenient" * r.get("lenient", False) if c
                             else "rejected")
                cells.append(f"{m['mean']:.0f} / {m['p99']:.0f}" + " !" * (r["walk"] != "accepted") if m else "-")
                work = r["tokens"] * (m["mean"] + r["consume_us"]["mean"]) / 1e3 if m else 0
                cells.append(f"{(c['p50'] if c else 0) + work:.1f}" if m else "-")
            lines.append(f"| {schema} | {per[libs[0]]['schemas'][schema]['tokens']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tekken", type=Path, help="tekken_240911.json (from the mistral-common wheel)")
    parser.add_argument("--runs", type=int, default=20, help="cold compiles per schema")
    parser.add_argument("--walks", type=int, default=3, help="token walks per schema, each with a fresh matcher")
    parser.add_argument("--out", type=Path, default=HERE / "results" / f"{date.today()}-cpu-grammar-libraries.json")
    args = parser.parse_args()
    schemas = load_schemas()
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    bundle_path = Path(os.environ.get("CVLLM_CACHE_DIR") or xdg / "cvllm") / "grammar-bench-vocab.pkl"
    try:
        vocabs = {"smollm2": smollm2_vocab()} | ({"tekken-131k": tekken_vocab(args.tekken)} if args.tekken else {})
        for v in vocabs.values():
            v["ids"] = {key: v["encode"](text) for key, text in texts(schemas).items()}
        bundle_path.parent.mkdir(parents=True, exist_ok=True)
        bundle_path.write_bytes(pickle.dumps({k: {f: x for f, x in v.items() if f != "encode"}
                                              for k, v in vocabs.items()}))
    except ImportError:
        print("cvllm is not importable here: reading the vocabularies a run in cvllm's venv left")
        vocabs = pickle.loads(bundle_path.read_bytes())
    results = json.loads(args.out.read_text()) if args.out.exists() else {"libraries": {}}
    results |= {"date": str(date.today()), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                "torch": torch.__version__, "runs": args.runs, "walks": args.walks,
                "schemas": {n: {"example_chars": len(json.dumps(ex))} for n, (_, ex) in schemas.items()},
                "tokenizers": {k: {"size": len(v["tokens"]), "source": v["source"], "eos": v["eos"],
                                   "special": len(v["special"])} for k, v in vocabs.items()},
                "apply_64xV_eager_torch": {k: apply_cost(eager_apply, len(v["tokens"])) for k, v in vocabs.items()}}
    for cls in (LLGuidance, XGrammar):
        try:
            lib = cls()
        except ImportError as e:
            print(f"{cls.name}: skipped ({e})")
            results["libraries"].setdefault(cls.name, {"skipped": str(e)})
            continue
        entry = results["libraries"][lib.name] = {"version": lib.version, "install": install_info(lib.name)}
        entry["tokenizers"] = {name: measure_vocab(lib, vocab, schemas, args) for name, vocab in vocabs.items()}
        entry["features"] = features(lib, vocabs["smollm2"], schemas)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    print(table(results))
    for n, r in results["libraries"].items():
        if "features" in r:
            inst = r["install"]
            print(f"\n{n} {r['version']}: {inst['own_mb']} MB, {inst['with_dependencies_mb']} MB with dependencies; "
                  f"wheel {inst['wheel_tags']}; {r['features']}")


if __name__ == "__main__":
    main()
