"""The output processor on scripted core deltas and a tokenizer whose tokens are known pieces of text: stop
strings across tokens, the core's stop token, n completions, logprobs, the sampling defaults' precedence."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cvllm.engine.sequence import Sequence
from cvllm.engine_process.deltas import DeltaBuilder
from cvllm.engine_process.messages import SeqDelta, TokenLogprobs
from cvllm.output_processor import CompletionState, OutputProcessor, RequestState
from cvllm.outputs import Logprob
from cvllm.sampling_defaults import sampling_defaults
from cvllm.sampling_params import SamplingParams

PIECES = ["<eos>", "Hel", "lo", " wo", "rld", "!", " and", " more"]
EOS = 0
HELLO = [1, 2, 3, 4, 5, 6, 7]   # "Hello world! and more"


class PieceTokenizer:
    """Token i is the text PIECES[i]; token 0 is a special token (skipped when asked)."""
    tokenizer = None   # what the detokenizer hands back to the stream's step()
    special_ids = frozenset({EOS})

    def decode_stream(self, skip_special_tokens: bool = True):
        return SimpleNamespace(step=lambda _, token_id: self.decode([token_id], skip_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(PIECES[i] for i in ids if not (skip_special_tokens and i in self.special_ids))


TOKENIZER = PieceTokenizer()


def deltas(ids: list[int], finish: str | None = "length", request_id: str = "r", index: int = 0,
           logprobs: bool = False, stop_reason: int | None = None) -> list[SeqDelta]:
    """One delta per token, the last one carrying ``finish``, as the core sends a steady stream."""
    return [SeqDelta(request_id, index, [token], [TokenLogprobs(-0.5 * token, [token], [-0.5 * token])]
                     if logprobs else None, finish if i == len(ids) - 1 else None,
                     stop_reason if i == len(ids) - 1 else None) for i, token in enumerate(ids)]


def run_offline(params: SamplingParams, *streams: list[SeqDelta], prompt_ids=(9, 9)):
    """Final-only outputs, as LLM.generate gets them; returns the output and what the processor asked to stop."""
    processor = OutputProcessor(TOKENIZER)
    processor.add_request("r", "prompt", list(prompt_ids), params)
    stopped, finished = {}, 0
    for step in zip(*streams):   # the n completions' deltas interleaved, a step at a time
        result = processor.process(list(step))
        for request_id, indices in result.stopped.items():
            stopped.setdefault(request_id, []).extend(indices)
        finished += result.num_finished
    return processor.pop("r"), stopped, finished


def run_streamed(params: SamplingParams, stream: list[SeqDelta]) -> tuple[list[str], CompletionState]:
    choice = CompletionState(0, TOKENIZER, params)
    request = RequestState([choice], [9, 9])
    pieces = [update.text for delta in stream for _, update in request.apply([delta])]
    return pieces, choice


@pytest.mark.parametrize("stop", ["lo wo", "o w", "ld!"])
def test_a_stop_string_spanning_tokens_ends_the_completion_at_its_start(stop):
    text = "Hello world! and more"
    out, stopped, finished = run_offline(SamplingParams(stop=[stop, "never"]), deltas(HELLO))
    completion = out.outputs[0]
    assert completion.text == text[:text.index(stop)]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    # the tokens end with the one that completed the stop string; the core is told to stop generating
    end = next(i for i in range(len(HELLO)) if stop in TOKENIZER.decode(HELLO[:i + 1]))
    assert completion.token_ids == HELLO[:end + 1]
    assert stopped == {"r": [0]} and finished == 1
    kept, _, _ = run_offline(SamplingParams(stop=[stop], include_stop_str_in_output=True), deltas(HELLO))
    assert kept.outputs[0].text == text[:text.index(stop) + len(stop)]


def test_streamed_text_never_takes_back_what_it_handed_out():
    pieces, choice = run_streamed(SamplingParams(stop=["rld! x"]), deltas(HELLO))
    # the text so far is 3, 5, 8, 11, 12, 16, 21 characters; its last len(stop) - 1 = 5 wait (they could start the
    # stop string) until the request ends: 0, 0, 3, 6, 7, 11 characters out, then the rest
    assert pieces == ["", "", "Hel", "lo ", "w", "orld", "! and more"]
    assert "".join(pieces) == choice.text == "Hello world! and more" and choice.finish_reason == "length"
    cut, choice = run_streamed(SamplingParams(stop=["ld! a"]), deltas(HELLO))
    assert "".join(cut) == choice.text == "Hello wor" and choice.num_tokens == 6   # up to " and"


def test_the_cores_stop_token_is_kept_in_the_tokens_but_not_in_the_text():
    ids = [1, 2, 5]   # "Hel" "lo" "!" with "!" as a stop token id
    for skip in (True, False):
        out, stopped, _ = run_offline(SamplingParams(stop_token_ids=[5], skip_special_tokens=skip),
                                      deltas(ids, finish="stop", stop_reason=5))
        completion = out.outputs[0]
        assert (completion.text, completion.token_ids) == ("Hello", ids)
        assert (completion.finish_reason, completion.stop_reason) == ("stop", 5) and stopped == {}
    kept, _, _ = run_offline(SamplingParams(include_stop_str_in_output=True), deltas(ids, finish="stop"))
    assert kept.outputs[0].text == "Hello!"
    visible_eos, _, _ = run_offline(SamplingParams(skip_special_tokens=False), deltas([1, 2, EOS], finish="stop"))
    assert visible_eos.outputs[0].text == "Hello"
    pieces, choice = run_streamed(SamplingParams(skip_special_tokens=False), deltas([1, 2, EOS], finish="stop"))
    assert "".join(pieces) == "Hello" and choice.num_tokens == 3


def test_n_completions_finish_separately_and_only_stopped_ones_are_reported():
    params = SamplingParams(n=2, stop=[" wo"])
    first = deltas(HELLO, index=0)
    second = deltas([7, 5, 7, 5, 7, 5, 7], index=1)   # " more! more! ..." never matches
    out, stopped, finished = run_offline(params, first, second)
    assert [c.index for c in out.outputs] == [0, 1]
    assert [c.text for c in out.outputs] == ["Hello", " more! more! more! more"]
    assert [c.finish_reason for c in out.outputs] == ["stop", "length"]
    assert stopped == {"r": [0]} and finished == 2 and out.finished


def test_deltas_past_a_stop_and_of_other_requests_are_ignored():
    processor = OutputProcessor(TOKENIZER)
    processor.add_request("r", None, [9], SamplingParams(stop=["lo"]))
    result = processor.process([*deltas([1, 2], finish=None), SeqDelta("other", 0, [3])])
    assert result.stopped == {"r": [0]}
    again = processor.process(deltas([3, 4]))
    assert again.num_finished == 0 and again.stopped == {}
    assert processor.pop("r").outputs[0].token_ids == [1, 2] and not processor.requests


def test_logprobs_are_decoded_with_ranks_and_summed():
    params = SamplingParams(logprobs=2, prompt_logprobs=1)
    stream = [SeqDelta("r", 0, [1], [TokenLogprobs(-0.25, [1, 2], [-0.25, -2.0])],
                       prompt_logprobs=[None, TokenLogprobs(-3.0, [4], [-1.0])]),
              SeqDelta("r", 0, [3, 5], [TokenLogprobs(-4.0, [6, 7], [-0.5, -1.5]),   # sampled outside the top 2
                                        TokenLogprobs(-0.125, [5, 1], [-0.125, -3.0])], "length")]
    out, _, _ = run_offline(params, stream, prompt_ids=(9, 3))
    completion = out.outputs[0]
    assert completion.token_ids == [1, 3, 5] and completion.text == "Hel wo!"
    assert completion.logprobs == [
        {1: Logprob(-0.25, 1, "Hel"), 2: Logprob(-2.0, 2, "lo")},
        {6: Logprob(-0.5, 1, " and"), 7: Logprob(-1.5, 2, " more"), 3: Logprob(-4.0, None, " wo")},
        {5: Logprob(-0.125, 1, "!"), 1: Logprob(-3.0, 2, "Hel")}]
    assert completion.cumulative_logprob == pytest.approx(-0.25 - 4.0 - 0.125)
    assert out.prompt_logprobs == [None, {4: Logprob(-1.0, 1, "rld"), 3: Logprob(-3.0, None, " wo")}]
    plain, _, _ = run_offline(SamplingParams(), deltas(HELLO))
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None


def test_without_a_tokenizer_there_are_tokens_but_no_text():
    processor = OutputProcessor(None)
    processor.add_request("r", None, [9], SamplingParams(stop=["lo"], logprobs=0))
    processor.process(deltas([1, 2, 3], logprobs=True))
    completion = processor.pop("r").outputs[0]
    assert (completion.text, completion.token_ids, completion.finish_reason) == ("", [1, 2, 3], "length")
    assert completion.logprobs[0] == {1: Logprob(-0.5, 1, None)}


def test_the_delta_builder_reports_each_token_once_and_the_prompt_once():
    params = SamplingParams(n=2, logprobs=0)
    seqs = [Sequence(i, "r", [9, 9], params, index=i) for i in range(2)]
    for seq in seqs:
        seq.logprobs, seq.num_cached_tokens = [], 2
    engine = SimpleNamespace(requests={"r": seqs}, release_request=lambda request_id: engine.requests.pop(request_id))
    builder = DeltaBuilder(engine)
    for seq, token in zip(seqs, (1, 2)):
        seq.append_token(token)
        seq.logprobs.append({token: Logprob(-1.0, None)})
    first = builder.deltas(seqs)
    assert [(d.index, d.token_ids, d.num_cached_tokens) for d in first] == [(0, [1], 2), (1, [2], 2)]
    seqs[0].append_token(3)
    seqs[0].logprobs.append({3: Logprob(-2.0, 1)})
    seqs[0].finish_reason = "length"
    later = builder.deltas(seqs[:1])
    assert later[0].token_ids == [3] and later[0].num_cached_tokens == 0
    assert later[0].logprobs == [TokenLogprobs(-2.0, [3], [-2.0])]
    builder.release_finished(later)
    assert "r" in engine.requests   # completion 1 is still running


def test_sampling_defaults_precedence():
    model = {"temperature": 0.6, "top_k": 20, "do_sample": False, "max_new_tokens": 5, "top_p": None}
    assert sampling_defaults(model) == {"temperature": 0.0, "top_k": 20}   # do_sample false: greedy
    assert sampling_defaults(model, "vllm") == {}
    flags = {"temperature": 0.9, "top_p": None, "max_tokens": 7}
    assert sampling_defaults(model, "auto", flags) == {"temperature": 0.9, "top_k": 20, "max_tokens": 7}
    assert sampling_defaults(model, "vllm", flags) == {"temperature": 0.9, "max_tokens": 7}
