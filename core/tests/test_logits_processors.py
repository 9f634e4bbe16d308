"""Named logits processors: a plugin registers them (register_samplers), a request names them
(SamplingParams.logits_processors, or the HTTP field), and the sampler applies each to the rows that asked only."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from cvllm.engine.logits_processors import LogitsProcessor
from cvllm.engine.sampler import Sampler
from cvllm.sampling_params import SamplingParamError, SamplingParams
from cvllm.testing.fakes import HI, FakeClient, call, make_state
from cvllm.testing.plugins import registers

VOCAB = 16
CALLS: list[tuple[str, list[int], tuple[int, ...]]] = []   # (processor, rows' seq ids, logits' shape)


class Force(LogitsProcessor):
    """Every token but ``token`` forbidden."""
    token = 7

    def __init__(self, vocab_size: int, device: torch.device):
        super().__init__(vocab_size, device)
        assert (vocab_size, device) == (VOCAB, torch.device("cpu"))

    def apply(self, logits, rows):
        CALLS.append((type(self).__name__, [row.seq_id for row in rows], tuple(logits.shape)))
        forced = torch.full_like(logits, float("-inf"))
        forced[:, self.token] = logits[:, self.token]
        return forced


class ForceNine(Force):
    token = 9


class Shift(LogitsProcessor):
    """The logits rolled one token up (in place): forced 7 becomes 8, forced 9 becomes 10."""

    def apply(self, logits, rows):
        CALLS.append(("Shift", [row.seq_id for row in rows], tuple(logits.shape)))
        logits.copy_(logits.roll(1, dims=1))
        return logits


@dataclass
class Row:
    seq_id: int
    sampling_params: SamplingParams
    token_ids: list[int] = field(default_factory=lambda: [1])
    num_prompt_tokens: int = 1
    generator: torch.Generator | None = None
    min_tokens_stop_ids: list[int] = field(default_factory=list)


@pytest.fixture(autouse=True)
def processors(only_builtin_plugins, add_plugin):
    add_plugin(registers("register_samplers", ("force7", Force), ("force9", f"{__name__}:ForceNine"),
                         ("shift", Shift)), "procs")
    CALLS.clear()


def sample(rows: list[Row], sampler: Sampler | None = None) -> list[int]:
    logits = torch.zeros(len(rows), VOCAB)
    logits[:, 3] = 5.0   # every row's own choice: token 3
    return (sampler or Sampler())(logits, rows).token_ids.tolist()


GREEDY = {"temperature": 0.0}


def test_a_processor_changes_only_the_rows_that_named_it():
    rows = [Row(10, SamplingParams(**GREEDY)), Row(11, SamplingParams(**GREEDY, logits_processors=["force7"])),
            Row(12, SamplingParams(**GREEDY)), Row(13, SamplingParams(temperature=0.8, logits_processors=["force7"]))]
    assert sample(rows) == [3, 7, 3, 7]
    assert CALLS == [("Force", [11, 13], (2, VOCAB))]   # once, with its two rows only


def test_each_row_gets_its_processors_in_its_own_order():
    rows = [Row(0, SamplingParams(**GREEDY, logits_processors=["force7", "shift"])),
            Row(1, SamplingParams(**GREEDY, logits_processors=["shift", "force9"])),
            Row(2, SamplingParams(**GREEDY, logits_processors=["force9"])),
            Row(3, SamplingParams(**GREEDY))]
    assert sample(rows) == [8, 9, 9, 3]   # force then shift: 8; shift (3 -> 4) then force 9: 9
    # by list position: the first names (force7, shift, force9), then the second ones (shift, force9)
    assert CALLS == [("Force", [0], (1, VOCAB)), ("Shift", [1], (1, VOCAB)), ("ForceNine", [2], (1, VOCAB)),
                     ("Shift", [0], (1, VOCAB)), ("ForceNine", [1], (1, VOCAB))]


def test_a_batch_that_all_asked_is_processed_whole_and_one_that_did_not_costs_nothing():
    sampler = Sampler()
    assert sample([Row(0, SamplingParams(**GREEDY))] * 3, sampler) == [3, 3, 3]
    assert CALLS == [] and sampler.logits_processors._instances == {}   # none made
    assert sample([Row(0, SamplingParams(**GREEDY, logits_processors=["shift"]))] * 2, sampler) == [4, 4]
    assert CALLS == [("Shift", [0, 0], (2, VOCAB))]
    sample([Row(0, SamplingParams(**GREEDY, logits_processors=["shift"]))], sampler)
    assert list(sampler.logits_processors._instances) == ["shift"]   # one instance per name, kept


def test_logprobs_stay_the_models_own():
    row = Row(0, SamplingParams(**GREEDY, logprobs=1, logits_processors=["force7"]))
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 5.0
    out = Sampler()(logits, [row])
    assert out.token_ids.tolist() == [7] and out.top_ids.tolist() == [[3]]
    assert out.logprobs.item() == pytest.approx(logits.log_softmax(-1)[0, 7].item())


def test_unknown_names_are_rejected_naming_the_field_and_what_is_registered():
    with pytest.raises(SamplingParamError, match=r"^logits_processors names 'nope', which no plugin registered; "
                                                 r"registered: force7, force9, shift") as excinfo:
        SamplingParams(logits_processors=["force7", "nope"])
    assert excinfo.value.param == "logits_processors"
    assert SamplingParams(logits_processors=("shift",)).logits_processors == ["shift"]
    assert SamplingParams().logits_processors is None


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_the_server_takes_the_field_and_answers_400_for_an_unknown_name(tokenizer, path):
    prompt = {"messages": HI} if "chat" in path else {"prompt": "hi"}
    client = FakeClient([[5]])
    response = call(make_state(tokenizer, client), "POST", path, {**prompt, "logits_processors": ["force9"]})
    assert response.status_code == 200 and client.params[-1].logits_processors == ["force9"]
    response = call(make_state(tokenizer, client), "POST", path, {**prompt, "logits_processors": ["force9", "x"]})
    assert response.status_code == 400 and len(client.params) == 1
    error = response.json()["error"]
    assert error["param"] == "logits_processors" and "'x', which no plugin registered" in error["message"]
