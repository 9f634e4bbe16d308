"""Reference token ids from llama.cpp for the GGUF tokenizer tests (tests/data/gguf_token_vectors.json).

Builds small vocabulary-only GGUF files -- a byte-level BPE vocabulary written once per ``tokenizer.ggml.pre``
type, two SentencePiece-style (``llama``) vocabularies, and vocabularies whose end-of-generation tokens llama.cpp
finds by their text -- and tokenizes test strings with llama.cpp through llama-cpp-python. The JSON holds each
file's ``tokenizer.*`` metadata and llama.cpp's answers, so the tests need neither llama.cpp nor these files.

Run once in a scratch venv (llama-cpp-python is not a project dependency):

    python -m venv /tmp/llamacpp && /tmp/llamacpp/bin/pip install llama-cpp-python gguf tokenizers
    /tmp/llamacpp/bin/python plugins/quant-gguf/tools/make_token_vectors.py [--smollm2 SmolLM2-...gguf]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import gguf
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "gguf_token_vectors.json"

TEXTS = [
    "Hello world",
    "12345 year 2024, pi=3.14159 and 1000000",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\nend\r\nwindows \n  \n",
    "don't you're we'll I'm HE'S THEY'RE it'S",
    "code: def f(x):\n    return x**2  # comment\n\tif a<b>=c: pass",
    "Ünïcödé façade – naïve café e\u0301t\u0301é",
    "emoji 🙂🚀 done 👍🏽 👨‍👩‍👧!",
    "中文测试：你好，世界！ 日本語のテキスト カタカナ 한국어 텍스트",
    "Ελληνικά и кириллица ÀÉÎ",
    "$100 + 20% = ~{x|y}^2 @user #tag `tick`",
    "nbsp\u00a0here\u3000ideographic\u2003em space\u2028line",
    "١٢٣ Ⅻ ½ ² 10,000.5",
    "ALLCAPS MixedCase camelCaseWord snake_case_word ÉCOLE",
    "http://example.com/path?q=1&r=2",
    "...!!!???---",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<think>reason</think> answer<|endoftext|>",
    "a<|im_end|>b <|im_start|> c <|im_end|>",
    "",
    " ",
    "\n",
    "   ",
    "xyzzy plugh xyzzy       x",
]


def fuzz_texts(n: int = 40, seed: int = 0) -> list[str]:
    """Random strings from pieces where the pre-tokenizers differ: scripts, combining marks, digit kinds,
    ASCII and non-ASCII whitespace, punctuation, symbols, emoji, contractions, special-token texts."""
    pieces = [
        *"aZéßΩжक中あ한x", "\u0301", "\u0308", "\u093f", *"0123456789", "٣", "५", "Ⅻ", "½", "²",
        *" \t\n\r\x0b\x0c", "\u00a0", "\u2003", "\u3000", "\u2028", "\x85", *".,;:!?\"-_()[]{}«»¿、。「」…—",
        *"$+<=>^`|~€©°±×÷", "🙂", "🚀", "👍🏽", "\u200d", "'s", "'S", "'re", "'LL", "'d", "'", "the", " the",
        "Hello", "2024", "123456", "  ", "\n\n", "<|im_end|>", "<think>",
    ]
    rng = random.Random(seed)
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(3, 30))) for _ in range(n)]


WITH_SPECIAL = ["Hello world", "", "<|im_start|>user\nhi<|im_end|>"]  # also tokenized with add_special=True

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The year 2024 had 366 days; 1234567890 is a number.",
    "Hello world! Hello there, world. What's the weather like? I'm fine, you're welcome, we'll see.",
    "def main():\n    for i in range(10):\n        print(i ** 2)\n    return None\n\n\nclass Foo:\n    pass\n",
    "if (a < b && b >= c) { x = y + z; } else { return -1; }  // comment\n\t\tindent\t\t\n",
    "Ünïcödé façade naïve café résumé Ελληνικά кириллица привет мир ÀÉÎ école",
    "中文测试 你好 世界 中文 你好世界 日本語 テキスト カタカナ ひらがな 한국어 텍스트 안녕하세요",
    "$100 costs 20% more; ~x|y^2 @user #tag https://example.com/path?q=1 ... !!! ??? ---",
    "   spaces   everywhere   \n\n\n   and newlines \r\n windows line endings   ",
    "ALLCAPS MixedCase camelCaseWord snake_case_word HE'S THEY'RE DON'T 3.14159 10,000.5",
]

UNREACHABLE = ["xyzzy", "Ġxyzzy", "Ġplugh", "ĠĠĠĠĠĠ"]
SPECIAL_HEAD = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<think>", 4), ("</think>", 4)]

BYTE_LEVEL_PRE = ["default", "gpt-2", "llama-bpe", "dbrx", "qwen2", "qwen35", "smollm", "deepseek-llm",
                  "deepseek-coder", "deepseek-v3", "falcon", "tekken", "gpt-4o"]


def byte_level_vocab() -> dict[str, Any]:
    """A byte-level BPE vocabulary (~1000 merges) learned from CORPUS, with control and user-defined tokens."""
    tok = Tokenizer(models.BPE())
    # no split while learning, so merges cross the boundaries that the pre-tokenizers under test draw
    # differently (digit groups, letters and marks, punctuation and words, whitespace runs)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=1300, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 3 + TEXTS, trainer)
    spec = json.loads(tok.to_str())["model"]
    pieces = sorted(spec["vocab"], key=spec["vocab"].get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["merges"]]
    # tokens no merge leads to: llama.cpp emits them whole only where ignore_merges is set (llama3, tekken)
    pieces += [p for p in UNREACHABLE if p not in pieces]
    pieces = [p for p in pieces if p not in dict(SPECIAL_HEAD)]  # llama.cpp refuses duplicate token texts
    tokens = [t for t, _ in SPECIAL_HEAD] + pieces
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [k for _, k in SPECIAL_HEAD] + [1] * len(pieces),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                                   "<|im_end|>\n{% endfor %}",
    }


def sentencepiece_vocab() -> dict[str, Any]:
    """A SentencePiece-style vocabulary: <unk>, <s>, </s>, 256 byte tokens, then pieces scored by merge order.
    The corpus has no emoji and only some CJK, so those fall back to byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=900, min_frequency=1, show_progress=False)
    tok.train_from_iterator([line for line in CORPUS if "中" not in line] + ["中文 你好"] * 3, trainer)
    spec = json.loads(tok.to_str())["model"]
    pieces = sorted(spec["vocab"], key=spec["vocab"].get)
    head = [("<unk>", 2), ("<s>", 3), ("</s>", 3)] + [(f"<0x{b:02X}>", 6) for b in range(256)]
    tail = [("<|im_start|>", 3), ("<|im_end|>", 3), ("<think>", 4)]
    tokens = [t for t, _ in head] + pieces + [t for t, _ in tail]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [k for _, k in head] + [1] * len(pieces) + [k for _, k in tail],
        "tokenizer.ggml.scores": [0.0] * len(head) + [-float(i) for i in range(len(pieces))] + [0.0] * len(tail),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def case(name: str, vocab: str, append: list[tuple[str, int]] = (), **settings: Any) -> dict[str, Any]:
    """A test case: the named base vocabulary, tokens appended (text, token type), then ``settings`` as
    ``tokenizer.ggml.*`` keys; an id given as a string is the id of that token text, None removes the key."""
    return {"name": name, "vocab": vocab, "append": [list(a) for a in append], "set": settings}


def case_fields(vocabs: dict[str, dict[str, Any]], spec: dict[str, Any]) -> dict[str, Any]:
    """The metadata a case describes (the tests rebuild it the same way)."""
    fields = dict(vocabs[spec["vocab"]])
    fields["tokenizer.ggml.tokens"] = fields["tokenizer.ggml.tokens"] + [t for t, _ in spec["append"]]
    fields["tokenizer.ggml.token_type"] = fields["tokenizer.ggml.token_type"] + [k for _, k in spec["append"]]
    for key, value in spec["set"].items():
        if value is None:
            fields.pop(f"tokenizer.ggml.{key}", None)
            continue
        if key.endswith("_id") and isinstance(value, str):
            value = fields["tokenizer.ggml.tokens"].index(value)
        fields[f"tokenizer.ggml.{key}"] = value
    return fields


def cases() -> list[dict[str, Any]]:
    out = []
    for pre in BYTE_LEVEL_PRE:
        if pre in ("llama-bpe", "tekken"):  # these two keep llama.cpp's default (add BOS)
            out.append(case(f"gpt2/{pre}", "byte_level", pre=pre))
        else:
            out.append(case(f"gpt2/{pre}", "byte_level", pre=pre, add_bos_token=pre == "qwen2"))
    # GLM-4 (CHATGLM4): llama.cpp clears the default BOS id; without a bos_token_id there is none, with one
    # (as GLM converters write) it is kept and added where add_bos_token says so
    out.append(case("gpt2/chatglm-bpe", "byte_level", pre="chatglm-bpe", bos_token_id=None))
    out.append(case("gpt2/glm4", "byte_level", pre="glm4"))
    out.append(case("gpt2/glm5", "byte_level", pre="glm5", add_bos_token=True))
    out.append(case("llama/space-prefix", "sentencepiece"))
    out.append(case("llama/no-prefix", "sentencepiece", add_space_prefix=False, add_bos_token=False,
                    add_eos_token=True))
    smol = {"pre": "smollm", "add_bos_token": False}
    out.append(case("eog/by-text", "byte_level", [
        ("<|eot_id|>", 1), ("<end_of_turn>", 1), ("<reponame>", 3), ("<|fim_pad|>", 1), ("<|file_sep|>", 1),
        ("<|fim_prefix|>", 1), ("<|eom_id|>", 1)], **smol))
    out.append(case("eog/by-metadata", "byte_level", [("<stop_a>", 3), ("<stop_b>", 1), ("<stop_c>", 3)],
                    eot_token_id="<stop_a>", eom_token_id="<stop_b>", fim_pad_token_id="<stop_c>", **smol))
    out.append(case("eog/harmony", "byte_level", [
        ("<|return|>", 3), ("<|call|>", 3), ("<|end|>", 3), ("<|channel|>", 3), ("<|message|>", 3)], **smol))
    out.append(case("eog/tool-response", "byte_level", [("</s>", 3), ("<|tool_response>", 3), ("<eos>", 3)],
                    **smol))
    return out


def write_gguf(path: Path, fields: dict[str, Any]) -> None:
    """A vocabulary-only GGUF: the fields plus the few llama hyperparameters llama.cpp reads before the vocab."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    for key, value in fields.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_cpp_answers(path: Path, texts: list[str], extra_texts: list[str]) -> dict[str, Any]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocab = llm._model.vocab
    n_vocab = llm._model.n_vocab()
    vectors = [{"text": t, "add_special": False, "ids": llm.tokenize(t.encode(), add_bos=False, special=True)}
               for t in texts + extra_texts]
    vectors += [{"text": t, "add_special": True, "ids": llm.tokenize(t.encode(), add_bos=True, special=True)}
                for t in WITH_SPECIAL]
    eog = [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)]
    return {"vectors": vectors, "eog": eog, "bos": llama_cpp.llama_vocab_bos(vocab)}  # bos -1: none


def to_json(value: Any, indent: str = "") -> str:
    """JSON with one line per vector, vocabulary field and case entry (diffable, not one line per id)."""
    def flat(v: Any) -> bool:
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        return all(not isinstance(x, dict) and (not isinstance(x, list) or flat(x)) for x in items)

    if flat(value):
        return json.dumps(value, ensure_ascii=False)
    inner = indent + " "
    if isinstance(value, dict):
        body = [f"{inner}{json.dumps(k)}: {to_json(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(body) + f"\n{indent}}}"
    return "[\n" + ",\n".join(inner + to_json(v, inner) for v in value) + f"\n{indent}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smollm2", type=Path, help="SmolLM2-135M-Instruct GGUF: also record its EOG ids")
    args = parser.parse_args()
    result: dict[str, Any] = {
        "produced_by": f"llama.cpp through llama-cpp-python {version('llama-cpp-python')}: "
                       "Llama(path, vocab_only=True).tokenize(text.encode(), add_bos=add_special, special=True); "
                       "eog = ids where llama_vocab_is_eog; bos = llama_vocab_bos (-1: none)",
        "cases": [],
    }
    vocabs = {"byte_level": byte_level_vocab(), "sentencepiece": sentencepiece_vocab()}
    result["vocabs"] = vocabs
    with tempfile.TemporaryDirectory() as tmp:
        for spec in cases():
            path = Path(tmp) / "vocab.gguf"
            write_gguf(path, case_fields(vocabs, spec))
            # the appended tokens' texts, spaced and run together, show which ones llama.cpp matches whole
            added = [t for t, _ in spec["append"]]
            extra = [" ".join(added) + " x" + "".join(added)] if added else []
            answers = llama_cpp_answers(path, TEXTS + fuzz_texts(), extra)
            result["cases"].append({**spec, **answers})
            print(f"{spec['name']}: {len(answers['vectors'])} vectors, eog {answers['eog']}")
    if args.smollm2:
        result["smollm2_eog"] = llama_cpp_answers(args.smollm2, [], [])["eog"]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(to_json(result) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
