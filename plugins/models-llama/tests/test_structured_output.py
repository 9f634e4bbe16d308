"""Structured output in the engine on a tiny random Llama: any model can be forced by a grammar, so every form's
output must parse and match, at any temperature; free requests in the same batch are unchanged token for token,
and async scheduling keeps overlapping steps with grammar rows in them."""

from __future__ import annotations

import json
import re

import pytest
import torch

from cvllm import LLM, SamplingParams
from cvllm.sampling_params import SamplingParamError
from cvllm.structured_output.grammar import SequenceGrammar, apply_token_bitmask

pytestmark = pytest.mark.usefixtures("one_torch_thread")
jsonschema = pytest.importorskip("jsonschema")

ENGINE = {"dtype": "float32", "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 128}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
                         "kind": {"enum": ["cat", "dog", "human"]},
                         "note": {"anyOf": [{"type": "null"}, {"type": "boolean"}]}}}
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"   # (\\d is any Unicode digit to llguidance, as to Rust's regex)
LARK = 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]{1,3}/'
GBNF = 'root ::= answer "."\nanswer ::= "red" | "green" | "blue"'


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=str(tiny_checkpoint("llama").path), **ENGINE, async_scheduling=True)


def sampled(n: int = 1, seed: int = 0, **structure) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=120, structured_outputs=structure)


def texts(llm, prompts, params) -> list[tuple[str, str]]:
    return [(c.text, c.finish_reason) for out in llm.generate(prompts, params) for c in out.outputs]


@pytest.mark.parametrize("seed", range(3))
def test_every_form_is_obeyed_at_temperature_one(llm, seed):
    prompt = "Tell me about the dragon."
    forms = [({"json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
             ({"json": json.dumps(PERSON)}, lambda t: jsonschema.validate(json.loads(t), PERSON)),
             ({"json_object": True}, lambda t: isinstance(json.loads(t), dict) or pytest.fail(t)),
             ({"regex": PHONE}, lambda t: re.fullmatch(PHONE, t) or pytest.fail(t)),
             ({"choice": ["alpha", "beta", "gamma delta"]}, lambda t: t in ("alpha", "beta", "gamma delta")
              or pytest.fail(t)),
             ({"grammar": LARK}, lambda t: re.fullmatch(r"yes|no|maybe [0-9]{1,3}", t) or pytest.fail(t)),
             ({"grammar": GBNF}, lambda t: t in ("red.", "green.", "blue.") or pytest.fail(t))]
    params = [sampled(2, seed, **structure) for structure, _ in forms]
    outputs = llm.generate([prompt] * len(forms), params)
    for (structure, check), out in zip(forms, outputs):
        for completion in out.outputs:
            if structure.get("json_object") and completion.finish_reason == "length":
                continue   # an unbounded object: a random model may still be writing it
            assert completion.finish_reason == "stop", (structure, completion.text)   # the grammar ended: EOS
            check(completion.text)


def test_free_requests_beside_constrained_ones_are_unchanged(tiny_checkpoint):
    path = str(tiny_checkpoint("llama").path)
    free = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)]
    prompts = ["The dragon", "Once upon a time"]
    alone = LLM(model=path, **ENGINE, async_scheduling=True)
    want = texts(alone, prompts, free)
    mixed = LLM(model=path, **ENGINE, async_scheduling=True)
    constrained = [sampled(seed=1, json=PERSON), sampled(seed=2, regex=PHONE), sampled(seed=3, choice=["a", "b"])]
    got = texts(mixed, prompts + ["x", "y", "z"], free + constrained)
    assert got[:2] == want
    jsonschema.validate(json.loads(got[2][0]), PERSON)
    assert re.fullmatch(PHONE, got[3][0]) and got[4][0] in ("a", "b")
    # the grammar rows were masked with the forward in flight: steps still overlapped
    assert mixed.llm_engine.stats.overlapped_steps > 0


def test_async_and_sync_steps_give_the_same_constrained_output(tiny_checkpoint):
    path = str(tiny_checkpoint("llama").path)
    params = [SamplingParams(temperature=0, max_tokens=80, structured_outputs={"json": PERSON}),
              SamplingParams(temperature=1.0, seed=5, max_tokens=80, structured_outputs={"regex": PHONE})]
    runs = [texts(LLM(model=path, **ENGINE, async_scheduling=flag), ["dragon", "phone"], params)
            for flag in (False, True)]
    assert runs[0] == runs[1]


def test_max_tokens_mid_object_finishes_with_length(llm):
    text, reason = texts(llm, ["x"], SamplingParams(temperature=0, max_tokens=3,
                                                    structured_outputs={"json": PERSON}))[0]
    assert reason == "length" and text.startswith("{")


def test_the_grammar_starts_after_the_reasoning(llm):
    tokenizer = llm.get_tokenizer()
    end = tokenizer.encode("x", add_special_tokens=False)
    assert len(end) == 1
    # the output opens in thinking: the (biased) end token comes first, free; then the regex holds
    params = SamplingParams(temperature=0, max_tokens=20, logit_bias={end[0]: 100.0},
                            structured_outputs={"regex": "[0-9]{3}", "reasoning_end": end})
    text, reason = texts(llm, ["x"], params)[0]
    assert reason == "stop" and re.fullmatch("x[0-9]{3}", text), text


def test_a_bad_schema_regex_or_grammar_is_the_callers_error():
    for bad in ({"json": {"type": "nope"}}, {"regex": "a(b"}, {"grammar": "start: missing_rule"},
                {"regex": "a", "choice": ["b"]}, {}, {"choice": []}, {"json": "{not json"}, {"jsno": {}}):
        with pytest.raises(SamplingParamError) as error:
            SamplingParams(structured_outputs=bad)
        assert error.value.param == "structured_outputs"


class _Seq:
    def __init__(self, prompt: int):
        self.token_ids, self.num_prompt_tokens = [0] * prompt, prompt

    @property
    def num_output_tokens(self):
        return len(self.token_ids) - self.num_prompt_tokens


class _Matcher:
    def __init__(self):
        self.consumed = []

    def consume_token(self, token):
        self.consumed.append(token)
        return True


def test_reasoning_states():
    from cvllm.structured_output import StructuredOutputsParams

    opened = SequenceGrammar(_Matcher(), StructuredOutputsParams(regex="a", reasoning_end=[7, 8]))
    seq = _Seq(3)
    assert not opened.constrained
    for token in (5, 7, 8):   # "</think>" as two tokens: constrained once both are out
        seq.token_ids.append(token)
        assert opened.accept(token, seq)
    assert opened.constrained and opened.matcher.consumed == []
    seq.token_ids.append(9)
    assert opened.accept(9, seq) and opened.matcher.consumed == [9]
    plain = SequenceGrammar(_Matcher(), StructuredOutputsParams(regex="a", reasoning_end=[8], reasoning_start=6))
    assert plain.constrained   # its first token: the grammar's, or "<think>"
    seq = _Seq(1)
    seq.token_ids.append(6)
    assert plain.accept(6, seq) and not plain.constrained
    no_thinking = SequenceGrammar(_Matcher(), StructuredOutputsParams(regex="a", reasoning_end=[8],
                                                                      reasoning_start=6))
    seq = _Seq(1)
    seq.token_ids.append(4)
    assert no_thinking.accept(4, seq) and no_thinking.constrained and no_thinking.matcher.consumed == [4]


def test_bitmask_unpacking_sets_exactly_the_forbidden_logits():
    vocab = 70
    generator = torch.Generator().manual_seed(0)
    allowed = torch.rand(2, vocab, generator=generator) < 0.3
    allowed[:, 31] = allowed[:, 63] = True   # the sign bits of int32 words
    padded = torch.zeros(2, 96, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    words = (padded.view(2, 3, 32) << torch.arange(32)).sum(-1)
    bits = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    logits = torch.randn(4, vocab, generator=generator)
    rows = torch.tensor([1, 3])
    out = apply_token_bitmask(logits, rows, bits)
    assert torch.equal(out[[0, 2]], logits[[0, 2]])
    for k, row in enumerate(rows.tolist()):
        assert torch.equal(torch.isfinite(out[row]), allowed[k])
        assert torch.equal(out[row][allowed[k]], logits[row][allowed[k]])


def test_a_request_aborted_while_its_grammar_compiles_is_dropped(llm):
    engine = llm.llm_engine
    engine.add_request("compiling", [5, 6, 7], SamplingParams(max_tokens=4, structured_outputs={"json": PERSON}))
    engine.abort_request("compiling")
    for _ in range(20):
        if not engine.has_unfinished():
            break
        assert engine.step() == []
    assert not engine.has_unfinished() and "compiling" not in engine.requests
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks
