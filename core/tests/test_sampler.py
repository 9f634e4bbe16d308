import math
from dataclasses import dataclass, field

import pytest
import torch

from cvllm.engine.penalties import PenaltyHistory, histories_from_token_lists
from cvllm.engine.sampler import (
    Sampler,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    make_generator,
)
from cvllm.sampling_params import SamplingParams


@dataclass
class Row:
    seq_id: int
    sampling_params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None = None
    min_tokens_stop_ids: list[int] = field(default_factory=list)


_seq_ids = iter(range(10**9))


def make_row(params: SamplingParams, prompt=(0,), output=(), stop_ids=()) -> Row:
    generator = make_generator(params.seed, "cpu") if params.seed is not None else None
    return Row(next(_seq_ids), params, [*prompt, *output], len(prompt), generator, list(stop_ids))


def penalise(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """apply_penalties with the rows' histories built from their token lists."""
    counts, seen = histories_from_token_lists(rows, logits.shape[1], logits.device)
    return apply_penalties(logits, [row.sampling_params for row in rows], counts, seen)


# A distribution whose top-p and min-p cut points are far from ties and rounding.
PROBS = torch.tensor([0.35, 0.25, 0.15, 0.10, 0.07, 0.05, 0.02, 0.01])
LOGITS = PROBS.log()


def empirical(params: SamplingParams, logits=LOGITS, n=20000, seed=1234) -> torch.Tensor:
    torch.manual_seed(seed)
    batch = logits.expand(n, -1).clone()
    ids = Sampler()(batch, [make_row(params) for _ in range(n)]).token_ids
    return torch.bincount(ids, minlength=logits.numel()).float() / n


def assert_distribution(freq: torch.Tensor, expected: torch.Tensor) -> None:
    assert set(freq.nonzero().flatten().tolist()) == set(expected.nonzero().flatten().tolist())
    torch.testing.assert_close(freq, expected, atol=0.012, rtol=0)


def restricted(probs: torch.Tensor, keep: list[int]) -> torch.Tensor:
    out = torch.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


def test_penalties_match_hand_computed_values():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0]).repeat(3, 1)
    rows = [
        # prompt [1, 2], output [2, 3, 3]
        make_row(SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
                 prompt=(1, 2), output=(2, 3, 3)),
        make_row(SamplingParams(), prompt=(1, 2), output=(3,)),
        # prompt tokens must not count for frequency: only the output 0 does
        make_row(SamplingParams(frequency_penalty=1.0), prompt=(4, 4), output=(0,)),
    ]
    expected = torch.tensor([
        # 1: seen in prompt, negative -> *2; 2: 0.5/2 - 0.25*1 - 0.5; 3: 3/2 - 0.25*2 - 0.5
        [2.0, -2.0, -0.5, 0.5, -2.0, 1.0],
        [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
        [1.0, -1.0, 0.5, 3.0, -2.0, 1.0],
    ])
    torch.testing.assert_close(penalise(logits, rows), expected)
    # The caller's logits are left alone.
    assert logits[0, 3].item() == 3.0

    for row in rows:
        row.sampling_params.temperature = 0.0
    out = Sampler()(logits, rows)
    assert out.token_ids.tolist() == [0, 3, 3]


def test_repetition_penalty_below_one_favours_seen_tokens():
    logits = torch.tensor([[1.0, 0.8, -0.5]])
    rows = [make_row(SamplingParams(repetition_penalty=0.5), prompt=(1, 2))]
    torch.testing.assert_close(penalise(logits, rows), torch.tensor([[1.0, 1.6, -0.25]]))


def test_greedy_is_argmax_whatever_the_global_seed():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=5e-6, top_k=3, top_p=0.5, min_p=0.2)] * 2
    rows = [make_row(p) for p in params]
    for seed in range(5):
        torch.manual_seed(seed)
        ids = Sampler()(logits, rows).token_ids
        greedy = [i for i, p in enumerate(params) if p.greedy]
        assert ids[greedy].tolist() == logits.argmax(-1)[greedy].tolist()


def test_temperature_only_matches_softmax():
    assert_distribution(empirical(SamplingParams()), PROBS)
    hot = (LOGITS / 0.5).softmax(-1)
    assert_distribution(empirical(SamplingParams(temperature=0.5, top_k=4)), restricted(hot, [0, 1, 2, 3]))


def test_top_k_support_and_frequencies():
    assert_distribution(empirical(SamplingParams(top_k=3)), restricted(PROBS, [0, 1, 2]))


def test_top_p_keeps_smallest_set_reaching_p():
    # mass before tokens 0..4: 0, .35, .60, .75, .85 -> p=0.8 keeps 0..3
    assert_distribution(empirical(SamplingParams(top_p=0.8)), restricted(PROBS, [0, 1, 2, 3]))
    # a tiny p still keeps the most likely token
    assert_distribution(empirical(SamplingParams(top_p=1e-4), n=500), restricted(PROBS, [0]))


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    # top_k=5 renormalises by 0.92: mass before token 3 becomes 0.75/0.92 = 0.815, before 4 0.924.
    # Without that renormalisation p=0.8 would keep token 3 (mass before it 0.75).
    assert_distribution(empirical(SamplingParams(top_k=5, top_p=0.8)), restricted(PROBS, [0, 1, 2]))
    assert_distribution(empirical(SamplingParams(top_k=5, top_p=0.82)), restricted(PROBS, [0, 1, 2, 3]))


def test_min_p_is_relative_to_the_largest_probability():
    # threshold 0.3 * 0.35 = 0.105 keeps 0..2; 0.25 * 0.35 = 0.0875 keeps 0..3
    assert_distribution(empirical(SamplingParams(min_p=0.3)), restricted(PROBS, [0, 1, 2]))
    assert_distribution(empirical(SamplingParams(min_p=0.25)), restricted(PROBS, [0, 1, 2, 3]))


def test_top_k_is_exact_per_row():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(top_k=k) for k in (1, 3, 0, -1, 99)]
    out = apply_top_k_top_p(logits, params)
    assert torch.isfinite(out).sum(-1).tolist() == [1, 3, 40, 40, 40]
    kept = torch.isfinite(out[1]).nonzero().flatten()
    assert sorted(kept.tolist()) == sorted(logits[1].topk(3).indices.tolist())
    torch.testing.assert_close(out[1, kept], logits[1, kept])


def test_the_race_in_log_space_picks_what_the_probabilities_race_picks():
    """argmax(logit - log E) against argmax(softmax(logit) / E) with the same draws E (the sampler's former form):
    the same ids, masked tokens never chosen."""
    from cvllm.engine.sampler import _exponential_race
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(4)) * 3
    logits[:, ::7] = float("-inf")
    ids = _exponential_race(logits, [make_generator(i, "cpu") for i in range(64)])
    noise = torch.stack([torch.empty(500).exponential_(generator=make_generator(i, "cpu")) for i in range(64)])
    assert torch.equal(ids, (logits.softmax(-1) / noise.clamp_min(1e-10)).argmax(-1))
    assert (ids % 7 != 0).all()


def test_disabled_filters_do_no_work():
    logits = torch.randn(3, 10)
    params = [SamplingParams(top_k=0), SamplingParams(top_k=-1), SamplingParams(top_k=10)]
    assert apply_top_k_top_p(logits, params) is logits
    assert apply_min_p(logits, params) is logits


def test_penalty_history_on_the_device_matches_the_token_lists():
    """Rows built from token lists, grown past the first allocation, fed sampled tokens, released and
    reused: what gather returns equals the histories rebuilt from the rows' lists each time."""
    g = torch.Generator().manual_seed(3)
    vocab = 40
    history = PenaltyHistory(vocab, "cpu")

    def random_row():
        prompt = torch.randint(0, vocab, (int(torch.randint(1, 12, (), generator=g)),), generator=g).tolist()
        output = torch.randint(0, vocab, (int(torch.randint(0, 5, (), generator=g)),), generator=g).tolist()
        return make_row(SamplingParams(frequency_penalty=1.0), prompt=prompt, output=output)

    live = [random_row() for _ in range(5)]
    for step in range(6):
        rows = history.rows(live)
        counts, seen = history.gather(rows)
        want_counts, want_seen = histories_from_token_lists(live, vocab, "cpu")
        assert torch.equal(counts, want_counts) and torch.equal(seen, want_seen), step
        sampled = torch.randint(0, vocab, (len(live),), generator=g)
        history.record(rows, sampled)
        for row, token in zip(live, sampled.tolist()):
            row.token_ids.append(token)
        finished = live.pop(step % len(live))         # one finishes (its row is reused), two arrive
        history.release(finished.seq_id)
        live += [random_row(), random_row()]
    history.rows(live)
    assert len(history) == 11 and history.counts.shape[0] == 16   # grown past the first 8 rows


def test_sampler_with_a_penalty_history_samples_like_one_built_from_lists():
    """Steps of greedy sampling under every penalty: the device history gives the tokens the host lists give."""
    logits = torch.randn(8, 4, 30, generator=torch.Generator().manual_seed(5)).abs()   # positive: penalties bite
    params = [SamplingParams(temperature=0, repetition_penalty=1.8), SamplingParams(temperature=0),
              SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=0.7),
              SamplingParams(temperature=0, frequency_penalty=1.5)]
    with_history = [make_row(p, prompt=(1, 2, 3)) for p in params]
    from_lists = [make_row(p, prompt=(1, 2, 3)) for p in params]
    history, sampler = PenaltyHistory(30, "cpu"), Sampler()
    for step_logits in logits:
        a = sampler(step_logits, with_history, history=history).token_ids.tolist()
        b = sampler(step_logits, from_lists).token_ids.tolist()
        assert a == b
        for rows, tokens in ((with_history, a), (from_lists, b)):
            for row, token in zip(rows, tokens):
                row.token_ids.append(token)
    assert len(history) == 3   # the row without penalties has no history
    assert [len(set(row.token_ids[3:])) for row in from_lists][3] > 1   # frequency penalty moved greedy on


class RowWithoutHistory(Row):
    """A row whose token history must not be read when no penalty or min_tokens applies."""

    @property
    def token_ids(self):  # type: ignore[override]
        raise AssertionError("token_ids read although no penalty needs it")

    @token_ids.setter
    def token_ids(self, value):
        pass


def test_penalty_inputs_are_not_built_when_no_row_uses_penalties():
    rows = [RowWithoutHistory(i, SamplingParams(temperature=t), [], 1) for i, t in enumerate((0.0, 0.7))]
    out = Sampler()(torch.randn(2, 16), rows)
    assert out.token_ids.dtype == torch.int64 and out.logprobs is None
    assert out.top_ids is None and out.top_logprobs is None


def test_min_tokens_suppresses_stop_ids_until_enough_outputs():
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0, 4.5]])
    params = SamplingParams(temperature=0.0, min_tokens=2)
    early = make_row(params, prompt=(0, 0, 0), output=(1,), stop_ids=(2, 4))
    done = make_row(params, prompt=(0, 0, 0), output=(1, 1), stop_ids=(2, 4))
    assert Sampler()(logits.repeat(2, 1), [early, done]).token_ids.tolist() == [3, 2]

    # Random rows never draw a suppressed id, even the most likely one.
    n = 2000
    sampled = Sampler()(logits.repeat(n, 1), [make_row(SamplingParams(min_tokens=1), stop_ids=(2,))] * n)
    assert not (sampled.token_ids == 2).any()
    assert (sampled.token_ids == 4).any()


def seeded_sequence(seed: int, others: int, position: int, global_seed: int, steps=12) -> list[int]:
    logits = torch.randn(others + 1, 1000, generator=torch.Generator().manual_seed(5))
    logits[position] = torch.linspace(0, 1, 1000)  # the seeded row always sees the same logits
    rows = [make_row(SamplingParams(seed=100 + i if i % 2 else None)) for i in range(others + 1)]
    rows[position] = make_row(SamplingParams(seed=seed))
    torch.manual_seed(global_seed)
    sampler = Sampler()
    return [sampler(logits, rows).token_ids[position].item() for _ in range(steps)]


def test_seeded_rows_reproducible_and_independent_of_batch_and_global_rng():
    alone = seeded_sequence(seed=42, others=0, position=0, global_seed=0)
    assert len(set(alone)) > 6  # it really samples
    assert seeded_sequence(seed=42, others=3, position=2, global_seed=7) == alone
    assert seeded_sequence(seed=42, others=5, position=5, global_seed=123) == alone
    assert seeded_sequence(seed=43, others=0, position=0, global_seed=0) != alone


def test_unseeded_rows_follow_the_global_generator():
    logits = torch.zeros(64, 1000)
    rows = [make_row(SamplingParams()) for _ in range(64)]
    torch.manual_seed(3)
    a = Sampler()(logits, rows).token_ids
    torch.manual_seed(3)
    b = Sampler()(logits, rows).token_ids
    torch.manual_seed(4)
    c = Sampler()(logits, rows).token_ids
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_seeded_row_respects_filters():
    row = make_row(SamplingParams(seed=9, top_k=3))
    ids = {Sampler()(LOGITS.unsqueeze(0), [row]).token_ids.item() for _ in range(200)}
    assert ids == {0, 1, 2}


def test_logprobs_are_raw_log_softmax_with_per_row_k():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    params = [
        SamplingParams(logprobs=None),
        SamplingParams(logprobs=0, temperature=0.3, repetition_penalty=1.7),
        SamplingParams(logprobs=3, top_k=5, presence_penalty=1.5),
        SamplingParams(logprobs=5, temperature=0.0),
    ]
    rows = [make_row(p, prompt=(1, 2, 3), output=(4, 4)) for p in params]
    out = Sampler()(logits, rows)
    raw = logits.log_softmax(-1)
    expected_top, expected_ids = raw.topk(5, dim=-1)
    assert out.top_ids.shape == (4, 5) and out.top_ids.dtype == torch.int64
    assert torch.equal(out.top_ids, expected_ids)
    torch.testing.assert_close(out.top_logprobs, expected_top)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.logprobs.dtype == torch.float32


def test_sampled_logprob_is_returned_even_outside_top_k():
    logits = torch.tensor([[3.0, 2.0, 1.5, 0.0]])
    # min_tokens forbids the top token; the repetition penalty halves token 1's logit to 1.0.
    params = SamplingParams(temperature=0.0, logprobs=1, min_tokens=5, repetition_penalty=2.0)
    row = make_row(params, prompt=(1,), output=(), stop_ids=(0,))
    out = Sampler()(logits, [row])
    assert out.token_ids.item() == 2  # penalised logits: [-inf, 1.0, 1.5, 0.0]
    raw = logits.log_softmax(-1)[0]
    assert out.top_ids.tolist() == [[0]]
    assert out.logprobs.item() == pytest.approx(raw[2].item())
    assert math.isfinite(out.logprobs.item())


def test_bfloat16_logits_are_accepted():
    logits = torch.tensor([[0.0, 4.0, 1.0]], dtype=torch.bfloat16)
    out = Sampler()(logits, [make_row(SamplingParams(temperature=0.0, logprobs=0))])
    assert out.token_ids.tolist() == [1]
    assert out.logprobs.dtype == torch.float32


def test_a_greedy_batch_takes_the_argmax_of_16_bit_logits_as_of_their_fp32_copy():
    """Decode steps hand over logits in the model's dtype; the sampler converts them only for what computes
    with them (temperature, bias, penalties, min_tokens, logprobs), and the greedy picks are the same."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 500, generator=g) * 3).to(torch.bfloat16)
    logits[1, 17] = logits[1, 400] = logits[1].max() + 1   # a tie: the first index wins in both
    logits[2, 9] = float("nan")
    seen = []
    sampler = Sampler()
    sampler.argmax = lambda t: seen.append(t.dtype) or t.argmax(dim=-1)
    greedy = [make_row(SamplingParams(temperature=0.0)) for _ in range(6)]
    assert torch.equal(sampler(logits, greedy).token_ids, logits.float().argmax(dim=-1)) and seen == [torch.bfloat16]
    mixed = [*greedy[:5], make_row(SamplingParams(temperature=0.0, min_tokens=3), stop_ids=[int(logits[5].argmax())])]
    out = sampler(logits, mixed).token_ids
    assert seen[-1] == torch.float32 and out[5] != logits[5].argmax() and torch.equal(out[:5],
                                                                                     logits[:5].float().argmax(-1))


def test_logit_bias_is_added_per_row_before_greedy():
    from cvllm.engine.sampler import apply_logit_bias

    logits = torch.zeros(3, 6)
    params = [SamplingParams(logit_bias={1: 2.5, 4: -1.0}), SamplingParams(), SamplingParams(logit_bias={0: 7.0})]
    out = apply_logit_bias(logits, params)
    expected = torch.zeros(3, 6)
    expected[0, 1], expected[0, 4], expected[2, 0] = 2.5, -1.0, 7.0
    assert torch.equal(out, expected) and torch.equal(logits, torch.zeros(3, 6))  # input untouched
    assert apply_logit_bias(logits, [SamplingParams()] * 3) is logits


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=1),
    SamplingParams(temperature=0.8, seed=3),
], ids=["plain-greedy", "logprobs", "sampled"])
def test_rows_holding_nan_or_inf_are_reported_as_minus_one(params):
    """The host is told -1 for a row whose logits hold NaN or +inf (the engine fails that request alone), and the
    token otherwise: -inf logits are masked tokens, even a row of them but one; the device keeps a valid id."""
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1))
    logits[1, 7] = float("nan")
    logits[2, 30] = float("inf")
    logits[3, :] = float("-inf")
    logits[3, 12] = 0.5
    logits[4, 3] = float("nan")
    logits[4, 9] = float("inf")
    out = Sampler()(logits, [make_row(params) for _ in range(5)])
    assert out.reported_ids.tolist()[1:] == [-1, -1, 12, -1]
    assert out.reported_ids[0] == out.token_ids[0] >= 0 and ((out.token_ids >= 0) & (out.token_ids < 40)).all()
