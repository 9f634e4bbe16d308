"""The offline API, in vLLM's shape: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceABC
from typing import Any

from tqdm import tqdm

from cvllm.checkpoint.base import Checkpoint
from cvllm.detokenizer import IncrementalDetokenizer
from cvllm.engine.config import EngineConfig
from cvllm.engine.llm_engine import LLMEngine
from cvllm.engine.sequence import Sequence
from cvllm.outputs import CompletionOutput, RequestOutput
from cvllm.sampling_params import SamplingParams

Prompt = str | dict[str, Any]
# vLLM's generation_config values: "auto" samples with the model's defaults where a request gives none,
# "vllm" with SamplingParams' own
GENERATION_CONFIG_MODES = ("auto", "vllm")


class LLM:
    def __init__(self, model: str | Checkpoint, *, dtype: str = "auto", block_size: int = 16,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None,
                 num_kv_blocks: int | None = None, enable_prefix_caching: bool = True, seed: int = 0,
                 backend: str | None = None, kv_cache_memory: int | None = None, prefill_chunk_size: int = 0,
                 generation_config: str = "auto", **engine_options):
        """``model``: a path or repo id (a Path too), or an opened Checkpoint (e.g. random weights built in
        memory). ``generation_config``: "auto" (the model's sampling defaults) or "vllm" (SamplingParams').
        ``engine_options``: any other ``EngineConfig`` field (kv_fraction, fake_step_ms ...)."""
        if generation_config not in GENERATION_CONFIG_MODES:
            raise ValueError(f"generation_config must be one of {', '.join(GENERATION_CONFIG_MODES)}, "
                             f"got {generation_config!r}")
        self.generation_config = generation_config
        self.llm_engine = LLMEngine(EngineConfig(
            model=model if isinstance(model, Checkpoint) else str(model), dtype=dtype, backend=backend,
            block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            prefill_chunk_size=prefill_chunk_size, num_kv_blocks=num_kv_blocks, kv_cache_memory=kv_cache_memory,
            enable_prefix_caching=enable_prefix_caching, seed=seed, **engine_options))
        self._request_ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    # -- giving the memory back ----------------------------------------------------------------

    def shutdown(self) -> None:
        """Free the weights, the KV cache and the CUDA graphs now (``del llm`` and a garbage collection do the
        same later). The LLM cannot generate afterwards."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def default_sampling_params(self) -> SamplingParams:
        """The model's sampling defaults (temperature, top_p, top_k ...): its generation_config.json, or a GGUF's
        general.sampling.* over llama.cpp's defaults; SamplingParams' own with ``generation_config="vllm"``."""
        if self.generation_config == "vllm":
            return SamplingParams()
        gen = self.llm_engine.checkpoint.generation_config
        keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        defaults = {k: gen[k] for k in keys if gen.get(k) is not None}
        if gen.get("do_sample") is False:
            defaults["temperature"] = 0.0
        return SamplingParams(**defaults)

    # -- generation ----------------------------------------------------------------------------

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        params_list = (list(sampling_params) if isinstance(sampling_params, SequenceABC)
                       else [sampling_params] * len(prompts))
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        requests: list[_Request] = []
        try:
            for prompt, params in zip(prompts, params_list):  # a bad prompt must not leave the others queued
                requests.append(self._add(prompt, params))
            self._run(requests, use_tqdm)
        finally:
            for request in requests:
                self.llm_engine.abort_request(request.request_id)
        return [request.result() for request in requests]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self._tokenizer()
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                 chat_template=chat_template, **(chat_template_kwargs or {}))
            # the template writes BOS itself, so no special tokens are added here
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _tokenizer(self):
        tokenizer = self.llm_engine.tokenizer
        if tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer; pass {'prompt_token_ids': [...]} prompts")
        return tokenizer

    def _add(self, prompt: Prompt, params: SamplingParams) -> _Request:
        if isinstance(prompt, str):
            text, ids = prompt, self._tokenizer().encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text, ids = prompt["prompt"], self._tokenizer().encode(prompt["prompt"])
        else:
            raise TypeError("a prompt is a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}")
        request_id = str(next(self._request_ids))
        seqs = self.llm_engine.add_request(request_id, ids, params)
        return _Request(request_id, text, ids, params, seqs, self.llm_engine)

    def _run(self, requests: list[_Request], use_tqdm: bool) -> None:
        by_seq = {seq.seq_id: request for request in requests for seq in request.seqs}
        engine = self.llm_engine
        with tqdm(total=len(by_seq), desc="Generating", unit=" seqs", disable=not use_tqdm) as bar:
            while engine.has_unfinished():
                for seq in engine.step():
                    request = by_seq.get(seq.seq_id)
                    if request is not None:
                        request.on_token(seq)
                    if seq.is_finished:
                        bar.update(1)


class _Request:
    """One prompt's bookkeeping in the offline loop: detokenizers for stop strings, then the output."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 seqs: list[Sequence], engine: LLMEngine):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.params, self.seqs, self.engine = params, seqs, engine
        tokenizer = engine.tokenizer
        self.detokenizers = None
        if params.stop and tokenizer is not None:
            self.detokenizers = {seq.seq_id: IncrementalDetokenizer(
                tokenizer, params.stop, params.skip_special_tokens, params.include_stop_str_in_output) for seq in seqs}

    def on_token(self, seq: Sequence) -> None:
        if self.detokenizers is None:
            return
        matched = self.detokenizers[seq.seq_id].update(seq.token_ids[-1])
        if matched is not None:
            self.engine.finish_sequence(seq, "stop", matched)

    def result(self) -> RequestOutput:
        tokenizer = self.engine.tokenizer
        outputs = []
        for seq in self.seqs:
            ids = seq.output_token_ids
            if self.detokenizers is not None:
                text = self.detokenizers[seq.seq_id].text
            elif tokenizer is not None:
                text = tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)
            else:
                text = ""
            cumulative = None
            if seq.logprobs is not None:
                cumulative = sum(entry[token].logprob for entry, token in zip(seq.logprobs, ids))
                if tokenizer is not None:
                    for entry in seq.logprobs:
                        for token_id, lp in entry.items():
                            lp.decoded_token = tokenizer.decode([token_id], skip_special_tokens=False)
            outputs.append(CompletionOutput(seq.index, text, ids, cumulative, seq.logprobs, seq.finish_reason,
                                            seq.stop_reason))
        prompt_logprobs = self.seqs[0].prompt_logprobs
        if prompt_logprobs is not None and tokenizer is not None:
            for entry in prompt_logprobs[1:]:
                for token_id, lp in entry.items():
                    lp.decoded_token = tokenizer.decode([token_id], skip_special_tokens=False)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs,
                             finished=all(seq.is_finished for seq in self.seqs), prompt_logprobs=prompt_logprobs)
