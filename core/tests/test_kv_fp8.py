"""The FP8 KV cache (layers/kv_fp8.py) on the CPU backend: e4m3 caches at half the bytes of 16-bit ones, scales set
by each layer's first prefill by the documented rule and never by a decode, attention equal to the reference over
the dequantized caches, the same tokens over two tensor-parallel ranks, and the command-line spellings."""

from __future__ import annotations

import pytest
import torch

from cvllm import LLM, SamplingParams
from cvllm.backends.cpu import CpuBackend, paged_attention_reference
from cvllm.engine.config import EngineConfig
from cvllm.layers import kv_fp8
from cvllm.testing.checkpoints import cvllm_greedy, make_checkpoint

PROMPTS = [[1, 5, 9, 23, 7, 11, 3, 4, 99, 100, 17, 2, 8], [4, 8, 15, 16, 23, 42]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_checkpoint(path, "llama")
    return path


def attention_layers(llm):
    from cvllm.layers.attention import Attention

    return [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, Attention)]


def test_fp8_cache_holds_twice_the_tokens_and_sets_its_scales_once(tiny):
    llm = LLM(str(tiny), dtype="bfloat16", num_kv_blocks=32, kv_cache_dtype="fp8")
    half = LLM(str(tiny), dtype="bfloat16", num_kv_blocks=32)
    try:
        assert llm.llm_engine.runner.kv_bytes_per_block() * 2 == half.llm_engine.runner.kv_bytes_per_block()
        layers = attention_layers(llm)
        assert all(layer.k_cache.dtype == torch.float8_e4m3fn and layer.kv_scales_pending for layer in layers)
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=4))
        scales = [(layer.k_scale.tolist(), layer.v_scale.tolist()) for layer in layers]
        assert not any(layer.kv_scales_pending for layer in layers)
        assert all(layer.k_scale.shape == (2,) and (layer.k_scale != 1).all() for layer in layers)   # 2 KV heads
        llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(temperature=0, max_tokens=4))
        assert [(layer.k_scale.tolist(), layer.v_scale.tolist()) for layer in layers] == scales   # set once
    finally:
        llm.shutdown()
        half.shutdown()


def test_calibration_rule():
    class Layer:
        def kv_cache_shape(self):
            return (2, 2)   # 2 KV heads of 2 dims

    layer = Layer()
    kv_fp8.init_scales(layer, torch.device("cpu"))
    k = torch.tensor([[1.0, -8.96, 0.5, 0.25]])   # one token: head 0 (1, -8.96), head 1 (0.5, 0.25)
    kv_fp8.calibrate(layer, k, torch.zeros(1, 4))
    assert layer.k_scale.tolist() == pytest.approx([2 * 8.96 / 448, 2 * 0.5 / 448])
    assert layer.v_scale.tolist() == [1.0, 1.0]   # all zeros: 1
    stored = kv_fp8.quantize(torch.tensor([[100.0, -0.5], [0.0, 0.0]]), layer.k_scale)
    assert stored[0].float().tolist() == [448.0, -12.0]   # saturated, not NaN; -0.5 / 0.04 = -12.5 -> -12 (even)


def test_cpu_attention_reads_the_dequantized_cache():
    gen = torch.Generator().manual_seed(0)
    backend = CpuBackend()
    blocks, block_size, heads, kv_heads, dim = 4, 16, 4, 2, 32
    k_cache = torch.empty(blocks, block_size, kv_heads, dim, dtype=torch.float8_e4m3fn)
    v_cache = torch.empty_like(k_cache)
    k, v = torch.randn(40, kv_heads, dim, generator=gen), torch.randn(40, kv_heads, dim, generator=gen)
    scales = (torch.tensor([0.01, 0.03]), torch.tensor([0.02, 0.005]))
    slots = torch.arange(40)
    backend.write_kv(k, v, k_cache, v_cache, slots, scales=scales)
    k_deq = kv_fp8.quantize(k, scales[0]).float() * scales[0][:, None]
    assert torch.equal(k_cache.view(-1, kv_heads, dim)[:40].float() * scales[0][:, None], k_deq)
    q = torch.randn(1, 1, heads, dim, generator=gen)
    tables, pos, lens = torch.tensor([[0, 1, 2]]), torch.tensor([[39]]), torch.tensor([40])
    ours = paged_attention_reference(q, k_cache, v_cache, tables, pos, lens, 0.2, None, None, kv_scales=scales)
    deq = (k_cache.float() * scales[0][:, None], v_cache.float() * scales[1][:, None])
    assert torch.equal(ours, paged_attention_reference(q, *deq, tables, pos, lens, 0.2, None, None))


def test_two_ranks_match_one(tiny):
    options = dict(dtype="float32", num_kv_blocks=32, kv_cache_dtype="fp8")
    assert cvllm_greedy(tiny, PROMPTS, 8, tensor_parallel_size=2, **options) == cvllm_greedy(tiny, PROMPTS, 8,
                                                                                            **options)


def test_config_and_command_line():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model="x", kv_cache_dtype="int8")
    from cvllm.server.cli_flags import build_parser

    parser = build_parser()
    assert parser.parse_args(["--fp8-kvcache"]).kv_cache_dtype == "fp8"
    assert parser.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    assert parser.parse_args([]).kv_cache_dtype == "auto"


def test_checkpoint_kv_scales_are_used(tmp_path, caplog):
    """llm-compressor's kv_cache_scheme tensors (self_attn.k_scale / v_scale) set the scales: no calibration; with a
    16-bit cache they are read quietly and unused."""
    import logging

    from safetensors.torch import load_file, save_file

    make_checkpoint(tmp_path, "llama")
    state = load_file(tmp_path / "model.safetensors")
    layers = {name.split(".")[2] for name in state if name.startswith("model.layers.")}
    for i in layers:
        state[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.125)
        state[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([0.25])
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING):
        plain = LLM(str(tmp_path), dtype="float32", num_kv_blocks=32)
        plain.shutdown()
    assert "ignoring checkpoint tensor" not in caplog.text
    llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=32, kv_cache_dtype="fp8")
    try:
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=2))
        for layer in attention_layers(llm):
            assert layer.k_scale.tolist() == [0.125, 0.125] and layer.v_scale.tolist() == [0.25, 0.25]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("capturing", [False, True])
def test_a_graph_capture_sets_no_scales(tiny, capturing):
    """A graph's capture runs the forward on placeholder inputs (ForwardContext.capturing): the first prefill's
    scales must not come from it. And until a prefill set them, a lone chunk does not take the graphs."""
    from cvllm.engine.scheduler import ScheduledBatch
    from cvllm.forward_context import ForwardContext

    llm = LLM(str(tiny), dtype="bfloat16", num_kv_blocks=32, kv_cache_dtype="fp8")
    try:
        runner = llm.llm_engine.runner
        runner.graph_chunk_tokens = 64   # as if the backend had captured chunk graphs
        batch = ScheduledBatch([object()], [4], num_prefill_tokens=4, sample_indices=[0])
        ctx = ForwardContext(
            backend=runner.backend, query_start_loc=torch.tensor([0, 4], dtype=torch.int32),
            seq_lens=torch.tensor([4], dtype=torch.int32), slot_mapping=torch.arange(4),
            block_tables=torch.zeros(1, 1, dtype=torch.int32), query_start_loc_cpu=[0, 4], query_lens_cpu=[4],
            seq_lens_cpu=[4], max_query_len=4, max_seq_len=4, is_decode_only=False, block_size=runner.block_size,
            capturing=capturing)
        assert not runner.decode_path(batch, ctx)
        with torch.inference_mode():
            runner.decode_logits(torch.tensor([1, 5, 9, 23]), torch.arange(4), ctx)
        assert all(layer.kv_scales_pending == capturing for layer in attention_layers(llm))
        assert runner.decode_path(batch, ctx) is not capturing
    finally:
        llm.shutdown()
