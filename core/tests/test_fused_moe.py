"""FusedMoE: routing and the grouped expert computation against a naive per-token loop, every checkpoint form
of the expert weights, tensor-parallel sharding, and the expert-usage counter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cvllm.checkpoint.base import CheckpointError
from cvllm.distributed import set_tensor_parallel
from cvllm.layers import FusedMoE, load_weights_with_experts, select_experts
from cvllm.layers import fused_moe_methods as fused_moe_module

E, TOP_K, H, I, T = 8, 2, 16, 12, 37

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def expert_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """HF's per-expert layout, stacked: gate/up [E, I, H], down [E, H, I]."""
    return {"gate": randn(E, I, H, seed=seed), "up": randn(E, I, H, seed=seed + 1),
            "down": randn(E, H, I, seed=seed + 2)}


def per_expert_tensors(w: dict[str, torch.Tensor], prefix: str = "mlp.experts") -> list[tuple[str, torch.Tensor]]:
    return [(f"{prefix}.{e}.{proj}_proj.weight", w[proj][e]) for e in range(E) for proj in ("gate", "up", "down")]


class Block(nn.Module):
    def __init__(self, renormalize: bool = False, **kwargs):
        super().__init__()
        self.experts = FusedMoE(E, TOP_K, H, I, renormalize=renormalize, **kwargs)


class Model(nn.Module):
    def __init__(self, renormalize: bool = False, **kwargs):
        super().__init__()
        self.mlp = Block(renormalize, **kwargs)


def loaded_model(tensors, renormalize: bool = False, **kwargs) -> tuple[Model, set[str]]:
    model = Model(renormalize, **kwargs)
    with torch.no_grad():
        loaded = load_weights_with_experts(model, tensors)
    return model, loaded


def naive_moe(x: torch.Tensor, logits: torch.Tensor, w: dict[str, torch.Tensor], renormalize: bool) -> torch.Tensor:
    """Token by token, expert by expert, straight from the definition."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t].double(), dim=-1)
        chosen = sorted(range(E), key=lambda e: -probs[e].item())[:TOP_K]
        weights = [probs[e].item() for e in chosen]
        if renormalize:
            weights = [p / sum(weights) for p in weights]
        for e, p in zip(chosen, weights):
            hidden = F.silu(w["gate"][e] @ x[t]) * (w["up"][e] @ x[t])
            out[t] += p * (w["down"][e] @ hidden)
    return out


def test_select_experts_by_hand() -> None:
    # softmax of log(p) is p / sum(p): both rows' probabilities are known exactly
    logits = torch.log(torch.tensor([[1.0, 6.0, 3.0, 0.5, 0.5], [0.5, 2.0, 1.0, 0.5, 4.0]]))
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [4, 1]]
    torch.testing.assert_close(weights, torch.tensor([[6 / 11, 3 / 11], [4 / 8, 2 / 8]]))
    assert weights.dtype == torch.float32
    weights, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, torch.tensor([[6 / 9, 3 / 9], [4 / 6, 2 / 6]]))
    # fp32 softmax even for half-precision logits
    assert select_experts(logits.bfloat16(), 2, renormalize=False)[0].dtype == torch.float32


@pytest.mark.parametrize("renormalize", [False, True])
def test_matches_naive_per_token_loop(renormalize: bool) -> None:
    w = expert_weights()
    model, loaded = loaded_model(per_expert_tensors(w), renormalize)
    assert loaded == {"mlp.experts.w13_weight", "mlp.experts.w2_weight"}
    x, logits = randn(T, H, seed=10), randn(T, E, seed=11) * 2
    with torch.inference_mode():
        got = model.mlp.experts(x, logits)
    torch.testing.assert_close(got, naive_moe(x, logits, w, renormalize), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 3, T])
def test_padded_form_matches_the_naive_loop(tokens: int) -> None:
    """The sync-free form (decode steps on CUDA, captured in graphs) computes what the grouped one does."""
    w = expert_weights()
    model, _ = loaded_model(per_expert_tensors(w), renormalize=True)
    layer = model.mlp.experts
    x, logits = randn(tokens, H, seed=20), randn(tokens, E, seed=21) * 2
    weights, ids = select_experts(logits, TOP_K, renormalize=True)
    with torch.inference_mode():
        padded = fused_moe_module.experts_padded(layer, x, weights, ids)
        grouped = fused_moe_module.experts_grouped(layer, x, weights, ids)
    torch.testing.assert_close(padded, naive_moe(x, logits, w, True), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded, grouped, rtol=1e-5, atol=1e-5)


def test_padded_form_reads_nothing_back_to_the_host() -> None:
    """On the meta device every value is unknown: a form that reads counts back (``.tolist()``, bincount's
    output size, a boolean mask) cannot run there. The padded form must; the grouped one cannot."""
    layer = FusedMoE(E, TOP_K, H, I).to("meta")
    x = torch.empty(5, H, device="meta")
    weights, ids = torch.empty(5, TOP_K, device="meta"), torch.empty(5, TOP_K, dtype=torch.long, device="meta")
    assert fused_moe_module.experts_padded(layer, x, weights, ids).shape == (5, H)
    with pytest.raises((RuntimeError, NotImplementedError)):
        fused_moe_module.experts_grouped(layer, x, weights, ids)


def test_decode_steps_on_a_sync_free_backend_take_the_padded_form(monkeypatch) -> None:
    from cvllm.backends.cpu import CpuBackend
    from cvllm.forward_context import ForwardContext, forward_context

    model, _ = loaded_model(per_expert_tensors(expert_weights()))
    taken = []
    for form in ("experts_padded", "experts_grouped"):
        real = getattr(fused_moe_module, form)
        monkeypatch.setattr(fused_moe_module, form, lambda *a, _real=real, _form=form: taken.append(_form) or _real(*a))

    def run(backend, decode_only: bool) -> None:
        ctx = ForwardContext(backend, *([None] * 4), [], [], [], 1, 1, decode_only)
        with forward_context(ctx), torch.inference_mode():
            model.mlp.experts(randn(4, H, seed=1), randn(4, E, seed=2))

    class SyncFree(CpuBackend):
        sync_free_decode = True

    run(CpuBackend(), decode_only=True)
    run(SyncFree(), decode_only=False)
    run(SyncFree(), decode_only=True)
    assert taken == ["experts_grouped", "experts_grouped", "experts_padded"]


def test_renormalisation_changes_the_output() -> None:
    # guards the parametrised test above: it compares two different computations
    w, x, logits = expert_weights(), randn(T, H, seed=10), randn(T, E, seed=11)
    assert (naive_moe(x, logits, w, True) - naive_moe(x, logits, w, False)).abs().max() > 0.1


def _stacked(w, suffix: str) -> list[tuple[str, torch.Tensor]]:
    return [(f"mlp.experts.{proj}_proj{suffix}", w[proj]) for proj in ("gate", "up", "down")]


def _fused(w) -> list[tuple[str, torch.Tensor]]:
    """transformers' in-memory form: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""
    return [("mlp.experts.gate_up_proj", torch.cat([w["gate"], w["up"]], dim=1)), ("mlp.experts.down_proj", w["down"])]


@pytest.mark.parametrize("form", ["stacked", "stacked.weight", "fused"])
def test_every_checkpoint_form_loads_the_same(form: str) -> None:
    w = expert_weights(seed=3)
    reference, _ = loaded_model(per_expert_tensors(w))
    tensors = _fused(w) if form == "fused" else _stacked(w, form.removeprefix("stacked"))
    model, loaded = loaded_model(tensors)
    assert loaded == {"mlp.experts.w13_weight", "mlp.experts.w2_weight"}
    for name in ("w13_weight", "w2_weight"):
        assert torch.equal(getattr(model.mlp.experts, name), getattr(reference.mlp.experts, name))
    # and the layout is what the docstring promises: gate rows, then up rows
    assert torch.equal(model.mlp.experts.w13_weight[5, :I], w["gate"][5])
    assert torch.equal(model.mlp.experts.w13_weight[5, I:], w["up"][5])


def test_partial_checkpoint_is_not_counted_as_loaded() -> None:
    tensors = [(n, t) for n, t in per_expert_tensors(expert_weights()) if n != "mlp.experts.6.up_proj.weight"]
    _, loaded = loaded_model(tensors)
    assert loaded == {"mlp.experts.w2_weight"}


@pytest.mark.parametrize(("name", "tensor", "message"), [
    ("mlp.experts.0.gate_proj.weight", torch.zeros(I + 1, H), "expected"),
    ("mlp.experts.gate_proj.weight", torch.zeros(E - 1, I, H), "experts stacked"),
    ("mlp.experts.9.down_proj.weight", torch.zeros(H, I), "out of range"),
    ("mlp.experts.down_proj.weight", torch.zeros(H, I), "3-D"),
])
def test_wrong_shapes_name_the_tensor(name: str, tensor: torch.Tensor, message: str) -> None:
    with pytest.raises(CheckpointError, match=f"'{name}'.*{message}"):
        loaded_model([(name, tensor)])


def test_tensor_parallel_shards_sum_to_the_whole() -> None:
    w, x, logits = expert_weights(seed=5), randn(T, H, seed=12), randn(T, E, seed=13)
    whole, _ = loaded_model(_fused(w))
    parts = []
    for rank in range(2):
        set_tensor_parallel(rank, 2)
        try:
            shard, loaded = loaded_model(per_expert_tensors(w), reduce_results=False)
        finally:
            set_tensor_parallel(0, 1)
        assert loaded == {"mlp.experts.w13_weight", "mlp.experts.w2_weight"}
        assert tuple(shard.mlp.experts.w13_weight.shape) == (E, I, H)  # half of 2 * I
        assert torch.equal(shard.mlp.experts.w13_weight[:, : I // 2], w["gate"][:, rank * I // 2:(rank + 1) * I // 2])
        with torch.inference_mode():
            parts.append(shard.mlp.experts(x, logits))
    with torch.inference_mode():
        torch.testing.assert_close(parts[0] + parts[1], whole.mlp.experts(x, logits), rtol=1e-5, atol=1e-5)


def test_expert_counts_record_the_routing() -> None:
    model, _ = loaded_model(per_expert_tensors(expert_weights()))
    layer = model.mlp.experts
    x, logits = randn(T, H, seed=14), randn(T, E, seed=15)
    with torch.inference_mode():
        layer(x, logits)               # not counted: counting is off by default
        layer.enable_expert_counts()
        layer(x, logits)
        layer(x[:5], logits[:5])
    want = torch.bincount(logits.topk(TOP_K).indices.flatten(), minlength=E)
    want += torch.bincount(logits[:5].topk(TOP_K).indices.flatten(), minlength=E)
    assert layer.expert_counts.tolist() == want.tolist()
    assert (want > 0).sum() >= 4


def test_non_expert_tensors_still_load_by_name() -> None:
    class WithRouter(Model):
        def __init__(self):
            super().__init__()
            self.mlp.gate = nn.Linear(H, E, bias=False)

    model, router = WithRouter(), randn(E, H, seed=20)
    with torch.no_grad():
        loaded = load_weights_with_experts(model, [("mlp.gate.weight", router), *per_expert_tensors(expert_weights())])
    assert loaded == {"mlp.gate.weight", "mlp.experts.w13_weight", "mlp.experts.w2_weight"}
    assert torch.equal(model.mlp.gate.weight, router)


def test_an_fp8_expert_weight_without_its_scale_is_refused_not_cast(tmp_path):
    """An FP8 expert weight is dequantized with its scale tensor; cast alone it would be wrong numbers."""
    from safetensors.torch import load_file, save_file

    from cvllm import LLM
    from cvllm.testing.checkpoints import make_checkpoint

    make_checkpoint(tmp_path, "qwen3_moe")
    state = load_file(tmp_path / "model.safetensors")
    name = next(n for n in state if ".experts.0.gate_proj.weight" in n)
    state[name] = state[name].to(torch.float8_e4m3fn)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="FP8 expert tensors without their pair.*no scale"):
        LLM(str(tmp_path), dtype="float32", num_kv_blocks=32)
