"""Tensor parallelism on the CPU (gloo, 2 ranks): the same greedy tokens as one rank, a clear error for a size
that does not split the heads, and a dead worker that fails the engine instead of hanging it."""

from __future__ import annotations

import pytest
import torch

from cvllm import LLM, SamplingParams
from cvllm.testing.checkpoints import cvllm_greedy, make_checkpoint

PROMPTS = [[1, 5, 9, 23, 7, 11, 3, 4, 99, 100, 17, 2, 8], [4, 8, 15, 16, 23, 42]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def greedy(path, tensor_parallel_size: int, **options) -> list[list[int]]:
    return cvllm_greedy(path, PROMPTS, 8, tensor_parallel_size=tensor_parallel_size, num_kv_blocks=32, **options)


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}),                                                   # 4 heads, 2 KV heads: one KV head per rank
    ("llama", {"num_key_value_heads": 1}),                           # 1 KV head < 2 ranks: replicated
    ("llama", {"tie_word_embeddings": True}),
    ("qwen3", {}),
    ("qwen3_moe", {}),
], ids=["llama-gqa", "llama-kv1", "llama-tied", "qwen3", "qwen3-moe"])
def test_two_ranks_match_one(tmp_path, arch, overrides):
    make_checkpoint(tmp_path, arch, **overrides)
    assert greedy(tmp_path, 2) == greedy(tmp_path, 1)


def test_rank_zero_holds_its_shard_only(tmp_path):
    """The equality above is not world size 1 in disguise: rank 0's layers hold half of each split weight."""
    model = make_checkpoint(tmp_path)   # hidden 64, 4 heads of 16, 2 KV heads, intermediate 128, vocab 512
    llm = LLM(str(tmp_path), tensor_parallel_size=2, num_kv_blocks=32)
    try:
        ours = llm.llm_engine.runner.model
        layer = ours.model.layers[0]
        assert ours.model.embed_tokens.weight.shape[0] == model.config.vocab_size // 2
        assert layer.self_attn.qkv_proj.weight.shape[0] == (4 + 2 * 2) * 16 // 2
        assert layer.mlp.down_proj.weight.shape[1] == model.config.intermediate_size // 2
    finally:
        llm.shutdown()


def test_two_ranks_with_chunked_prefill(tmp_path):
    """Prompts split over several steps (budget 4 tokens), mixed with decodes."""
    make_checkpoint(tmp_path)
    assert greedy(tmp_path, 2, max_num_batched_tokens=4) == greedy(tmp_path, 1)


def test_two_ranks_with_async_steps_preemption_and_prompt_logprobs(tmp_path):
    """The step messages' other parts: decode rows whose input id is the in-flight step's sampled token (async
    scheduling: rank 0 sends those ids after the step), preemption (a KV pool too small for both prompts at once),
    and prompt-logprob rows appended to the logits rows."""
    make_checkpoint(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=2, logprobs=2)

    def run(size: int, **options):
        llm = LLM(str(tmp_path), tensor_parallel_size=size, dtype="float32", **options)
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
            return [(o.outputs[0].token_ids, o.prompt_logprobs, o.outputs[0].logprobs) for o in outputs], \
                llm.llm_engine.stats
        finally:
            llm.shutdown()

    want, _ = run(1, num_kv_blocks=32)
    got, stats = run(2, num_kv_blocks=3, block_size=16, async_scheduling=True)
    assert stats.overlapped_steps > 0 and stats.preemptions > 0
    for (tokens, prompt_lp, lp), (want_tokens, want_prompt_lp, want_lp) in zip(got, want):
        assert list(tokens) == list(want_tokens)
        for ours, theirs in zip(prompt_lp[1:] + lp, want_prompt_lp[1:] + want_lp):
            assert ours.keys() == theirs.keys()
            assert all(abs(ours[t].logprob - theirs[t].logprob) < 1e-4 for t in ours)


def test_two_ranks_embed_as_one(tmp_path):
    """Embeddings: the workers run the hidden-states pass too (no LM head); chunked prompts and a batch of inputs
    give the vectors one rank gives, and generation still works afterwards."""
    make_checkpoint(tmp_path)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS + [list(range(3, 40))]]

    def run(size: int):
        llm = LLM(str(tmp_path), tensor_parallel_size=size, dtype="float32", num_kv_blocks=32,
                  max_num_batched_tokens=16)
        try:
            vectors = torch.tensor([o.outputs.embedding for o in llm.embed(prompts)])
            tokens = llm.generate(prompts[:1], GREEDY)[0].outputs[0].token_ids
            return vectors, list(tokens)
        finally:
            llm.shutdown()

    (want, want_tokens), (got, got_tokens) = run(1), run(2)
    assert torch.allclose(got, want, atol=1e-5) and got_tokens == want_tokens


def test_size_that_does_not_split_the_heads(tmp_path):
    make_checkpoint(tmp_path)   # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 .* sizes that would: 1, 2, 4"):
        LLM(str(tmp_path), tensor_parallel_size=3, num_kv_blocks=32)


def test_dead_worker_fails_the_engine(tmp_path):
    make_checkpoint(tmp_path)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, num_kv_blocks=32)
    worker = llm.llm_engine.executor.group.processes[0]
    worker.kill()
    worker.join()
    with pytest.raises(RuntimeError, match="tensor-parallel worker 1 .* died"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)
    llm.shutdown()


def test_shutdown_ends_the_workers(tmp_path):
    make_checkpoint(tmp_path)
    llm = LLM(str(tmp_path), tensor_parallel_size=2, num_kv_blocks=32)
    worker = llm.llm_engine.executor.group.processes[0]
    llm.shutdown()
    assert not worker.is_alive() and worker.exitcode == 0
    assert greedy(tmp_path, 1)   # world size 1 again in this process


def test_in_situ_quantized_weights_shard_too(tmp_path):
    """ISQ quantizes each rank's slice as it loads: Q8_0 blocks of 32 split evenly over 2 ranks here."""
    make_checkpoint(tmp_path)
    assert greedy(tmp_path, 2, isq="q8_0", dtype="float32") == greedy(tmp_path, 1, isq="q8_0", dtype="float32")
