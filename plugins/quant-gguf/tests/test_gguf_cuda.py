"""GGUF layers on CUDA: their blocks are repacked into the CUDA backend's low-bit planes (cvllm_gguf/planes.py) and
multiplied there (cvllm_cuda/kernels/quant_matmul.py), never dequantized to a float copy. Without a GPU the
linear method's planes path runs in Triton's CPU interpreter (conftest.py sets TRITON_INTERPRET=1); with one, a
tiny GGUF model on CUDA gives the CPU's greedy tokens."""

from __future__ import annotations

import os

import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")  # a skip locally, an error under CI=true

from cvllm.layers.linear import ReplicatedLinear  # noqa: E402
from cvllm_cuda.kernels import quant_gemv_int8  # noqa: E402
from cvllm_cuda.kernels.int8_activations import dequantized_activations  # noqa: E402
from cvllm_gguf.linear_method import GGUFLinearMethod  # noqa: E402
from cvllm_gguf.planes import LAYOUTS, to_planes  # noqa: E402
from cvllm_gguf.quant_types import GGMLType  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                               reason="needs a CUDA device (and TRITON_INTERPRET unset)")


def test_every_isq_type_has_a_plane_layout():
    from cvllm_gguf.isq import ISQ_TYPES

    assert set(ISQ_TYPES) <= set(LAYOUTS)


@pytest.mark.parametrize("qtype", [GGMLType.Q5_0, GGMLType.Q4_K, GGMLType.Q6_K], ids=lambda t: t.name)
def test_planes_path_reshapes_and_adds_the_bias(qtype, make_rows, one_torch_thread):
    """The "planes" compute form (what a CUDA layer takes) on [..., K] activations with a bias, against the exact
    path, for every kernel path (1 row, a few, many)."""
    if not INTERPRET:
        pytest.skip("CPU tensors through Triton's interpreter; with a GPU the end-to-end gpu test covers this path")
    k, n = 256, 24
    rows = make_rows(qtype, n, k, seed=5)
    layers = {}
    for form in ("exact", "planes"):
        layer = ReplicatedLinear(k, n, bias=True, quant_method=GGUFLinearMethod(qtype, mode="exact"))
        layer.qweight.weight_loader(layer.qweight, rows)
        layer.bias.data.copy_(torch.linspace(-1, 1, n))
        if form == "planes":   # as process_weights_after_loading sets it up on a CUDA device
            layer.quant_weight = to_planes(layer.qweight.data, qtype, k).to(DEVICE)
            layer.weight = torch.empty(0)
            layer.gguf_compute = "planes"
        else:
            layer.quant_method.process_weights_after_loading(layer)
            assert layer.gguf_compute == "fp32"  # a CPU layer keeps the dequantized path
        layers[form] = layer.to(DEVICE)
    for shape in ((1, k), (2, 3, k), (4, 5, k)):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))).to(DEVICE)
        # up to MAX_ROWS rows of a layout without a high plane: llama.cpp's int8 activations (quant_gemv_int8), the
        # same rounding
        int8_rows = x.numel() // k <= quant_gemv_int8.MAX_ROWS and quant_gemv_int8.applies(LAYOUTS[qtype], k)
        got = layers["planes"](x)
        want = layers["exact"](dequantized_activations(x) if int8_rows else x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def _greedy(llm, prompts):
    from cvllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.mark.parametrize("qtype", [GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q4_K], ids=lambda t: t.name)
def test_tables_compute_and_look_up_from_planes(qtype, make_rows, one_torch_thread, monkeypatch):
    """A GGUF token embedding (tied to the LM head or not) and an untied LM head on CUDA keep their blocks as the GPU's
    planes (table_method.py; a Q4_K_M file's Q6_K head is 41% of a bf16 copy's bytes): no float table is kept, the
    logits are the exact table's (float activations; llama.cpp's int8 ones at a few rows) and the looked-up rows
    are the exact rows (quant_matmul.dequantize_rows rounds them once to the engine's dtype)."""
    if not INTERPRET:
        pytest.skip("CPU tensors through Triton's interpreter; with a GPU the end-to-end gpu test covers this path")
    from cvllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from cvllm_gguf import linear_method, table_method
    from cvllm_gguf.table_method import GGUFTableMethod, gpu_planes_possible

    vocab, hidden = 100, 256   # a vocabulary that no tile divides
    rows = make_rows(qtype, vocab, hidden, seed=3)
    tables = {}
    tied = ParallelLMHead(vocab, hidden)   # a head tied to the planes' embedding: it reads that table's planes
    for kind, form in (("head", "exact"), ("head", "planes"), ("embedding", "exact"), ("embedding", "planes")):
        table = (ParallelLMHead if kind == "head" else VocabParallelEmbedding)(vocab, hidden)
        if (kind, form) == ("embedding", "planes"):
            tied.tie_to(table)   # (as a model ties them when it is built, before the tables get their methods)
        table.set_table_method(GGUFTableMethod(qtype, mode="exact"))
        table.qweight.weight_loader(table.qweight, rows)
        # as on a CUDA device: the CPU tensors run through the interpreter
        usable = form == "planes"
        monkeypatch.setattr(table_method, "plane_kernels_usable", lambda device, usable=usable: usable)
        monkeypatch.setattr(linear_method, "plane_kernels_usable", lambda device, usable=usable: usable)
        table.quant_method.process_weights_after_loading(table)
        tables[kind, form] = table
    for kind in ("head", "embedding"):
        exact, planes = tables[kind, "exact"], tables[kind, "planes"]
        assert exact.gguf_compute == "dense"
        assert planes.gguf_compute == "planes" and planes.qweight.numel() == 0 and planes.weight.numel() == 0
    head = tables["head", "planes"]
    for env in ("0", "1"):
        monkeypatch.setenv(quant_gemv_int8.ENV, env)
        for t in (1, 3, 9):
            x = torch.randn(t, hidden, generator=torch.Generator().manual_seed(t))
            want = tables["head", "exact"].compute_logits(x)
            # int8 activations (Q8_0's, Q4_K's few rows): x rounded to 8 bits per 32, as llama.cpp's CUDA backend does
            rounded = env == "1" and t <= quant_gemv_int8.MAX_ROWS and quant_gemv_int8.applies(LAYOUTS[qtype], hidden)
            tolerance = (2e-2 if rounded else 1e-5) * want.abs().max().item()
            for got in (head.compute_logits(x), tied.compute_logits(x)):
                assert got.shape == (t, vocab)
                torch.testing.assert_close(got, want, rtol=0, atol=tolerance)
    ids = torch.tensor([[0, 99, 5], [5, 42, 17]])
    embedding = tables["embedding", "planes"]
    assert torch.equal(embedding(ids), tables["embedding", "exact"](ids))   # float32 (the engine's here): exact
    embedding.table_dtype = torch.bfloat16   # rows rounded once to the engine's dtype
    assert embedding(ids).dtype == torch.bfloat16 and embedding(ids).shape == (2, 3, hidden)
    # only where CUDA is; lookup tables unless CVLLM_GGUF_CUDA_LOOKUP_PLANES=0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv(table_method.LOOKUP_PLANES_ENV, raising=False)
    assert gpu_planes_possible(head, qtype) and gpu_planes_possible(embedding, qtype)
    monkeypatch.setenv(table_method.LOOKUP_PLANES_ENV, "0")
    assert gpu_planes_possible(head, qtype) and not gpu_planes_possible(embedding, qtype)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not gpu_planes_possible(head, qtype)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("types", [{}, {"q_proj": GGMLType.Q4_0, "k_proj": GGMLType.Q4_0, "v_proj": GGMLType.Q4_0,
                                        "o_proj": GGMLType.Q5_0, "lm_head": GGMLType.Q8_0,
                                        "down_proj": GGMLType.Q6_K},
                                   {"v_proj": GGMLType.Q8_0, "up_proj": GGMLType.Q4_0}],   # mixed fused parts
                         ids=["mix1", "mix2", "mixed-parts"])
@pytest.mark.parametrize("lookup_planes", ["0", "1"])
def test_tiny_model_on_cuda_computes_from_planes_and_gives_the_cpu_exact_tokens(tmp_path, make_rows, types,
                                                                                lookup_planes, monkeypatch):
    from cvllm import LLM
    monkeypatch.setenv("CVLLM_GGUF_CUDA_LOOKUP_PLANES", lookup_planes)   # the embedding's lookups from its planes
    # float activations: the CPU path's numbers (the default int8 ones are llama.cpp's, tested per kernel)
    monkeypatch.setenv(quant_gemv_int8.ENV, "0")
    from cvllm_gguf.testing import write_tiny_llama

    path, _, _ = write_tiny_llama(tmp_path, make_rows, types=types)
    prompts = [[5, 17, 33, 2], [90, 1, 44, 44, 3, 8, 61, 12, 70, 9, 11, 4, 85, 30, 31, 32, 33, 50], [7]]
    cpu = LLM(model=str(path), backend="cpu", dtype="float32", num_kv_blocks=32)
    cuda = LLM(model=str(path), backend="cuda", dtype="float32", num_kv_blocks=32, max_num_seqs=4)
    planes = 0
    for name, module in cuda.llm_engine.runner.model.named_modules():
        if not hasattr(module, "qweight"):
            continue
        parts = getattr(module, "gguf_parts", None)
        if parts is None and module.qtype not in LAYOUTS:
            continue
        assert module.gguf_compute == "planes" and module.weight.numel() == 0, name   # no float copy
        assert module.qweight.numel() == 0, name                                       # the planes replace the blocks
        assert (module.quant_0_low if parts else module.quant_low).is_cuda, name
        planes += 1
    assert planes >= 6
    model = cuda.llm_engine.runner.model
    assert model.lm_head.gguf_compute == "planes"                                   # an untied head: planes always
    embedding = model.model.embed_tokens
    assert (getattr(embedding, "gguf_compute", None) == "planes") == (lookup_planes == "1")
    assert _greedy(cuda, prompts) == _greedy(cpu, prompts)


@pytest.mark.gpu
@needs_gpu
def test_tiny_model_logprobs_equal_with_the_producers_int8_activations(tmp_path, make_rows, monkeypatch):
    """The tiny GGUF Llama in bf16 on CUDA (graphs on; its layers Q4_1, Q5_1, Q8_0, Q4_K: all on int8 activations):
    greedy tokens and their logprobs to the bit whether the norms and silu * up make the GEMVs' int8 activations or
    the quantizer kernel does (CVLLM_QUANT_PRODUCER_ACTIVATIONS 1 and 0; cvllm_cuda/kernels/int8_activations.py)."""
    from cvllm import LLM
    from cvllm.sampling_params import SamplingParams
    from cvllm_cuda.kernels import int8_activations
    from cvllm_gguf.testing import write_tiny_llama

    path, _, _ = write_tiny_llama(tmp_path, make_rows)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": [5, 17, 33, 2]}, {"prompt_token_ids": [90, 1, 44, 44, 3, 8]}]
    quantizer_calls, quantize = [], quant_gemv_int8.quantize_activations
    monkeypatch.setattr(quant_gemv_int8, "quantize_activations", lambda *a: quantizer_calls.append(1) or quantize(*a))
    results, calls = {}, {}
    for on in ("1", "0"):
        monkeypatch.setenv(int8_activations.PRODUCERS_ENV, on)
        quantizer_calls.clear()
        llm = LLM(model=str(path), backend="cuda", dtype="bfloat16", num_kv_blocks=32, max_num_seqs=4)
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        results[on] = [(list(o.token_ids), [[lp[t].logprob for t in lp] for lp in o.logprobs]) for o in outs]
        calls[on] = len(quantizer_calls)
        del llm
    assert results["1"] == results["0"]
    assert calls["1"] < calls["0"] / 2   # three of a layer's four GEMVs took the producers' activations


def test_mixed_parts_each_computed_from_their_planes(make_rows, one_torch_thread, monkeypatch):
    """A fused q/k/v of Q4_K, Q4_K and Q6_K parts (a Q4_K_M file's attention): one matmul per part into its
    columns, against the exact dequantized stack, for every kernel path (1 row, a few, many; float activations)."""
    monkeypatch.setenv(quant_gemv_int8.ENV, "0")
    if not INTERPRET:
        pytest.skip("CPU tensors through Triton's interpreter; with a GPU the end-to-end gpu test covers this path")
    from cvllm.layers.linear import QKVParallelLinear
    from cvllm_gguf.mixed import MixedGGUFLinearMethod

    types = [GGMLType.Q4_K, GGMLType.Q4_K, GGMLType.Q6_K]
    layers = []
    for form in ("exact", "planes"):
        layer = QKVParallelLinear(256, 32, 2, 1, bias=True,
                                  quant_method=MixedGGUFLinearMethod(types, mode="exact"))
        for shard, qtype, rows in zip("qkv", types, (64, 32, 32)):
            layer.qweight.weight_loader(layer.qweight, make_rows(qtype, rows, 256, seed=ord(shard)), shard)
        layer.bias.data.copy_(torch.linspace(-1, 1, 128))
        if form == "planes":   # as process_weights_after_loading sets it up on a CUDA device
            layer.quant_parts, start = [], 0
            for qtype, rows, blocks in layer.quant_method._part_bytes(layer):
                layer.quant_parts.append((start, to_planes(blocks, qtype, 256)))
                start += rows
            layer.gguf_compute = "planes"
        layers.append(layer)
    for shape in ((1, 256), (3, 256), (2, 10, 256)):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
        want = layers[0](x)   # float32 sums in another order: relative to the outputs' size
        torch.testing.assert_close(layers[1](x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
