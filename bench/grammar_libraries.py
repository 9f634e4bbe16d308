"""llguidance vs xgrammar for JSON-schema constrained decoding, measured on the CPU (issue 21).

Each library is optional (one that is not importable is reported as skipped), so the script runs in any venv.
cvllm's venv holds llguidance; xgrammar (it needs transformers, triton and tvm-ffi) gets a venv of its own:

    python bench/grammar_libraries.py --tekken PATH/tekken_240911.json   # cvllm's venv: llguidance
    XG_VENV/bin/python bench/grammar_libraries.py                          # xgrammar's venv

The run in cvllm's venv builds the vocabularies and tokenizes each schema's example (the schema file's
"examples"[0], in property order), and leaves them in cvllm's cache dir for runs in other venvs: SmolLM2's
49k vocab from the demo GGUF through cvllm's Tokenizer (token_bytes), and the 131k Tekken vocab (Mistral NeMo's
tokenizer, a JSON file in the mistral-common wheel) with a byte-pair encoder written here. Every run merges its
library's numbers into bench/results/DATE-cpu-grammar-libraries.json and prints the table of all it holds.
Both libraries run with their defaults: flexible whitespace, xgrammar's strict_mode (no undeclared properties).
"""

from __future__ import annotations

import argparse
import base64
import importlib.metadata
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
SCHEMAS = HERE / "schemas"
LARK = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: factor (("*" | "/") factor)*\n' \
       'factor: NUMBER | "(" expr ")"\nNUMBER: /[0-9]+/\n'
GBNF = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n' \
       'factor ::= [0-9]+ | "(" expr ")"\n'
CHOICES = ["positive", "negative", "neutral"]
FEATURES = {"regex": r"\+[0-9]{1,3}-[0-9]{3}-[0-9]{4}", "choice": CHOICES, "lark": LARK, "gbnf": GBNF}
SAMPLES = {"regex": "+1-555-0123", "choice": "neutral", "lark": "(1+2)*34-5", "gbnf": "(1+2)*34-5"}
# invalid instances: (keyword, schema, top-level properties replaced in its example); enforced = rejected
PROBES = [("multipleOf", "product_item", {"price": 24.999}), ("uniqueItems", "product_item", {"tags": ["a", "a"]}),
          ("if/then", "invoice", {"payment": {"method": "card"}}),
          ("maxProperties", "invoice", {"metadata": {f"k{i}": "v" for i in range(11)}}),
          ("maxLength", "bounded_answer", {"answer": "x" * 101}), ("pattern", "person_record", {"phone": "12345"}),
          ("format: email", "pydantic_order", {"customer_email": "not-an-email"}),
          ("format: date-time", "github_issue", {"created_at": "yesterday"}),
          ("minimum", "tool_get_weather", {"days": 0})]


def load_schemas() -> dict[str, tuple[dict, object]]:
    out = {}
    for path in sorted(SCHEMAS.glob("*.json")):
        schema = json.loads(path.read_text())
        out[path.stem] = ({k: v for k, v in schema.items() if k != "examples"}, schema["examples"][0])
    return out


def texts(schemas) -> dict[str, str]:
    """What each vocabulary tokenizes: the examples, the probes and the grammar samples."""
    out = {f"schema:{name}": json.dumps(ex, ensure_ascii=False) for name, (_, ex) in schemas.items()}
    for keyword, name, patch in PROBES:
        out[f"probe:{keyword}"] = json.dumps({**schemas[name][1], **patch}, ensure_ascii=False)
    return out | {f"feature:{k}": v for k, v in SAMPLES.items()}


def smollm2_vocab() -> dict:
    from cvllm.demo import demo_model_path
    from cvllm_gguf.checkpoint import open_gguf_checkpoint
    ckpt = open_gguf_checkpoint(demo_model_path(allow_fetch=True))
    tok = ckpt.tokenizer
    eos = [tok.eos_token_id] + sorted(set(ckpt.generation_config["eos_token_id"]) - {tok.eos_token_id})
    return {"source": "SmolLM2-135M-Instruct demo GGUF, cvllm Tokenizer.token_bytes",
            "tokens": [tok.token_bytes(i) for i in range(tok.vocab_size)], "special": sorted(tok.special_ids),
            "eos": eos, "tokenizer_json": tok.tokenizer.to_str(),
            "encode": lambda s: tok.encode(s, add_special_tokens=False)}


def tekken_vocab(path: Path) -> dict:
    """Tekken: tiktoken-style ranks (id = 1000 specials + rank), pre-split by its regex, then byte-pair merges."""
    import regex
    spec = json.loads(path.read_text())
    n_special, size = spec["config"]["default_num_special_tokens"], spec["config"]["default_vocab_size"]
    ranked = [base64.b64decode(t["token_bytes"]) for t in spec["vocab"][:size - n_special]]
    ranks = {b: i for i, b in enumerate(ranked)}
    names = {0: "<unk>", 1: "<s>", 2: "</s>"}
    pattern = regex.compile(spec["config"]["pattern"])

    def bpe(piece: bytes) -> list[int]:
        parts = [piece[i:i + 1] for i in range(len(piece))]
        while len(parts) > 1:
            rank, i = min((ranks.get(parts[i] + parts[i + 1], math.inf), i) for i in range(len(parts) - 1))
            if rank == math.inf:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return [n_special + ranks[p] for p in parts]

    return {"source": f"{path.name} (mistral-common 1.12.0 wheel), ids = {n_special} specials + rank",
            "tokens": [names.get(i, f"<SPECIAL_{i}>").encode() for i in range(n_special)] + ranked,
            "special": list(range(n_special)), "eos": [2], "tokenizer_json": None,
            "encode": lambda s: [t for piece in pattern.findall(s) for t in bpe(piece.encode())]}


class LLGuidance:
    name, dist = "llguidance", "llguidance"

    def __init__(self):
        import llguidance
        import llguidance.torch
        self.llg, self.llt, self.version = llguidance, llguidance.torch, llguidance.__version__

    def setup(self, vocab):
        class Vocab:  # what TokenizerWrapper reads: token bytes, special ids (never text), eos, an encoder
            eos_token_id, bos_token_id = vocab["eos"][0], None
            tokens, special_token_ids = vocab["tokens"], vocab["special"]

            def __call__(self, text):
                return vocab["encode"](text) if "encode" in vocab else []
        return self.llg.LLTokenizer(self.llg.TokenizerWrapper(Vocab()), eos_token=vocab["eos"])

    def grammar(self, ctx, kind, text, lenient=False, compiler=None):
        LLMatcher = self.llg.LLMatcher
        if kind == "json":
            grammar = LLMatcher.grammar_from_json_schema(text, overrides={"lenient": True} if lenient else None)
        else:
            grammar = self.llg.grammar_from(kind, json.dumps(text) if kind == "choice" else text)
        matcher = LLMatcher(ctx, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar, matcher

    def matcher(self, ctx, grammar):
        return self.llg.LLMatcher(ctx, grammar, log_level=0)

    def bitmask(self, vocab_size):
        return self.llt.allocate_token_bitmask(1, vocab_size)

    def fill(self, matcher, bitmask):
        self.llt.fill_next_token_bitmask(matcher, bitmask)

    def consume(self, matcher, token):
        return matcher.consume_token(token)

    def apply(self, logits, bitmask):
        self.llt.apply_token_bitmask_inplace(logits, bitmask)


class XGrammar:
    name, dist = "xgrammar", "xgrammar"

    def __init__(self):
        import xgrammar
        self.xgr, self.version = xgrammar, importlib.metadata.version("xgrammar")

    def setup(self, vocab):
        """Special tokens as b"" (xgrammar takes a raw token's bytes as text, "<|im_end|>" would match "<"...)."""
        special = set(vocab["special"])
        raw = [b"" if i in special else t for i, t in enumerate(vocab["tokens"])]
        info = self.xgr.TokenizerInfo(raw, self.xgr.VocabType.RAW, vocab_size=len(raw), stop_token_ids=vocab["eos"])
        return {"info": info, "cold": self.xgr.GrammarCompiler(info, cache_enabled=False),
                "cached": self.xgr.GrammarCompiler(info)}

    def grammar(self, ctx, kind, text, lenient=False, compiler="cold"):
        c = ctx[compiler]
        compiled = {"json": lambda: c.compile_json_schema(json.dumps(text)), "regex": lambda: c.compile_regex(text),
                    "lark": lambda: c.compile_lark(text), "gbnf": lambda: c.compile_grammar(text),
                    "choice": lambda: c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in text))}[kind]()
        return compiled, self.xgr.GrammarMatcher(compiled)

    def matcher(self, ctx, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, vocab_size):
        return self.xgr.allocate_token_bitmask(1, vocab_size)

    def fill(self, matcher, bitmask):
        matcher.fill_next_token_bitmask(bitmask)

    def consume(self, matcher, token):
        return matcher.accept_token(token)

    def apply(self, logits, bitmask):
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


def allowed(bitmask, token) -> bool:
    return bool((int(bitmask[0, token >> 5]) >> (token & 31)) & 1)


def walk(lib, matcher, ids, eos, bitmask) -> tuple[str, list[int], list[int]]:
    """Mask, check, consume each token, then check that an eos is allowed: ("accepted" or where it was refused,
    ns per mask, ns per consume)."""
    masks, consumes = [], []
    for i, token in enumerate([*ids, None]):
        t0 = time.perf_counter_ns()
        lib.fill(matcher, bitmask)
        t1 = time.perf_counter_ns()
        masks.append(t1 - t0)
        if token is None:
            return ("accepted" if any(allowed(bitmask, e) for e in eos) else "eos refused"), masks, consumes
        if not allowed(bitmask, token):
            return f"token {i} of {len(ids)} masked", masks, consumes
        ok = lib.consume(matcher, token)
        consumes.append(time.perf_counter_ns() - t1)
        if not ok:
            return f"token {i} of {len(ids)} refused", masks, consumes


def summary(ns: list[float], scale: float) -> dict:
    xs = sorted(ns)
    pick = lambda q: xs[min(len(xs) - 1, math.ceil(q * len(xs)) - 1)] / scale  # noqa: E731 (nearest rank)
    return {"mean": round(sum(xs) / len(xs) / scale, 3), "p50": round(pick(0.5), 3), "p99": round(pick(0.99), 3),
            "max": round(xs[-1] / scale, 3)}


def measure_vocab(lib, vocab, schemas, args) -> dict:
    t0 = time.perf_counter()
    ctx = lib.setup(vocab)
    out = {"setup_s": round(time.perf_counter() - t0, 3), "schemas": {}}
    if lib.name == "llguidance" and vocab.get("tokenizer_json"):
        t0 = time.perf_counter()
        lib.llg.LLTokenizer(vocab["tokenizer_json"], eos_token=vocab["eos"])
        out["setup_from_tokenizer_json_s"] = round(time.perf_counter() - t0, 3)
    size, bitmask = len(vocab["tokens"]), lib.bitmask(len(vocab["tokens"]))
    _, probe = lib.grammar(ctx, "regex", r"[a-z<>|_\[\]]+")  # a special token must never stand for its text
    lib.fill(probe, bitmask)
    out["special_tokens_masked"] = not any(allowed(bitmask, s) for s in vocab["special"] if s not in vocab["eos"])
    for name, (schema, _) in schemas.items():
        row, ids = {"tokens": len(vocab["ids"][f"schema:{name}"])}, vocab["ids"][f"schema:{name}"]
        compile_ns = []
        try:
            for _ in range(args.runs):
                t0 = time.perf_counter_ns()
                compiled, matcher = lib.grammar(ctx, "json", schema)
                compile_ns.append(time.perf_counter_ns() - t0)
        except Exception as e:  # noqa: BLE001 (a rejected schema is a result)
            row["error"] = str(e).splitlines()[0][:300]
            if lib.name != "llguidance":
                out["schemas"][name] = row
                continue
            try:
                compiled, matcher = lib.grammar(ctx, "json", schema, lenient=True)
                row["lenient"] = True
            except Exception:  # noqa: BLE001
                out["schemas"][name] = row
                continue
        if compile_ns:
            row["compile_ms"] = summary(compile_ns, 1e6)
        if lib.name == "xgrammar":
            lib.grammar(ctx, "json", schema, compiler="cached")
            t0 = time.perf_counter_ns()
            lib.grammar(ctx, "json", schema, compiler="cached")
            row["compile_cached_ms"] = round((time.perf_counter_ns() - t0) / 1e6, 3)
        masks, consumes, first = [], [], []
        for _ in range(args.walks):
            row["walk"], m, c = walk(lib, lib.matcher(ctx, compiled), ids, vocab["eos"], bitmask)
            masks, consumes, first = masks + m, consumes + c, first + m[:1]
        row["first_mask_ms"] = summary(first, 1e6)["p50"]  # a fresh matcher's first mask: lazy work shows here
        row["mask_us"], row["consume_us"] = summary(masks, 1e3), summary(consumes, 1e3)
        out["schemas"][name] = row
    logits = torch.randn(64, size)
    mask64 = torch.randint(-2**31, 2**31 - 1, (64, (size + 31) // 32), dtype=torch.int32)
    t0 = time.perf_counter()
    lib.apply(logits, mask64)
    calls = []
    for _ in range(30):
        t1 = time.perf_counter_ns()
        lib.apply(logits, mask64)
        calls.append(time.perf_counter_ns() - t1)
    out["apply_64xV"] = {"first_call_ms": round((time.perf_counter() - t0) * 1e3 - sum(calls) / 1e6, 1),
                         "us": summary(calls, 1e3)}
    return out


def features(lib, vocab, schemas) -> dict:
    ctx, out = lib.setup(vocab), {}
    bitmask = lib.bitmask(len(vocab["tokens"]))
    for kind, text in FEATURES.items():
        try:
            compiled, matcher = lib.grammar(ctx, kind, text)
            out[kind] = walk(lib, matcher, vocab["ids"][f"feature:{kind}"], vocab["eos"], bitmask)[0]
        except Exception as e:  # noqa: BLE001
            out[kind] = "error: " + str(e).splitlines()[0][:200]
    for keyword, name, _ in PROBES:
        try:
            try:
                _, matcher = lib.grammar(ctx, "json", schemas[name][0])
            except Exception:  # noqa: BLE001 (llguidance: what its lenient mode does with the keyword)
                _, matcher = lib.grammar(ctx, "json", schemas[name][0], lenient=True)
        except Exception:  # noqa: BLE001
            out[f"enforces {keyword}"] = "schema rejected"
            continue
        verdict = walk(lib, matcher, vocab["ids"][f"probe:{keyword}"], vocab["eos"], bitmask)[0]
        out[f"enforces {keyword}"] = verdict != "accepted"
    return out


def install_info(dist: str) -> dict:
    from importlib import metadata

    from packaging.requirements import Requirement
    size = lambda d: round(sum(f.size or 0 for f in d.files or []) / 2**20, 1)  # noqa: E731
    info = metadata.distribution(dist)
    tags = [line.split(": ", 1)[1] for line in (info.read_text("WHEEL") or "").splitlines() if line.startswith("Tag")]
    closure, todo = {}, [dist]
    while todo:
        for spec in metadata.requires(todo.pop()) or []:
            req = Requirement(spec)
            if (req.marker and not req.marker.evaluate({"extra": ""})) or req.name in closure:
                continue
            try:
                closure[req.name] = size(metadata.distribution(req.name))
                todo.append(req.name)
            except metadata.PackageNotFoundError:
                closure[req.name] = None
    return {"version": info.version, "wheel_tags": tags, "own_mb": size(info), "requires": metadata.requires(dist),
            "dependency_closure_mb": closure, "with_dependencies_mb": round(size(info) + sum(
                v or 0 for v in closure.values()), 1)}


def table(results) -> str:
    libs = [n for n, r in results["libraries"].items() if "tokenizers" in r]
    lines = []
    for vocab_name, vocab in results["tokenizers"].items():
        head = " | ".join(f"{n} compile p50/p99 ms | {n} 1st mask ms | {n} mask mean/p99 µs" for n in libs)
        lines += ["", f"{vocab_name} ({vocab['size']} tokens): setup " + ", ".join(
            f"{n} {results['libraries'][n]['tokenizers'][vocab_name]['setup_s']} s" for n in libs),
                  f"| schema | tokens | {head} |", "|---|---:|" + "---:|" * 3 * len(libs)]
        for schema in results["schemas"]:
            cells = []
            for n in libs:
                r = results["libraries"][n]["tokenizers"][vocab_name]["schemas"][schema]
                c, m = r.get("compile_ms"), r.get("mask_us")
                cells += [f"{c['p50']:.2f} / {c['p99']:.2f}" if c else "rejected" + (" (lenient ok)" * bool(
                    r.get("lenient"))), f"{r['first_mask_ms']:.2f}" if m else "-",
                    (f"{m['mean']:.0f} / {m['p99']:.0f}" if m else "-") + ("" if r["walk"] == "accepted" else " !")]
            tokens = results["libraries"][libs[0]]["tokenizers"][vocab_name]["schemas"][schema]["tokens"]
            lines.append(f"| {schema} | {tokens} | " + " | ".join(cells) + " |")
        lines.append("apply [64, V] mask: " + ", ".join(
            f"{n} {results['libraries'][n]['tokenizers'][vocab_name]['apply_64xV']['us']['p50']:.0f} µs" for n in libs))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tekken", type=Path, help="tekken_240911.json (from the mistral-common wheel)")
    parser.add_argument("--runs", type=int, default=10, help="cold compiles per schema")
    parser.add_argument("--walks", type=int, default=3, help="token walks per schema, each with a fresh matcher")
    parser.add_argument("--out", type=Path, default=HERE / "results" / f"{date.today()}-cpu-grammar-libraries.json")
    args = parser.parse_args()
    schemas = load_schemas()
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    bundle_path = Path(os.environ.get("CVLLM_CACHE_DIR") or xdg / "cvllm") / "grammar-bench-vocab.pkl"
    try:
        vocabs = {"smollm2": smollm2_vocab()}
        if args.tekken:
            vocabs["tekken-131k"] = tekken_vocab(args.tekken)
        for v in vocabs.values():
            v["ids"] = {key: v["encode"](text) for key, text in texts(schemas).items()}
        bundle_path.parent.mkdir(parents=True, exist_ok=True)
        bundle = {k: {f: x for f, x in v.items() if f != "encode"} for k, v in vocabs.items()}
        bundle_path.write_bytes(pickle.dumps(bundle))
    except ImportError:
        print("cvllm is not importable here: reading the vocabularies an earlier run in cvllm's venv left")
        vocabs = pickle.loads(bundle_path.read_bytes())
    results = json.loads(args.out.read_text()) if args.out.exists() else {"libraries": {}}
    results |= {"date": str(date.today()), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                "torch": torch.__version__, "schemas": {n: {"example_chars": len(json.dumps(ex))}
                                                        for n, (_, ex) in schemas.items()},
                "tokenizers": {k: {"size": len(v["tokens"]), "source": v["source"], "eos": v["eos"],
                                   "special": len(v["special"])} for k, v in vocabs.items()}}
    for cls in (LLGuidance, XGrammar):
        try:
            lib = cls()
        except ImportError as e:
            print(f"{cls.name}: skipped ({e})")
            results["libraries"].setdefault(cls.name, {"skipped": str(e)})
            continue
        entry = {"version": lib.version, "install": install_info(lib.dist), "tokenizers": {}}
        for name, vocab in vocabs.items():
            print(f"{lib.name} {lib.version}: {name} ...", flush=True)
            entry["tokenizers"][name] = measure_vocab(lib, vocab, schemas, args)
        entry["features"] = features(lib, vocabs["smollm2"], schemas)
        results["libraries"][lib.name] = entry
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    print(table(results))
    for n, r in results["libraries"].items():
        if "features" in r:
            inst = r["install"]
            print(f"{n} {r['version']}: {inst['own_mb']} MB, {inst['with_dependencies_mb']} MB with dependencies; "
                  f"wheel {inst['wheel_tags']}; {r['features']}")


if __name__ == "__main__":
    main()
