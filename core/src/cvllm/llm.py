"""The offline API, in vLLM's shape: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceABC
from typing import Any

import msgspec
from tqdm import tqdm

from cvllm.checkpoint.base import Checkpoint
from cvllm.engine.build import build_engine
from cvllm.engine.config import EngineConfig
from cvllm.engine_process.inprocess_client import InProcessClient
from cvllm.output_processor import OutputProcessor
from cvllm.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from cvllm.pooling import PoolingConfig
from cvllm.sampling_defaults import check_generation_config_mode, sampling_defaults
from cvllm.sampling_params import SamplingParams
from cvllm.server.reasoning import prompt_opens_reasoning
from cvllm.structured_output import reasoning_bounds

Prompt = str | dict[str, Any]


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
        check_generation_config_mode(generation_config)
        self.generation_config = generation_config
        self.llm_engine = build_engine(EngineConfig(
            model=model if isinstance(model, Checkpoint) else str(model), dtype=dtype, backend=backend,
            block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            prefill_chunk_size=prefill_chunk_size, num_kv_blocks=num_kv_blocks, kv_cache_memory=kv_cache_memory,
            enable_prefix_caching=enable_prefix_caching, seed=seed, **engine_options))
        # the engine in this process, behind a client that speaks the engine core's messages; the output
        # processor is the server's too, so both front-ends produce the same text from the same tokens
        self.engine_client = InProcessClient(self.llm_engine)
        self.output_processor = OutputProcessor(self.llm_engine.tokenizer)
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
        return SamplingParams(**sampling_defaults(self.llm_engine.checkpoint.generation_config,
                                                  self.generation_config))

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
        request_ids: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list):  # a bad prompt must not leave the others queued
                request_ids.append(self._add(prompt, params))
            self._run(sum(params.n for params in params_list), use_tqdm)
        finally:
            for request_id in request_ids:
                self.engine_client.abort(request_id)
            outputs = [self.output_processor.pop(request_id) for request_id in request_ids]
        return outputs

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """``tools``: function schemas the template renders (with the model's "tool_use" template where it has
        one); the calls in the output text are the caller's to parse (``cvllm.server.tool_calls``). On a thinking
        model (its template mentions ``<think>``), ``structured_outputs`` apply to the answer after the thinking,
        as the server does it."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self._tokenizer()
        template = chat_template or tokenizer.template_for(tools) or ""
        thinks = "<think>" in template or "</think>" in template
        many = isinstance(sampling_params, list)
        params_list = sampling_params if many else [sampling_params] * len(conversations)
        prompts, chosen = [], []
        for conversation, params in zip(conversations, params_list, strict=True):
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                 chat_template=chat_template, tools=tools,
                                                 **(chat_template_kwargs or {}))
            # the template writes BOS itself, so no special tokens are added here
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
            structure = params.structured_outputs if params is not None else None
            if thinks and structure is not None and structure.reasoning_end is None:
                structure = reasoning_bounds(structure, text, prompt_opens_reasoning(text), tokenizer)
                params = msgspec.structs.replace(params, structured_outputs=structure)
            chosen.append(params)
        adjusted = thinks and any(p is not None and p.structured_outputs is not None for p in params_list)
        return self.generate(prompts, chosen if adjusted else sampling_params, use_tqdm=use_tqdm)

    # -- embeddings ----------------------------------------------------------------------------

    def embed(self, prompts: Prompt | list[Prompt], *, pooling: PoolingConfig | None = None,
              dimensions: int | None = None) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (vLLM's ``LLM.embed``: ``.outputs.embedding``), as ``/v1/embeddings`` computes it:
        the final hidden states pooled as ``pooling`` says, else as the checkpoint declares (sentence-transformers'
        modules.json), else last-token and L2-normalised; ``dimensions`` cuts them (Matryoshka) before normalising."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        ids = [self._prompt_ids(prompt)[1] for prompt in prompts]
        vectors = self.llm_engine.embed(ids, pooling, dimensions)
        return [EmbeddingRequestOutput(str(next(self._request_ids)), prompt_ids, EmbeddingOutput(vector.tolist()))
                for prompt_ids, vector in zip(ids, vectors)]

    def _tokenizer(self):
        tokenizer = self.llm_engine.tokenizer
        if tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer; pass {'prompt_token_ids': [...]} prompts")
        return tokenizer

    def _prompt_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt: a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}."""
        if isinstance(prompt, str):
            return prompt, self._tokenizer().encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self._tokenizer().encode(prompt["prompt"])
        raise TypeError("a prompt is a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}")

    def _add(self, prompt: Prompt, params: SamplingParams) -> str:
        text, ids = self._prompt_ids(prompt)
        request_id = str(next(self._request_ids))
        self.engine_client.add_request(request_id, ids, params)
        self.output_processor.add_request(request_id, text, ids, params)
        return request_id

    def _run(self, num_completions: int, use_tqdm: bool) -> None:
        client, processor = self.engine_client, self.output_processor
        with tqdm(total=num_completions, desc="Generating", unit=" seqs", disable=not use_tqdm) as bar:
            while client.has_unfinished():
                step = processor.process(client.step().deltas)
                for request_id, indices in step.stopped.items():   # stop strings: the engine can stop them now
                    client.abort(request_id, indices)
                if step.num_finished:
                    bar.update(step.num_finished)

