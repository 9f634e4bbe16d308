"""FusedMoE with expert parallelism, one rank at a time in this process: the expert map, the loader keeping only
this rank's experts (every checkpoint form) and skipping the others', the ranks' partial outputs summing to the
whole layer's in both compute forms, and the error for an expert count the ranks do not divide."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from cvllm.distributed import set_tensor_parallel
from cvllm.layers import FusedMoE, load_weights_with_experts, select_experts
from cvllm.layers import fused_moe_methods as methods
from cvllm.layers.expert_parallel import ExpertPlacement

E, TOP_K, H, I, T = 8, 2, 16, 12, 23

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@contextmanager
def as_rank(rank: int, size: int, expert_parallel: bool = True) -> Iterator[None]:
    """Layers built inside see this rank of ``size``; world size 1 again afterwards."""
    set_tensor_parallel(rank, size, expert_parallel)
    try:
        yield
    finally:
        set_tensor_parallel(0, 1)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


WEIGHTS = {"gate": randn(E, I, H, seed=0), "up": randn(E, I, H, seed=1), "down": randn(E, H, I, seed=2)}


def per_expert(experts=range(E)) -> list[tuple[str, torch.Tensor]]:
    return [(f"mlp.experts.{e}.{proj}_proj.weight", WEIGHTS[proj][e]) for e in experts
            for proj in ("gate", "up", "down")]


def stacked() -> list[tuple[str, torch.Tensor]]:
    return [(f"mlp.experts.{proj}_proj", WEIGHTS[proj]) for proj in ("gate", "up", "down")]


def fused() -> list[tuple[str, torch.Tensor]]:
    return [("mlp.experts.gate_up_proj", torch.cat([WEIGHTS["gate"], WEIGHTS["up"]], dim=1)),
            ("mlp.experts.down_proj", WEIGHTS["down"])]


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.experts = FusedMoE(E, TOP_K, H, I, renormalize=True, reduce_results=False)


def load(tensors) -> tuple[FusedMoE, set[str]]:
    model = Model()
    with torch.no_grad():
        loaded = load_weights_with_experts(model, tensors)
    return model.mlp.experts, loaded


def test_expert_map() -> None:
    assert ExpertPlacement(E, 0, 2).expert_map().tolist() == [0, 1, 2, 3, -1, -1, -1, -1]
    assert ExpertPlacement(E, 1, 2).expert_map().tolist() == [-1, -1, -1, -1, 0, 1, 2, 3]
    assert ExpertPlacement(E, 2, 4).expert_map().tolist() == [-1, -1, -1, -1, 0, 1, -1, -1]
    assert ExpertPlacement(E).expert_map().tolist() == list(range(E))
    placement = ExpertPlacement(E, 1, 4)
    assert [placement.local_id(e) for e in range(E)] == [None, None, 0, 1, None, None, None, None]
    # the compute forms' arithmetic is the map, with num_local standing for "elsewhere"
    ids = torch.randint(0, E, (50, TOP_K), generator=torch.Generator().manual_seed(3))
    mapped = placement.expert_map()[ids]
    assert torch.equal(placement.localize(ids), torch.where(mapped < 0, placement.num_local, mapped))


@pytest.mark.parametrize("tensors", [per_expert, stacked, fused])
def test_each_rank_loads_only_its_experts_whole(tensors) -> None:
    for rank in range(2):
        with as_rank(rank, 2):
            layer, loaded = load(tensors())
        assert loaded == {"mlp.experts.w13_weight", "mlp.experts.w2_weight"}
        mine = slice(rank * E // 2, (rank + 1) * E // 2)
        assert tuple(layer.w13_weight.shape) == (E // 2, 2 * I, H)     # half the experts, all of I
        assert torch.equal(layer.w13_weight, torch.cat([WEIGHTS["gate"][mine], WEIGHTS["up"][mine]], dim=1))
        assert torch.equal(layer.w2_weight, WEIGHTS["down"][mine])


def test_other_ranks_experts_are_skipped_not_needed() -> None:
    class Refuses(torch.Tensor):
        """A checkpoint tensor that fails if anything but its shape is read."""
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func not in (torch.Tensor.dim, torch.Tensor.shape.__get__, torch.Tensor.size):
                raise AssertionError(f"rank 0 read another rank's expert ({func.__name__})")
            return super().__torch_function__(func, types, args, kwargs or {})

    with as_rank(0, 2):
        others = [(name, tensor.as_subclass(Refuses)) for name, tensor in per_expert(range(4, E))]
        layer, loaded = load(per_expert(range(4)) + others)
        assert loaded == {"mlp.experts.w13_weight", "mlp.experts.w2_weight"}
        # a reader may leave the other ranks' experts out entirely; one of our own missing is still missing
        assert load(per_expert(range(4)))[1] == {"mlp.experts.w13_weight", "mlp.experts.w2_weight"}
        partial = [(n, t) for n, t in per_expert(range(4)) if n != "mlp.experts.2.up_proj.weight"]
        assert load(partial)[1] == {"mlp.experts.w2_weight"}


@pytest.mark.parametrize("form", ["grouped", "padded"])
@pytest.mark.parametrize("tokens", [1, 4, T])
def test_ranks_partial_outputs_sum_to_the_whole(form: str, tokens: int) -> None:
    """Each rank runs only its experts on every token; the all-reduce (a sum here) makes the whole output. One
    token routes both its experts to a single rank, so the other rank has no pair at all."""
    run = getattr(methods, f"experts_{form}")
    x, logits = randn(tokens, H, seed=10), randn(tokens, E, seed=11) * 2
    weights, ids = select_experts(logits, TOP_K, renormalize=True)
    whole, _ = load(per_expert())
    with torch.inference_mode():
        want = methods.experts_grouped(whole, x, weights, ids)
        parts = []
        for rank in range(2):
            with as_rank(rank, 2):
                layer, _ = load(per_expert())
            parts.append(run(layer, x, weights, ids))
    torch.testing.assert_close(parts[0] + parts[1], want, rtol=1e-5, atol=1e-5)
    if tokens == 1:
        assert (ids[0] < E // 2).all() or (ids[0] >= E // 2).all(), "pick a seed whose token stays on one rank"
        assert any(bool((part == 0).all()) for part in parts)


def test_padded_form_with_expert_parallelism_reads_nothing_back_to_the_host() -> None:
    with as_rank(1, 2):
        layer = FusedMoE(E, TOP_K, H, I).to("meta")
    x = torch.empty(5, H, device="meta")
    weights, ids = torch.empty(5, TOP_K, device="meta"), torch.empty(5, TOP_K, dtype=torch.long, device="meta")
    assert methods.experts_padded(layer, x, weights, ids).shape == (5, H)


def test_tensor_parallel_is_still_the_default() -> None:
    with as_rank(1, 2, expert_parallel=False):
        layer = FusedMoE(E, TOP_K, H, I)
    assert layer.num_local_experts == E and tuple(layer.w13_weight.shape) == (E, I, H)   # 2 * I / 2 rows


def test_expert_count_the_ranks_do_not_divide() -> None:
    with as_rank(0, 4), pytest.raises(ValueError, match=r"6 experts do not split evenly over 4 ranks; "
                                                        r"tensor_parallel_size values that would: 1, 2, 3, 6"):
        FusedMoE(6, TOP_K, H, I)
