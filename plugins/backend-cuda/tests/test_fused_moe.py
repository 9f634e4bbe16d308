"""The CUDA grouped-GEMM MoE (kernels/fused_moe.py) against a pair-by-pair float32 computation: decode-sized and
prefill-sized token counts (both block heights), experts with no pairs, pairs routed to another rank's experts
(expert parallelism: they add nothing), and the alignment's invariants. Triton's interpreter without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cvllm_cuda.kernels.fused_moe import align_pairs, fused_moe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def reference(hidden, w13, w2, weights, ids):
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < w13.shape[0]:
                inner = silu_and_mul(hidden[t].float() @ w13[e].float().T)
                out[t] += float(weights[t, j]) * (inner @ w2[e].float().T)
    return out


@pytest.mark.parametrize("tokens, experts, top_k, foreign", [
    (1, 8, 2, False),      # a decode step: blocks of 16 rows, one pair each
    (5, 16, 4, True),      # some pairs on another rank's experts
    (40, 8, 2, False),     # prefill-sized: blocks of 64 rows
])
def test_fused_moe_matches_the_pairwise_sum(tokens, experts, top_k, foreign):
    gen = torch.Generator().manual_seed(tokens)
    hidden_size, inter = 64, 32
    hidden = torch.randn(tokens, hidden_size, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden_size, generator=gen) * 0.1
    w2 = torch.randn(experts, hidden_size, inter, generator=gen) * 0.1
    ids = torch.stack([torch.randperm(experts + (4 if foreign else 0), generator=gen)[:top_k] for _ in range(tokens)])
    ids = ids.clamp(max=experts)                       # >= experts: another rank's (localize's marker)
    weights = torch.rand(tokens, top_k, generator=gen)
    move = lambda t: t.to(DEVICE)   # noqa: E731
    got = fused_moe(move(hidden), move(w13), move(w2), move(weights), move(ids), silu_and_mul)
    torch.testing.assert_close(got.cpu(), reference(hidden, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)


def test_align_pairs_pads_each_expert_to_whole_blocks():
    ids = torch.tensor([3, 0, 3, 5, 3, 0, 1])          # 5: another rank's (num_local 4)
    sorted_pairs, block_expert = align_pairs(ids, 4, 4)
    runs = sorted_pairs.view(-1, 4)
    by_expert = {int(e): [int(p) for p in row if p < len(ids)] for e, row in zip(block_expert, runs) if e < 4}
    assert by_expert == {0: [1, 5], 1: [6], 3: [0, 2, 4]}     # stable order inside a run; expert 2 has none
    assert (block_expert[len(by_expert):] == 4).all()         # the unused blocks find no expert
    assert sorted(int(p) for p in sorted_pairs if p < len(ids)) == [0, 1, 2, 4, 5, 6]   # pair 3 left out


def each_form(args: list) -> dict[str, torch.Tensor]:
    """fused_moe's three forms on the same small input: the expert GEMVs (moe_gemv.py, up to PAIR_GEMV_MAX pairs),
    the grouped GEMM with a block per pair (PAIR_BLOCKS_MAX) and with the pairs sorted by expert."""
    from cvllm_cuda.kernels import fused_moe as module

    results = {"gemv": fused_moe(*args, silu_and_mul)}
    saved = module.PAIR_GEMV_MAX, module.PAIR_BLOCKS_MAX
    try:
        module.PAIR_GEMV_MAX = 0
        results["block per pair"] = fused_moe(*args, silu_and_mul)
        module.PAIR_BLOCKS_MAX = 0
        results["sorted"] = fused_moe(*args, silu_and_mul)
    finally:
        module.PAIR_GEMV_MAX, module.PAIR_BLOCKS_MAX = saved
    return results


@pytest.mark.parametrize("hidden_size, inter", [(64, 32), (48, 7)])   # (48, 7): K steps and rows masked
def test_the_decode_forms_agree(hidden_size, inter):
    """Expert GEMVs, a block per pair and sorted blocks give the same sums, two pairs of one expert and a pair of
    another rank's expert included."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, hidden_size, generator=gen)
    w13 = torch.randn(4, 2 * inter, hidden_size, generator=gen) * 0.1
    w2 = torch.randn(4, hidden_size, inter, generator=gen) * 0.1
    ids = torch.tensor([[0, 2], [2, 3], [1, 4]])      # expert 2 twice; 4: another rank's
    weights = torch.rand(3, 2, generator=gen)
    forms = each_form([t.to(DEVICE) for t in (hidden, w13, w2, weights, ids)])
    want = reference(hidden, w13, w2, weights, ids)
    for name, got in forms.items():
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4, msg=name)


def rounded_reference(hidden, w13, w2, weights, ids):
    """The pairwise sum with the torch path's roundings in the activations' dtype: each matmul output, silu and
    its product with up, the expert's output times its routing weight; the k products summed in float32."""
    dtype, inter = hidden.dtype, w13.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = (hidden[t].float() @ w13[e].float().T).to(dtype).float()
            silu = F.silu(gate_up[:inter]).to(dtype).float()
            inner = (silu * gate_up[inter:]).to(dtype).float()
            down = (inner @ w2[e].float().T).to(dtype).float()
            out[t] += (down * weights[t, j].to(dtype).float()).to(dtype).float()
    return out.to(dtype)


# Triton's interpreter converts float32 to bfloat16 by truncation: bf16 only compiled
COMPILED = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=COMPILED)])
def test_the_gemv_form_rounds_as_the_torch_path(dtype):
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 256, generator=gen).to(dtype)
    w13 = (torch.randn(8, 192, 256, generator=gen) * 0.05).to(dtype)
    w2 = (torch.randn(8, 256, 96, generator=gen) * 0.05).to(dtype)
    ids = torch.tensor([[1, 5, 6], [5, 0, 7]])
    weights = torch.rand(2, 3, generator=gen)
    got = fused_moe(*[t.to(DEVICE) for t in (hidden, w13, w2, weights, ids)], silu_and_mul).cpu()
    want = rounded_reference(hidden, w13, w2, weights, ids)
    assert got.dtype == dtype
    # the float32 sums of the dot products in another order: a last-bit difference, rarely
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=ulp / 8)
