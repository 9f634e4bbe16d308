import pytest

from cvllm.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.seed, p.logprobs, p.min_tokens) == (16, None, None, 0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.ignore_eos, p.skip_special_tokens, p.include_stop_str_in_output) == (False, True, False)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.greedy and not p.needs_penalties


def test_stop_is_normalised_to_lists():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(7, 9)).stop_token_ids == [7, 9]


def test_greedy_threshold():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy


@pytest.mark.parametrize(
    "kwargs",
    [{"presence_penalty": 0.5}, {"frequency_penalty": -0.1}, {"repetition_penalty": 1.1}],
)
def test_needs_penalties(kwargs):
    assert SamplingParams(**kwargs).needs_penalties


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_boundary_values_are_accepted():
    p = SamplingParams(
        temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, max_tokens=None, min_tokens=100,
        presence_penalty=-2.0, frequency_penalty=2.0, logprobs=0, seed=0,
    )
    assert p.max_tokens is None and p.min_tokens == 100 and p.logprobs == 0
