"""Request and response bodies of the OpenAI-compatible API, as msgspec Structs (see docs/api.md).

Requests ignore unknown fields and accept explicit nulls for every optional field, as real clients
send both. Responses use ``UNSET`` for fields that are omitted when they do not apply (``tool_calls``,
``reasoning_content``); fields the contract says are always present (``logprobs``, ``refusal``) have
no such default and are written as null.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType

# -- shared request pieces ------------------------------------------------------------------------


class StreamOptions(Struct, kw_only=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class TextPart(Struct, kw_only=True):
    """One item of a list-valued ``content``; only ``{"type": "text"}`` parts can be served."""
    type: str
    text: str | None = None


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessageParam(Struct, kw_only=True):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(Struct, kw_only=True):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: NamedFunction


class ResponseFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None      # {"name", "schema", "strict"}
    schema: dict[str, Any] | None = None           # llama.cpp's: {"type": "json_object", "schema": {...}}


class SamplingFields(Struct, kw_only=True):
    """Fields both generation endpoints share, vLLM's extras included."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logits_processors: list[str] | None = None   # names the server's plugins registered (register_samplers)
    # constrained output (server/structured.py): OpenAI's, vLLM's (new and old names) and llama.cpp's forms
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessageParam]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking: bool | dict[str, Any] | None = None
    enable_thinking: bool | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    # a string, a list of strings, a list of token ids, or a list of lists of token ids (checked by hand:
    # a msgspec union may hold only one list type)
    prompt: str | list[Any]
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's: each choice also carries its prompt's and its own token ids (always, on a server without a tokenizer)
    return_token_ids: bool | None = None


# -- shared response pieces -----------------------------------------------------------------------


class PromptTokensDetails(Struct, kw_only=True):
    cached_tokens: int = 0                # prompt tokens whose KV came from the prefix cache


class CompletionTokensDetails(Struct, kw_only=True):
    reasoning_tokens: int = 0             # tokens of the reasoning (<think>) text; 0 without a reasoning parser


class UsageInfo(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = msgspec.field(default_factory=CompletionTokensDetails)
    # candle-vllm's timings, whole milliseconds: arrival → first token (prefill, queueing included), and
    # first → last token (decode); its examples/benchmark.py derives prefill and decode throughput from them
    prompt_time_costs: int = 0
    completion_time_costs: int = 0


class TopLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct, kw_only=True):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class ToolCallFunction(Struct, kw_only=True):
    name: str | UnsetType = UNSET         # unset only in a streamed delta that continues a call's arguments
    arguments: str


class ToolCall(Struct, kw_only=True):
    index: int | UnsetType = UNSET        # in a streamed delta: which call of the choice this is
    id: str | UnsetType = UNSET           # set on a call's first delta (and always outside streaming)
    type: str | UnsetType = "function"
    function: ToolCallFunction


# -- chat responses -------------------------------------------------------------------------------


class ChatMessage(Struct, kw_only=True):
    role: str = "assistant"
    content: str | None
    refusal: None = None
    reasoning_content: str | UnsetType = UNSET
    reasoning: str | UnsetType = UNSET
    tool_calls: list[ToolCall] | UnsetType = UNSET


class ChatChoice(Struct, kw_only=True):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class ChatDelta(Struct, kw_only=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    reasoning: str | UnsetType = UNSET
    tool_calls: list[ToolCall] | UnsetType = UNSET


class ChatStreamChoice(Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | UnsetType = UNSET


# -- completions responses ------------------------------------------------------------------------


class CompletionLogprobs(Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    # return_token_ids (vLLM's fields): the prompt's ids (a stream's first chunk of the choice) and the generated
    # ids of this text (a stream's chunk: those of its piece)
    prompt_token_ids: list[int] | UnsetType = UNSET
    token_ids: list[int] | UnsetType = UNSET


class CompletionResponse(Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | UnsetType = UNSET
    system_fingerprint: str | None = None


# CompletionResponse doubles as the streaming chunk: OpenAI's chunk has the same shape.
CompletionChunk = CompletionResponse


# -- embeddings -----------------------------------------------------------------------------------


class EmbeddingRequest(Struct, kw_only=True):
    # a string, a list of strings, a list of token ids, or a list of lists of token ids (checked by hand, as
    # CompletionRequest's prompt)
    input: str | list[Any]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None   # None: float
    dimensions: int | None = None     # Matryoshka truncation (then renormalised)
    user: str | None = None


class EmbeddingData(Struct, kw_only=True):
    object: str = "embedding"
    index: int
    embedding: list[float] | str      # base64: the little-endian float32 bytes, as the openai SDK decodes them


class EmbeddingUsage(Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(Struct, kw_only=True):
    object: str = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


# -- models, tokenizer, errors --------------------------------------------------------------------


class ModelCard(Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "cvllm"
    root: str
    max_model_len: int


class ModelList(Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class TokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool | None = None


class TokenizeResponse(Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(Struct, kw_only=True):
    prompt: str


class TokenizerInfo(Struct, kw_only=True):
    tokenizer_class: str = "PreTrainedTokenizerFast"
    model_max_length: int
    vocab_size: int
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    chat_template: str | None


class ErrorInfo(Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(Struct, kw_only=True):
    error: ErrorInfo


_encoder = msgspec.json.Encoder()


def encode(value: Any) -> bytes:
    return _encoder.encode(value)
