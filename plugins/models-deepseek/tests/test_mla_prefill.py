"""MLA's decompressed prefill (mla_prefill.py): which sequences of a step take it, and that it gives the absorbed
form's numbers (prompts, a chunked prompt beside decodes, a cached prefix) on the tiny V3 checkpoint."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from cvllm import LLM
from cvllm_deepseek import mla_prefill

ENGINE = {"dtype": "float32", "block_size": 16, "max_num_seqs": 8, "enable_prefix_caching": True}
V3_DIMS = SimpleNamespace(kv_lora_rank=512, nope=128, rope=64, v_head_dim=128,
                          attn=SimpleNamespace(k_cache=torch.empty(0, dtype=torch.bfloat16)))


def fake_step(query_lens: list[int], seq_lens: list[int], capturing: bool = False) -> SimpleNamespace:
    return SimpleNamespace(is_decode_only=all(q == 1 for q in query_lens), query_lens_cpu=query_lens,
                           seq_lens_cpu=seq_lens, per_step={}, capturing=capturing)


def test_which_sequences_decompress(monkeypatch):
    """DeepSeek-V3's dimensions: a prompt and a chunk of more than ~170 tokens decompress; a decode, a short chunk
    over a long context, anything of an FP8 cache and a graph's capture (whose lengths are placeholders) stay
    absorbed."""
    monkeypatch.setattr(mla_prefill, "sub_context", lambda ctx, seqs: ("sub", seqs))
    monkeypatch.setattr(mla_prefill, "_SWITCH", None)   # the default: on where the cache is not on a GPU
    assert mla_prefill.split_step(fake_step([1, 1], [900, 40]), V3_DIMS) is None
    split = mla_prefill.split_step(fake_step([1, 40, 100, 300], [5000, 40, 10000, 10000]), V3_DIMS)
    assert split.decompress == [1, 3] and split.absorbed == ("sub", [0, 2])
    assert mla_prefill.split_step(fake_step([100], [10000]), V3_DIMS) is None
    fp8_cache = SimpleNamespace(k_cache=torch.empty(0, dtype=torch.float8_e4m3fn))
    fp8 = SimpleNamespace(**{**vars(V3_DIMS), "attn": fp8_cache})
    assert mla_prefill.split_step(fake_step([2000], [2000]), fp8) is None
    assert mla_prefill.split_step(fake_step([2000], [2000], capturing=True), V3_DIMS) is None


def test_decompressed_prefill_gives_the_absorbed_numbers(deepseek_checkpoint, monkeypatch):
    monkeypatch.setattr(mla_prefill, "_SWITCH", "1")   # on whatever the device
    path, _ = deepseek_checkpoint("deepseek_v3")
    generator = torch.Generator().manual_seed(5)
    batch = [torch.randint(3, 200, (n,), generator=generator).tolist() for n in (37, 5, 61)]
    batch.append(batch[2][:40] + [7, 8, 9])   # a prefix cached by the third prompt
    llm = LLM(str(path), max_num_batched_tokens=48, **ENGINE)   # the long prompts chunked beside decodes
    decompressed = llm.llm_engine.prompt_logits(batch)
    calls = []
    original = mla_prefill.decompressed_attention
    monkeypatch.setattr(mla_prefill, "decompressed_attention", lambda *a: calls.append(1) or original(*a))
    llm.llm_engine.prompt_logits(batch[:1])
    assert calls, "no prompt took the decompressed form"
    monkeypatch.setattr(mla_prefill, "split_step", lambda ctx, layer: None)   # everything absorbed
    absorbed = LLM(str(path), max_num_batched_tokens=48, **ENGINE).llm_engine.prompt_logits(batch)
    for got, want in zip(decompressed, absorbed, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
