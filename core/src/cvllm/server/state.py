"""What every endpoint shares: the tokenizer, the engine-core client, the served names, and the rules
that turn request fields into ``SamplingParams`` (validation, defaults, context length, queue limit)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from cvllm.sampling_defaults import sampling_defaults
from cvllm.sampling_params import SamplingParamError, SamplingParams
from cvllm.server.args import ServerArgs
from cvllm.server.errors import APIError, bad_request, from_msgspec
from cvllm.server.metrics import Metrics
from cvllm.server.protocol import SamplingFields
from cvllm.server.reasoning import ParserFactory, detect, reasoning_parser
from cvllm.server.tool_calls import detect as detect_tool_parser
from cvllm.server.tool_calls import tool_parser

logger = logging.getLogger(__name__)

R = TypeVar("R", bound=SamplingFields)

MAX_LOGPROBS = 20
SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)
# request fields copied onto SamplingParams when the request sets them
REQUEST_SAMPLING_KEYS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                         "repetition_penalty", "seed", "stop", "stop_token_ids", "min_tokens", "ignore_eos",
                         "skip_special_tokens", "include_stop_str_in_output", "logits_processors")


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template`` is a file path or the template text itself."""
    if value is None:
        return None
    if "{" not in value and os.path.isfile(value):
        return Path(value).read_text(encoding="utf-8")
    return value


@dataclass
class ServerState:
    args: ServerArgs
    tokenizer: Any                        # cvllm.tokenizer.Tokenizer
    model_path: str
    model_names: list[str]
    chat_template: str | None
    generation_config: dict[str, Any] = field(default_factory=dict)
    reasoning_parser: str | None = None
    tool_parser: str | None = None        # for requests with tools (tool_calls.py)
    client: Any = None                    # EngineCoreClient once the core is ready
    startup_error: str | None = None
    restarting: bool = False              # the engine core died and a new one is loading (supervisor.py)
    gave_up: str | None = None            # why the supervisor stopped restarting it (the server then exits 1)
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: Metrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.model_names[0], self._stats_snapshot)
        self.reasoning: ParserFactory | None = None
        if self.reasoning_parser is not None:
            self.reasoning = reasoning_parser(self.reasoning_parser)
        self.tools = tool_parser(self.tool_parser) if self.tool_parser is not None else None
        # the model's defaults (none with --generation-config vllm), then cvserve's flags; a request's fields win
        self.sampling_defaults = sampling_defaults(self.generation_config, self.args.generation_config,
                                                   self.args.default_sampling)

    @classmethod
    def open(cls, args: ServerArgs) -> ServerState:
        """Read the checkpoint's config and tokenizer (no weights) for the API process."""
        from cvllm import plugins

        checkpoint = plugins.open_checkpoint(args.engine.model)
        tokenizer = checkpoint.tokenizer
        if tokenizer is None:
            logger.warning("%s has no tokenizer: serving token ids only (/v1/completions with prompts of token ids, "
                           "replies with the generated ids; text prompts, chat and stop strings are refused)",
                           args.engine.model)
        template = load_chat_template(args.chat_template) or (tokenizer.chat_template if tokenizer else None)
        names = list(args.served_model_names) or [Path(str(args.engine.model).rstrip("/")).name]
        parser = args.reasoning_parser
        if parser is None and tokenizer is not None:
            parser = detect(template, lambda: tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], add_generation_prompt=True, chat_template=template))
        tool_template = None if args.chat_template or tokenizer is None else tokenizer.named_templates.get("tool_use")
        tools = args.tool_call_parser or detect_tool_parser(tool_template or template)
        return cls(args, tokenizer, str(args.engine.model), names, template, dict(checkpoint.generation_config),
                   parser, tools)

    # -- readiness ---------------------------------------------------------------------------------

    def _stats_snapshot(self):
        if self.client is None:
            return None
        return self.client.stats, self.client.num_in_flight

    @property
    def ready(self) -> bool:
        return self.client is not None and self.client.dead is None

    def engine(self):
        if self.client is None:
            raise APIError(503, self.startup_error or "The model is still loading; try again shortly.")
        if self.restarting:
            raise APIError(503, "The engine core is restarting after a failure; try again shortly.")
        if self.client.dead is not None:
            raise APIError(503, f"The engine is not running: {self.client.dead}")
        return self.client

    @property
    def max_model_len(self) -> int:
        return self.engine().info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine().info.vocab_size

    def require_tokenizer(self, what: str, param: str | None = None) -> None:
        """A 400 for what needs text while the model is served without a tokenizer (its checkpoint has none)."""
        if self.tokenizer is None:
            raise APIError(400, f"{what} needs a tokenizer, and this model is served without one (its checkpoint "
                           f"has none): send prompts as token ids to /v1/completions", param=param)

    def parse_request(self, body: bytes, request_type: type[R]) -> tuple[R, str]:
        """Decode and check what both generation endpoints share: (request, served model name).
        Malformed bodies are 400s, an unknown model a 404, a server without an engine a 503."""
        try:
            request = msgspec.json.decode(body, type=request_type)
        except msgspec.DecodeError as e:
            raise from_msgspec(e) from None
        model = self.check_model(request.model)
        self.engine()
        validate_sampling_fields(request)
        return request, model

    def check_model(self, name: str | None, strict: bool | None = None) -> str:
        """The served name a request's ``model`` stands for. One model is served, so by default any name
        means it (candle-vllm and llama.cpp's rule: their clients send "" or "any"); the reply then names the
        model as served. Strict (``--strict-model-name``, vLLM's rule): an unknown name is a 404."""
        if name in self.model_names:
            return name
        if name is None or not (self.args.strict_model_name if strict is None else strict):
            return self.model_names[0]
        raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def check_capacity(self, new_requests: int) -> None:
        client = self.engine()
        limit = client.info.max_num_seqs + self.args.max_queue
        if client.num_in_flight + new_requests > limit:
            raise APIError(429, f"The server is at capacity ({limit} requests running or queued); retry later.",
                           headers={"Retry-After": "1"})

    # -- sampling ----------------------------------------------------------------------------------

    def max_tokens(self, requested: int | None, num_prompt_tokens: int, *, chat: bool) -> int:
        """The completion budget: the request's, else the server default, else the rest of the context
        (chat) or 16 (completions); a budget that does not fit the context is a 400."""
        limit = self.max_model_len
        room = limit - num_prompt_tokens
        if requested is None:
            requested = self.sampling_defaults.get("max_tokens")
            if requested is not None:
                requested = min(requested, room)
        if requested is None:
            requested = room if chat else min(16, room)
        if requested < 1 or num_prompt_tokens + requested > limit:
            wanted = max(requested, 1)
            # the prompt alone leaves no room: the prompt is what to shorten, not max_tokens
            param = ("messages" if chat else "prompt") if num_prompt_tokens >= limit else "max_tokens"
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + wanted} tokens ({num_prompt_tokens} in the messages, {wanted} in the "
                f"completion).", param=param)
        return requested

    def sampling_params(self, request: SamplingFields, *, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None, structured_outputs=None) -> SamplingParams:
        """``structured_outputs``: the request's output constraint (server/structured.py), already checked."""
        values = {k: v for k, v in self.sampling_defaults.items() if k in SAMPLING_FIELDS}
        values.update(request_sampling_values(request))
        if structured_outputs is not None:
            values["structured_outputs"] = structured_outputs
        if request.logit_bias:
            self.check_token_ids(list(values["logit_bias"]), "logit_bias")
        values["max_tokens"] = max_tokens
        values["logprobs"] = logprobs
        if prompt_logprobs is not None:
            values["prompt_logprobs"] = prompt_logprobs
        return build_sampling_params(values)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.vocab_size
        for token_id in ids:
            if not 0 <= token_id < vocab:
                raise bad_request(f"token id {token_id} is outside the vocabulary [0, {vocab})", param=param)


def validate_sampling_fields(request: SamplingFields) -> None:
    """The request's own sampling fields, checked before any prompt work by SamplingParams (the rules' one
    home, shared with the offline API); ``sampling_params`` checks them again joined with the server's defaults."""
    build_sampling_params({**request_sampling_values(request), "max_tokens": request.max_tokens})


def request_sampling_values(request: SamplingFields) -> dict[str, Any]:
    """The SamplingParams fields a request sets, its logit_bias keys read as token ids."""
    values = {key: getattr(request, key) for key in REQUEST_SAMPLING_KEYS if getattr(request, key) is not None}
    if request.logit_bias:
        values["logit_bias"] = {_token_id_key(key): bias for key, bias in request.logit_bias.items()}
    return values


def _token_id_key(key: str) -> int:
    try:
        return int(key)
    except ValueError:   # not a number, or one of more digits than int() reads (4300)
        raise bad_request(f"logit_bias keys must be token ids, got {key!r:.40}", param="logit_bias") from None


def build_sampling_params(values: dict[str, Any]) -> SamplingParams:
    """SamplingParams(**values), its SamplingParamError a 400 naming the field."""
    try:
        return SamplingParams(**values)
    except SamplingParamError as e:
        raise bad_request(str(e), param=e.param) from None
    except (TypeError, ValueError) as e:
        raise bad_request(str(e)) from None


def check_logprobs(name: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}", param=name)


def engine_error(error: Exception) -> APIError:
    """A failure reported by the engine core, as the HTTP error it means for this request."""
    from cvllm.engine_process.client import EngineDeadError

    if isinstance(error, EngineDeadError):
        return APIError(503, f"The engine is not running: {error}")
    if getattr(error, "invalid_request", False):
        return bad_request(str(error))
    return APIError(500, f"The engine failed this request: {error}")
