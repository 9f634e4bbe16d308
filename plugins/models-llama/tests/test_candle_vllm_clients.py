"""candle-vllm's example clients work unchanged against cvserve: the requests its examples/chat.py and
examples/benchmark.py send (their shapes, rewritten here, not their code), and the usage numbers the benchmark
reads back, on a tiny Llama served from cvserve's own flags."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import openai
import pytest

from cvllm.server.cli import build_server_args
from cvllm.testing import make_checkpoint
from cvllm.testing.server import LiveServer, free_port

SEEDS = ["Explain ownership, borrowing and lifetimes with a practical debugging story.",
         "Discuss KV cache scheduling, batching, prefill, decode and throughput tradeoffs.",
         "Review an API design: latency budgets, observability and failure modes.",
         "Compare quantization formats, memory bandwidth and attention kernels."]
OUTPUT_LEN = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("candle-clients") / "tiny-llama"
    make_checkpoint(path, "llama", seed=11)
    args = build_server_args(["--w", str(path), "--p", str(free_port()), "--backend", "cpu", "--dtype", "f32",
                              "--max-num-seqs", "8", "--num-kv-blocks", "128"])
    spec = dataclasses.asdict(args)
    with LiveServer(spec.pop("engine"), **spec) as live:
        yield live


def test_chat_py_turns(server):
    """examples/chat.py: `model=""`, always streamed, unset sampling fields sent as nulls (its extra_body
    included), the assistant's answer carried into the next turn; it reads chunk.choices[0] of every chunk."""
    client = openai.OpenAI(base_url=server.url + "/v1/", api_key="EMPTY", max_retries=0, timeout=60)
    extra_body = {"top_k": None, "min_p": None, "frequency_penalty": None, "presence_penalty": None,
                  "thinking": None, "repeat_last_n": None, "session_id": None}
    messages = [{"role": "system", "content": "You are terse."}]
    for question in ("Hello there", "And then?"):
        user = {"role": "user", "content": question}
        stream = client.chat.completions.create(model="", messages=[*messages, user], stream=True, max_tokens=12,
                                                temperature=None, top_p=None, extra_body=extra_body)
        answer, reasoning, names = "", "", set()
        for chunk in stream:
            choice = chunk.choices[0]   # chat.py indexes every chunk: no choice-less chunk without include_usage
            assert getattr(choice, "error", None) is None
            answer += choice.delta.content or ""
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            names.add(chunk.model)
        assert answer and names == {"tiny-llama"}   # the reply names the served model, not ""
        messages += [user, {"role": "assistant", "content": answer}]


async def benchmark_request(client: openai.AsyncOpenAI, request_id: int) -> dict:
    """One request as examples/benchmark.py sends it, and what it reads back: the timings from its own clock
    and the last chunk's usage (candle-vllm's timing fields included)."""
    prompt = f"You are benchmarking an LLM serving endpoint. Request id: {request_id}. {SEEDS[request_id]}"
    started = time.perf_counter()
    ttft, usage = None, None
    stream = await client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": prompt}], max_tokens=OUTPUT_LEN, temperature=0.0,
        top_p=None, presence_penalty=None, frequency_penalty=None, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, timeout=60)
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and (chunk.choices[0].delta.content or "") and ttft is None:
            ttft = time.perf_counter() - started
        assert chunk.model == "tiny-llama"
    latency = time.perf_counter() - started
    assert usage is not None, "no usage chunk although include_usage was asked"
    return {"latency_ms": latency * 1000, "ttft_ms": ttft * 1000, "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens, "total_tokens": usage.total_tokens,
            # read as the benchmark reads them: extra fields of the SDK's usage object, ints
            "prompt_time_ms": int(getattr(usage, "prompt_time_costs", 0) or 0),
            "completion_time_ms": int(getattr(usage, "completion_time_costs", 0) or 0),
            "cached_tokens": usage.prompt_tokens_details.cached_tokens,
            "reasoning_tokens": usage.completion_tokens_details.reasoning_tokens}


async def benchmark_case(url: str) -> list[dict]:
    async with openai.AsyncOpenAI(api_key="EMPTY", base_url=url + "/v1/", max_retries=0) as client:
        return await asyncio.gather(*(benchmark_request(client, i) for i in range(len(SEEDS))))


def test_benchmark_py_reads_sane_usage_and_timings(server):
    first = asyncio.run(benchmark_case(server.url))
    again = asyncio.run(benchmark_case(server.url))   # the same prompts: now their prefixes are cached
    for cold, warm in zip(first, again):
        for r in (cold, warm):
            assert r["completion_tokens"] == OUTPUT_LEN and r["prompt_tokens"] > 16
            assert r["total_tokens"] == r["prompt_tokens"] + r["completion_tokens"]
            assert r["reasoning_tokens"] == 0   # a model without a reasoning parser
            # the server's prefill and decode times fit inside what the client saw (prefill is reported as at least
            # 1 ms, which benchmark.py needs to divide by; decode can read 0 when a lagging stream got every token in
            # one wakeup)
            assert r["completion_time_ms"] >= 0
            assert r["prompt_time_ms"] <= r["ttft_ms"] + 1
            assert r["prompt_time_ms"] + r["completion_time_ms"] <= r["latency_ms"] + 2
        # whole 16-token blocks, never the last prompt token; the first round may already share the common
        # start (template, "You are benchmarking ..."), the second finds each whole prompt
        assert warm["cached_tokens"] % 16 == 0 and cold["cached_tokens"] < warm["cached_tokens"]
        assert warm["cached_tokens"] == (warm["prompt_tokens"] - 1) // 16 * 16


def test_cached_tokens_without_streaming(server):
    client = openai.OpenAI(base_url=server.url + "/v1/", api_key="EMPTY", max_retries=0, timeout=60)
    prompt = "Once upon a time, " * 12
    usages = [client.completions.create(model="any", prompt=prompt, max_tokens=4).usage for _ in range(2)]
    assert [u.prompt_tokens_details.cached_tokens for u in usages] == [0, (usages[0].prompt_tokens - 1) // 16 * 16]
    assert all(isinstance(u.prompt_time_costs, int) and isinstance(u.completion_time_costs, int) for u in usages)
