"""The GPU form of Q4_K / Q5_K's scale search (kquants_cuda.fit_groups, one Triton kernel) gives kquants' torch
form's results exactly (the same float32 scales, mins and quants) and so llama.cpp's bytes. Without a GPU the kernel
runs in Triton's interpreter (conftest.py).

Equal as values, not always as bits: a group whose minimum is a zero gets the min of the zero C's loop keeps (the
first of tied +0/-0, negated), where torch's amin may keep the other; the sign of a zero min changes no byte."""

from pathlib import Path

import numpy as np
import pytest
import torch

from cvllm_gguf import kquants

GOLDEN = Path(__file__).parent / "data" / "kquant_golden.npz"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TYPES = {"Q4_K": (15, -1.0, 20), "Q5_K": (31, -0.5, 15)}


# the interpreter runs the kernel at ~5 ms a group: the golden cases that probe rounding there, all on a GPU
GOLDEN_CASES = None if DEVICE == "cuda" else ("special", "sqrt_sensitive", "refine_sensitive")


def cases() -> torch.Tensor:
    """Groups of 32: hand-made edge cases (flat, all positive, one outlier, zeros, tiny, a grid) and random ones."""
    gen = torch.Generator().manual_seed(0)
    edge = torch.stack([torch.full((32,), 0.5), torch.rand(32, generator=gen) + 1, torch.zeros(32),
                        torch.cat([torch.full((31,), 1e-3), torch.tensor([40.0])]),
                        torch.randn(32, generator=gen) * 1e-30, torch.arange(32.0) - 16])
    return torch.cat([edge, torch.randn(122, 32, generator=gen) * 3]).float().contiguous()


@pytest.mark.parametrize("chunk", [None, 50], ids=["one_launch", "chunks_of_50"])
@pytest.mark.parametrize("qtype", TYPES)
def test_kernel_equals_the_torch_scale_search(qtype, chunk, monkeypatch):
    """In one launch, and in launches of 50 groups (a tensor past CHUNK_GROUPS: the last chunk partial)."""
    from cvllm_gguf import kquants_cuda
    from cvllm_gguf.kquants_cuda import fit_groups
    if chunk:
        monkeypatch.setattr(kquants_cuda, "CHUNK_GROUPS", chunk)
    nmax, rmin, nstep = TYPES[qtype]
    groups = cases()
    rms = kquants._sqrt(kquants._divide(kquants._running_sum(groups * groups), 32.0))
    want = kquants._qkx2_quants(groups, rms[:, None] + groups.abs(), nmax, rmin, 0.1, nstep, False)
    got = fit_groups(groups.to(DEVICE), kquants._q45_numerators(nmax, rmin, nstep).to(DEVICE), nmax)
    for name, a, b in zip(("scale", "min", "quants"), got, want, strict=True):
        mismatched = int((a.cpu() != b.to(a.dtype)).sum())
        assert mismatched == 0, f"{qtype} {name}: {mismatched} of {a.numel()} differ"


@pytest.mark.parametrize("qtype", TYPES)
def test_blocks_through_the_kernel_equal_llama_cpp(qtype, monkeypatch):
    """The whole Q4_K / Q5_K encoder with the kernel's search (forced on CPU tensors here: the interpreter) writes
    llama.cpp's bytes for every golden case."""
    from cvllm_gguf.kquants_cuda import fit_groups

    def through_kernel(groups, nmax, rmin, nstep):
        fitted = fit_groups(groups.to(DEVICE).contiguous(), kquants._q45_numerators(nmax, rmin, nstep).to(DEVICE),
                            nmax)
        return tuple(t.to(groups.device) for t in fitted)   # the rest of the encoder runs where x is (the CPU)

    monkeypatch.setattr(kquants, "_fit_q45_groups", through_kernel)
    with np.load(GOLDEN) as data:
        for name in GOLDEN_CASES or data["case_names"]:
            x = torch.from_numpy(data[f"x/{name}"]).reshape(-1, 256)
            ours = kquants.quantize_k(x, qtype).cpu().numpy().reshape(data[f"{qtype}/{name}"].shape)
            mismatched = int((ours != data[f"{qtype}/{name}"]).sum())
            assert mismatched == 0, f"{qtype} {name}: {mismatched} bytes differ"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", TYPES)
def test_bytes_on_the_gpu_equal_the_cpu_bytes_for_a_large_weight(qtype):
    """A weight of Llama-3-8B's down projection's width: the kernel's many programs, against the CPU bytes."""
    x = torch.randn(64, 14336, generator=torch.Generator().manual_seed(1))
    cpu = kquants.quantize_k(x.reshape(-1, 256), qtype)
    gpu = kquants.quantize_k(x.cuda().reshape(-1, 256), qtype).cpu()
    assert torch.equal(gpu, cpu)
