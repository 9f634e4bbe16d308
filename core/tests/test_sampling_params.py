import msgspec
import pytest
import torch

from cvllm.engine_process.messages import AddRequest, ToCore
from cvllm.sampling_params import SamplingParamError, SamplingParams


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


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 129}, "n"),
        ({"n": True}, "n"),
        ({"top_k": 2**31}, "top_k"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"min_tokens": 2**31, "max_tokens": None}, "min_tokens"),
        ({"logprobs": 2**64}, "logprobs"),
        ({"prompt_logprobs": 2**31}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids"),
        ({"logit_bias": {2**31: 1.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 1180591620717411303424}, "seed"),   # issue 15: was a 500 from the engine-core transport
        ({"temperature": NAN}, "temperature"),
        ({"temperature": INF}, "temperature"),
        ({"temperature": 10**400}, "temperature"),   # an int no float can hold
        ({"temperature": "1"}, "temperature"),
        ({"top_p": NAN}, "top_p"),
        ({"min_p": NAN}, "min_p"),
        ({"presence_penalty": NAN}, "presence_penalty"),
        ({"frequency_penalty": -INF}, "frequency_penalty"),
        ({"repetition_penalty": INF}, "repetition_penalty"),
        ({"repetition_penalty": 1e300}, "repetition_penalty"),   # inf as the device's float32
        ({"temperature": 1e39}, "temperature"),
        ({"repetition_penalty": NAN}, "repetition_penalty"),
        ({"logit_bias": {5: NAN}}, "logit_bias"),
        ({"logit_bias": {5: INF}}, "logit_bias"),
        ({"ignore_eos": 1}, "ignore_eos"),   # the core's transport carries booleans only as such
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
        ({"logits_processors": "upper"}, "logits_processors"),   # a list of names, not one
        ({"logits_processors": [3]}, "logits_processors"),
        ({"logits_processors": ["not_registered"]}, "logits_processors"),
    ],
)
def test_out_of_range_values_are_errors_that_name_the_field(kwargs, field):
    # the server reports `param` as the 400's; the message starts with it too
    with pytest.raises(SamplingParamError, match=rf"^{field} ") as excinfo:
        SamplingParams(**kwargs)
    assert excinfo.value.param == field and isinstance(excinfo.value, ValueError)


def test_upper_bounds_are_accepted():
    p = SamplingParams(n=128, top_k=2**31 - 1, max_tokens=2**31 - 1, min_tokens=2**31 - 1, logprobs=2**31 - 1,
                       stop_token_ids=[2**31 - 1], logit_bias={2**31 - 1: 100.0}, seed=2**64 - 1)
    assert p.n == 128 and p.seed == 2**64 - 1


@pytest.mark.parametrize("seed", [-(2**63), -1, 0, 2**63, 2**64 - 1, -(2**63) - 1, 2**64])
def test_seed_range_is_what_manual_seed_and_the_core_transport_take(seed):
    def accepted(make) -> bool:
        try:
            make()
            return True
        except (ValueError, OverflowError, RuntimeError):
            return False

    in_range = accepted(lambda: SamplingParams(seed=seed))
    assert in_range == accepted(lambda: torch.Generator().manual_seed(seed))
    assert in_range == accepted(lambda: msgspec.msgpack.encode(seed))
    if in_range:
        wire = msgspec.msgpack.encode(AddRequest("r", [1], SamplingParams(seed=seed)))
        assert msgspec.msgpack.decode(wire, type=ToCore).params.seed == seed


def test_numbers_become_floats_the_transport_can_carry():
    p = SamplingParams(temperature=10**30, repetition_penalty=10**25, top_p=1, logit_bias={3: 100})
    assert (p.temperature, p.repetition_penalty, p.top_p, p.logit_bias) == (1e30, 1e25, 1.0, {3: 100.0})
    assert all(type(v) is float for v in (p.temperature, p.repetition_penalty, p.top_p, *p.logit_bias.values()))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(AddRequest("r", [1], p)), type=ToCore).params == p
