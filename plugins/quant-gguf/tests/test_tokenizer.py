"""The tokenizer rebuilt from GGUF metadata gives llama.cpp's token ids and end-of-generation tokens.

The references come from llama.cpp itself (through llama-cpp-python): tests/data/gguf_token_vectors.json
(made by tools/make_token_vectors.py from small vocabulary-only GGUFs, one per pre-tokenizer type) and
tests/data/smollm2_tokens.json (the real SmolLM2 vocabulary; needs the demo model, `cvllm fetch-demo`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import gguf
import pytest

from cvllm_gguf.reader import GGUFFile
from cvllm_gguf.tokenizer import (
    PRE_TOKENIZERS,
    GGUFTokenizerError,
    read_gguf_fields,
    stop_token_ids,
    tokenizer_from_gguf,
)

DATA = Path(__file__).parent / "data"
VECTORS = json.loads((DATA / "gguf_token_vectors.json").read_text(encoding="utf-8"))
CASES = {case["name"]: case for case in VECTORS["cases"]}


def case_fields(name: str) -> dict[str, Any]:
    """A case's tokenizer.* metadata, built as tools/make_token_vectors.py built the GGUF it gave llama.cpp."""
    case = CASES[name]
    fields = dict(VECTORS["vocabs"][case["vocab"]])
    fields["tokenizer.ggml.tokens"] = fields["tokenizer.ggml.tokens"] + [t for t, _ in case["append"]]
    fields["tokenizer.ggml.token_type"] = fields["tokenizer.ggml.token_type"] + [k for _, k in case["append"]]
    for key, value in case["set"].items():
        if value is None:
            fields.pop(f"tokenizer.ggml.{key}", None)
            continue
        if key.endswith("_id") and isinstance(value, str):
            value = fields["tokenizer.ggml.tokens"].index(value)
        fields[f"tokenizer.ggml.{key}"] = value
    return fields


def mismatches(tok, vectors: list[dict[str, Any]]) -> list[str]:
    out = []
    for v in vectors:
        ids = tok.encode(v["text"], add_special_tokens=v.get("add_special", False))
        if ids != v["ids"]:
            out.append(f"{v['text']!r} (add_special={v.get('add_special', False)}): got {ids}, llama.cpp {v['ids']}")
    return out


def test_vectors_cover_the_required_pre_tokenizers():
    names = {case["set"].get("pre") for case in VECTORS["cases"]}
    assert {"default", "llama-bpe", "qwen2", "smollm", "deepseek-llm", "deepseek-v3", "chatglm-bpe", "glm4"} <= names
    assert {"llama/space-prefix", "llama/no-prefix"} <= CASES.keys()


@pytest.mark.parametrize("name", sorted(CASES))
def test_token_ids_equal_llama_cpp(name):
    tok = tokenizer_from_gguf(case_fields(name))
    problems = mismatches(tok, CASES[name]["vectors"])
    assert not problems, "\n".join(problems[:10])


@pytest.mark.parametrize("name", sorted(CASES))
def test_stop_token_ids_equal_llama_cpp_eog(name):
    assert stop_token_ids(case_fields(name)) == set(CASES[name]["eog"])


def bos_matches(tok, case: dict[str, Any]) -> bool:
    return tok.bos_token_id == (None if case["bos"] < 0 else case["bos"])  # llama.cpp's -1: no BOS token


@pytest.mark.parametrize("name", sorted(CASES))
def test_bos_token_equals_llama_cpp(name):
    assert bos_matches(tokenizer_from_gguf(case_fields(name)), CASES[name])


def test_pre_tokenizers_differ_on_the_vectors():
    # the vectors (ids or BOS) tell each pre-tokenizer group from every other (else the per-type test proves
    # little): dbrx and chatglm-bpe, say, split alike and differ only in the BOS id llama.cpp defaults to
    gpt2 = [name for name in CASES if name.startswith("gpt2/")]
    for a in gpt2:
        for b in gpt2:
            pre_a, pre_b = CASES[a]["set"]["pre"], CASES[b]["set"]["pre"]
            if a >= b or PRE_TOKENIZERS[pre_a] == PRE_TOKENIZERS[pre_b]:
                continue
            told_apart = False
            for mine, other in ((a, pre_b), (b, pre_a)):
                tok = tokenizer_from_gguf({**case_fields(mine), "tokenizer.ggml.pre": other})
                told_apart |= bool(mismatches(tok, CASES[mine]["vectors"])) or not bos_matches(tok, CASES[mine])
            assert told_apart, (a, b)


def test_control_tokens_are_special_and_user_defined_are_not():
    fields = case_fields("gpt2/smollm")
    tok = tokenizer_from_gguf(fields)
    ids = {t: fields["tokenizer.ggml.tokens"].index(t) for t in ("<|im_start|>", "<|im_end|>", "<think>")}
    assert {ids["<|im_start|>"], ids["<|im_end|>"]} <= tok.special_ids
    assert ids["<think>"] not in tok.special_ids
    encoded = tok.encode("<|im_start|>x<think>y<|im_end|>")
    assert encoded[0] == ids["<|im_start|>"] and encoded[-1] == ids["<|im_end|>"] and ids["<think>"] in encoded
    assert tok.decode(encoded) == "x<think>y"
    assert tok.decode(encoded, skip_special_tokens=False) == "<|im_start|>x<think>y<|im_end|>"


def test_special_token_texts_and_chat_template_come_from_metadata():
    fields = case_fields("gpt2/smollm")
    tok = tokenizer_from_gguf(fields)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.chat_template == fields["tokenizer.chat_template"]
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n"
    assert tok.encode(prompt)[:2] == [1, tok.encode("user")[0]]  # add_bos_token is false: no second BOS


@pytest.mark.parametrize(("pre", "flag", "adds_bos"), [
    ("llama-bpe", None, True),   # llama.cpp's default for llama3 vocabularies
    ("llama-bpe", False, False),
    ("smollm", None, False),
    ("smollm", True, True),
    ("chatglm-bpe", None, False),  # llama.cpp sets no add_bos for GLM-4 ...
    ("glm4", True, True),          # ... but honours the file's flag and bos_token_id
])
def test_add_bos_follows_metadata_then_llama_cpp_defaults(pre, flag, adds_bos):
    fields = {k: v for k, v in case_fields("gpt2/smollm").items() if k != "tokenizer.ggml.add_bos_token"}
    fields["tokenizer.ggml.pre"] = pre
    if flag is not None:
        fields["tokenizer.ggml.add_bos_token"] = flag
    tok = tokenizer_from_gguf(fields)
    plain = tok.encode("Hello world", add_special_tokens=False)
    assert tok.encode("Hello world") == ([1] if adds_bos else []) + plain


def test_named_chat_templates_come_from_metadata():
    """llama.cpp's converter writes a model's other templates as tokenizer.chat_template.<name> (Command-R's
    tool_use and rag): kept, and a chat with tools renders with tool_use."""
    fields = {**case_fields("gpt2/smollm"), "tokenizer.chat_template.tool_use": "TOOLS{{ messages[0]['content'] }}",
              "tokenizer.chat_template.rag": "RAG"}
    tok = tokenizer_from_gguf(fields)
    assert tok.named_templates == {"tool_use": "TOOLS{{ messages[0]['content'] }}", "rag": "RAG"}
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools) == "TOOLShi"


def test_bos_and_eos_with_template_syntax_in_their_text_are_added():
    fields = case_fields("gpt2/smollm")
    tokens = list(fields["tokenizer.ggml.tokens"])
    tokens[1], tokens[2] = "<bos:1>", "$eos"
    fields.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.add_bos_token": True,
                   "tokenizer.ggml.add_eos_token": True})
    tok = tokenizer_from_gguf(fields)
    assert tok.encode("Hello world") == [1, *tok.encode("Hello world", add_special_tokens=False), 2]


@pytest.mark.parametrize("pre", ["chatglm-bpe", "glm4"])
def test_glm4_without_bos_token_id_has_no_bos(pre):
    fields = {k: v for k, v in case_fields("gpt2/smollm").items() if k != "tokenizer.ggml.bos_token_id"}
    fields["tokenizer.ggml.pre"] = pre
    assert tokenizer_from_gguf(fields).bos_token is None  # dbrx, same split, would default to token 11
    with pytest.raises(GGUFTokenizerError, match="BOS"):  # llama.cpp aborts (GGML_ASSERT) when asked to add it
        tokenizer_from_gguf({**fields, "tokenizer.ggml.add_bos_token": True})


def test_missing_pre_type_means_default_as_in_llama_cpp(caplog):
    fields = {k: v for k, v in case_fields("gpt2/default").items() if k != "tokenizer.ggml.pre"}
    problems = mismatches(tokenizer_from_gguf(fields), CASES["gpt2/default"]["vectors"])
    assert not problems
    assert "tokenizer.ggml.pre" in caplog.text


def test_token_bytes_concatenate_to_the_text():
    text = "Ünïcödé 🙂 中文\t x**2  done"
    byte_level = tokenizer_from_gguf(case_fields("gpt2/qwen2"))
    ids = byte_level.encode(text, add_special_tokens=False)
    assert b"".join(byte_level.token_bytes(i) for i in ids) == text.encode()
    spm = tokenizer_from_gguf(case_fields("llama/no-prefix"))
    assert b"".join(spm.token_bytes(i) for i in spm.encode(text, add_special_tokens=False)) == text.encode()
    assert spm.decode(spm.encode(text)) == text


def test_unknown_pre_tokenizer_is_a_clear_error():
    fields = {**case_fields("gpt2/smollm"), "tokenizer.ggml.pre": "made-up-pre"}
    with pytest.raises(GGUFTokenizerError, match="made-up-pre") as err:
        tokenizer_from_gguf(fields)
    assert all(name in str(err.value) for name in ("llama-bpe", "qwen2", "smollm", "deepseek-v3"))
    assert len(PRE_TOKENIZERS) > 30


def test_unknown_tokenizer_model_is_a_clear_error():
    with pytest.raises(GGUFTokenizerError, match="'t5'.*gpt2, llama"):
        tokenizer_from_gguf({**case_fields("gpt2/smollm"), "tokenizer.ggml.model": "t5"})
    with pytest.raises(GGUFTokenizerError, match="tokenizer.ggml.tokens"):
        tokenizer_from_gguf({"tokenizer.ggml.model": "gpt2"})


def write_gguf(path: Path, fields: dict[str, Any]) -> None:
    writer = gguf.GGUFWriter(path, "llama")
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


@pytest.mark.parametrize("name", ["gpt2/smollm", "llama/no-prefix"])
def test_read_gguf_fields_round_trips_the_metadata(tmp_path, name):
    fields = case_fields(name)
    write_gguf(tmp_path / "v.gguf", fields)
    metadata = GGUFFile(tmp_path / "v.gguf").metadata
    read = read_gguf_fields(metadata)
    assert read == fields
    assert all(type(read[k]) is type(v) for k, v in fields.items())
    assert read_gguf_fields(metadata, "general.") == {"general.architecture": "llama"}


@pytest.fixture(scope="module")
def smollm2_fields(demo_gguf):
    start = time.perf_counter()
    fields = read_gguf_fields(GGUFFile(demo_gguf).metadata)
    assert time.perf_counter() - start < 5  # 49152 tokens and 48900 merges in one pass: ~0.1 s (a per-item scan: 5 s+)
    return fields


def test_smollm2_token_ids_equal_llama_cpp(smollm2_fields):
    reference = json.loads((DATA / "smollm2_tokens.json").read_text(encoding="utf-8"))
    assert len(smollm2_fields["tokenizer.ggml.tokens"]) == 49152
    assert len(smollm2_fields["tokenizer.ggml.merges"]) > 48000
    tok = tokenizer_from_gguf(smollm2_fields)
    vectors = [{**v, "add_special": reference["add_bos"]} for v in reference["vectors"]]
    problems = mismatches(tok, vectors)
    assert not problems, "\n".join(problems)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).startswith("<|im_start|>system\n")


def test_smollm2_stop_token_ids_equal_llama_cpp_eog(smollm2_fields):
    assert stop_token_ids(smollm2_fields) == set(VECTORS["smollm2_eog"])  # <|endoftext|>, <|im_end|>, <reponame>
