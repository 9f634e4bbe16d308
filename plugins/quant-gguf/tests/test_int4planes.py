"""GGUF tables (token embedding, LM head) in int4 planes for the CPU's int4-packed matmul (int4planes.py,
table_method.py): the logits and the looked-up rows against the blocks dequantized (the gguf package's oracle values,
cvllm_gguf.dequant) and multiplied in float32, within what bf16 allows; and the engine keeps no float copy."""

from __future__ import annotations

import pytest
import torch

from cvllm import LLM, SamplingParams
from cvllm_gguf.dequant import dequantize
from cvllm_gguf.int4planes import PLANE_TYPES, WIDE_TYPES, int4_planes, planes_linear, planes_rows, rows_readable
from cvllm_gguf.quant_types import FORMATS, GGMLType
from cvllm_gguf.testing import HIDDEN, VOCAB, write_tiny_llama

SCALE_FIELDS = {GGMLType.Q4_1: 2, GGMLType.Q5_1: 2, GGMLType.Q4_K: 2, GGMLType.Q5_K: 2}   # f16 d (and m / dmin)


def random_blocks(qtype: GGMLType, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random blocks with small positive f16 scales: every integer pattern a file can hold."""
    fmt = FORMATS[qtype]
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows * cols // fmt.block_size, fmt.type_size), generator=gen, dtype=torch.uint8)
    for field in range(SCALE_FIELDS.get(qtype, 1)):
        scale = (torch.rand(blocks.shape[0], generator=gen) * 0.01 + 0.001).half()
        blocks[:, 2 * field:2 * field + 2] = scale.view(torch.uint8).view(-1, 2)
    return blocks.view(rows, -1)


@pytest.mark.parametrize("qtype", PLANE_TYPES, ids=lambda t: t.name)
def test_planes_compute_the_dequantized_weight(qtype):
    rows, cols = 256, 512
    raw = random_blocks(qtype, rows, cols)
    weight = dequantize(raw, qtype, (rows, cols))
    planes = int4_planes(raw, qtype, cols)
    assert planes.planes == (2 if qtype in WIDE_TYPES else 1)
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(1)).bfloat16()
    exact = x.float() @ weight.t()
    as_bf16_copy = (x @ weight.bfloat16().t()).float()   # what the float copy it replaces computes
    logits = planes_linear(x, planes).float()
    if planes.scales_zeros.dtype == torch.float32:
        # core's C kernel: float32 scales and sums, float32 logits (int4planes.py): float32 summation's error only
        assert (logits - exact).abs().max() <= 1e-5 * (x.float().abs() @ weight.abs().t()).max()
        assert (logits - exact).abs().max() < (as_bf16_copy - exact).abs().max()
    else:
        # torch's op: a and b rounded to bf16 once per group of 32, and each plane's output in bf16
        assert (logits - exact).abs().max() <= 4 * (as_bf16_copy - exact).abs().max() + 1e-3
        assert (logits - exact).abs().max() / exact.abs().max() < 0.01
    assert rows_readable(planes)
    ids = torch.tensor([0, 63, 64, 255, 7, 7])
    looked_up = planes_rows(planes, ids, torch.float32)
    assert torch.allclose(looked_up, weight[ids], rtol=2 ** -7, atol=0.02 * weight.abs().max())


def test_q8_0_planes_hold_its_integers_exactly():
    """Q8_0's two planes are exact but for its scale's rounding to bf16: with bf16-representable scales, exact."""
    raw = random_blocks(GGMLType.Q8_0, 64, 64)
    blocks = raw.view(-1, 34)
    blocks[:, :2] = torch.full((blocks.shape[0],), 2 ** -7, dtype=torch.float16).view(torch.uint8).view(-1, 2)
    weight = dequantize(raw, GGMLType.Q8_0, (64, 64))
    planes = int4_planes(raw, GGMLType.Q8_0, 64)
    assert torch.equal(planes_rows(planes, torch.arange(64), torch.float32), weight)
    eye = torch.eye(64, dtype=torch.bfloat16)
    assert torch.equal(planes_linear(eye, planes).float(), weight.t().bfloat16().float())


def test_q8_0_planes_are_exact_with_float32_scales():
    """With core's C kernel (float32 scales) any f16 scale is kept: one-hot rows read each weight back exactly."""
    raw = random_blocks(GGMLType.Q8_0, 128, 96, seed=3)
    planes = int4_planes(raw, GGMLType.Q8_0, 96)
    if planes.scales_zeros.dtype != torch.float32:
        pytest.skip("torch's op runs here (no C kernel): its scales are bf16")
    weight = dequantize(raw, GGMLType.Q8_0, (128, 96))
    assert torch.equal(planes_linear(torch.eye(96, dtype=torch.bfloat16), planes), weight.t())


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_engine_tables_read_the_blocks(tmp_path, make_rows, tied, monkeypatch):
    """The tiny model (Q8_0 embedding, Q5_0 LM head when untied) on the bf16 path (CVLLM_GGUF_QUANTIZED_TABLES=1):
    the tables become int4 planes, no float table is kept, and the logits match the same model's exact float32 path
    within bf16's reach."""
    monkeypatch.setenv("CVLLM_GGUF_QUANTIZED_TABLES", "1")
    path, _, _ = write_tiny_llama(tmp_path, make_rows, tied=tied)
    fast = LLM(model=str(path), dtype="bfloat16", num_kv_blocks=32)
    model = fast.llm_engine.runner.model
    embedding, head = model.model.embed_tokens, model.lm_head
    assert embedding.gguf_compute == "int4planes" and embedding.weight.numel() == 0
    assert embedding.qweight.numel() == 0   # the lookups read the planes back
    if tied:
        assert head.tied_to[0] is embedding and not hasattr(head, "weight")
    else:
        assert head.gguf_compute == "int4planes" and head.int4_planes.planes == 2   # Q5_0
    assert not [name for name, t in model.named_parameters() if t.shape[:1] == (VOCAB,) and t.is_floating_point()]
    ids = torch.tensor([0, 5, VOCAB - 1])
    exact = LLM(model=str(path), dtype="float32", num_kv_blocks=32).llm_engine.runner.model
    with torch.no_grad():
        rows, reference_rows = embedding(ids).float(), exact.model.embed_tokens(ids)
        assert torch.allclose(rows, reference_rows, rtol=2 ** -7, atol=0.01 * reference_rows.abs().max())
        hidden = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(2))
        logits, reference = model.compute_logits(hidden.bfloat16()).float(), exact.compute_logits(hidden)
    assert logits.shape == reference.shape == (4, VOCAB)
    assert (logits - reference).abs().max() / reference.abs().max() < 0.02
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(fast.generate([{"prompt_token_ids": [5, 17, 33, 2]}], params)[0].outputs[0].token_ids) == 4


def test_float32_engine_keeps_the_exact_table(tmp_path, make_rows, monkeypatch):
    monkeypatch.setenv("CVLLM_GGUF_QUANTIZED_TABLES", "1")
    path, _, _ = write_tiny_llama(tmp_path, make_rows, tied=True)
    model = LLM(model=str(path), dtype="float32", num_kv_blocks=32).llm_engine.runner.model
    assert model.model.embed_tokens.quant_method is None
    assert model.model.embed_tokens.weight.dtype == torch.float32


def test_tables_are_quantized_by_default_and_can_be_float(tmp_path, make_rows, monkeypatch):
    """On by default (float32 scales and sums in core's C kernel keep the logits nearer the exact ones than a bf16
    copy); CVLLM_GGUF_QUANTIZED_TABLES=0 gives the dequantized bf16 copy."""
    monkeypatch.delenv("CVLLM_GGUF_QUANTIZED_TABLES", raising=False)
    path, _, _ = write_tiny_llama(tmp_path, make_rows, tied=True)
    model = LLM(model=str(path), dtype="bfloat16", num_kv_blocks=32).llm_engine.runner.model
    assert model.model.embed_tokens.gguf_compute == "int4planes"
    monkeypatch.setenv("CVLLM_GGUF_QUANTIZED_TABLES", "0")
    model = LLM(model=str(path), dtype="bfloat16", num_kv_blocks=32).llm_engine.runner.model
    assert model.model.embed_tokens.quant_method is None
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
