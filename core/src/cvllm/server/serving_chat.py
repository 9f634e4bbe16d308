"""``POST /v1/chat/completions``: messages → chat template → token ids → the core → JSON or SSE."""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

import msgspec
from msgspec import UNSET
from starlette.requests import Request
from starlette.responses import Response

from cvllm.chat_template import ChatTemplateError
from cvllm.engine_process.client import RequestError
from cvllm.sampling_params import MAX_INT32
from cvllm.server.errors import bad_request
from cvllm.server.lifecycle import SSEResponse, mid_stream_error, run_until_disconnect, start_request
from cvllm.server.output import (
    SSE_DONE,
    ChoiceState,
    ChoiceUpdate,
    RequestTracker,
    TextChunks,
    clamp_logprob,
    sse,
    token_text_and_bytes,
    top_entries,
    usage_info,
)
from cvllm.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatMessageParam,
    ChatStreamChoice,
    ChatTokenLogprob,
    Tool,
    ToolCall,
    ToolCallFunction,
    TopLogprob,
    UsageInfo,
    encode,
)
from cvllm.server.state import ServerState, check_logprobs, engine_error
from cvllm.server.structured import requested_structure
from cvllm.server.tool_calls import ForcedCallsParser
from cvllm.structured_output import reasoning_bounds

logger = logging.getLogger("cvllm.server")

# chat_template_kwargs may not override what the server passes itself
_RESERVED_TEMPLATE_KWARGS = {"messages", "add_generation_prompt", "continue_final_message", "tools", "chat_template"}


def message_dicts(messages: list[ChatMessageParam]) -> list[dict[str, Any]]:
    """Request messages as the dicts a chat template reads (text parts joined with newlines)."""
    if not messages:
        raise bad_request("messages must not be empty", param="messages")
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}].content[{j}] has type '{part.type}': only text content "
                                      f"parts are supported", param=f"messages[{i}].content[{j}].type")
                texts.append(part.text)
            content = "\n".join(texts)
        item: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                                "content": content if content is not None else ""}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        if message.reasoning_content is not None:
            item["reasoning_content"] = message.reasoning_content
        if message.tool_calls is not None:
            item["tool_calls"] = [_template_tool_call(call) for call in message.tool_calls]
        out.append(item)
    return out


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    # OpenAI sends arguments as a JSON string; templates expect the object (as vLLM gives them)
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            function = {**function, "arguments": json.loads(function["arguments"])}
        except json.JSONDecodeError:
            pass
        return {**call, "function": function}
    return call


def render_prompt(state: ServerState, messages: list[ChatMessageParam], *, add_generation_prompt: bool | None,
                  continue_final_message: bool | None, tools: list[Tool] | None,
                  chat_template_kwargs: dict[str, Any] | None) -> str:
    dicts = message_dicts(messages)
    continue_final = bool(continue_final_message)
    if add_generation_prompt is None:
        add_generation_prompt = not continue_final
    if continue_final and add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                          param="continue_final_message")
    if continue_final and dicts[-1]["role"] != "assistant":
        raise bad_request("continue_final_message needs the last message to be the assistant's",
                          param="continue_final_message")
    kwargs = {k: v for k, v in (chat_template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS}
    if state.chat_template is None:
        raise bad_request("This model has no chat template; use /v1/completions or start the server with "
                          "--chat-template")
    try:
        # the model's "tool_use" template for a request with tools, unless --chat-template replaced the model's
        template = state.chat_template
        if tools and not state.args.chat_template and "tool_use" in state.tokenizer.named_templates:
            template = state.tokenizer.named_templates["tool_use"]
        return state.tokenizer.apply_chat_template(
            dicts, add_generation_prompt=add_generation_prompt, chat_template=template,
            continue_final_message=continue_final,
            tools=msgspec.to_builtins(tools) if tools else None, **kwargs)
    except ChatTemplateError as e:
        raise bad_request(f"The chat template could not render these messages: {e}", param="messages") from None
    except Exception as e:   # sandboxed code run on the client's input: its failure is the request's problem
        logger.info("chat template failed: %r", e)
        raise bad_request(f"The chat template could not render these messages: {type(e).__name__}: {e}",
                          param="messages") from None


def _thinking_kwargs(request: ChatCompletionRequest) -> dict[str, Any] | None:
    """`thinking` / `enable_thinking` are shortcuts for chat_template_kwargs.enable_thinking."""
    kwargs = dict(request.chat_template_kwargs or {})
    flag = request.enable_thinking
    if isinstance(request.thinking, bool):
        flag = request.thinking
    elif isinstance(request.thinking, dict) and request.thinking.get("type") in ("enabled", "disabled"):
        flag = request.thinking["type"] == "enabled"
    if flag is not None:
        kwargs.setdefault("enable_thinking", flag)
    return kwargs or None


class _ChoiceText:
    """Turns one choice's updates into content, reasoning and logprob entries (stream and non-stream alike)."""

    def __init__(self, state: ChoiceState, parser, num_logprobs: int | None, tokenizer, tools=None,
                 max_calls: int | None = None):
        """``parser``: the reasoning parser; ``tools``: the tool-call parser (tool_calls.py), for requests with
        tools; ``max_calls``: 1 with ``parallel_tool_calls: false`` (later calls dropped)."""
        self.state, self.parser, self.num_logprobs, self.tokenizer = state, parser, num_logprobs, tokenizer
        self.tools, self.max_calls = tools, max_calls
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: list = []           # ParsedCall, in order
        self.new_calls: list = []            # streaming: parsed since the last chunk
        # streaming a named forced call: its argument text as it comes (ForcedCallsParser.fragments)
        self.fragments: list[ToolCall] | None = [] if getattr(tools, "name", None) else None
        self.logprobs: list[ChatTokenLogprob] = []
        self._streamed = False
        self.pending_logprobs: list[ChatTokenLogprob] = []   # streaming: waiting for a chunk with text

    def take(self, update: ChoiceUpdate) -> tuple[str, str]:
        reasoning, content = "", update.text
        if self.parser is not None:
            reasoning, content = self.parser.feed(update.text)
            if update.finish_reason is not None:
                more_reasoning, more_content = self.parser.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        if self.tools is not None:
            if self.fragments is not None:
                for call_id, name, arguments in self.tools.fragments(content, first=not self._streamed):
                    self._streamed = True
                    if call_id is None:   # a continuation: the index and more of the arguments
                        self.fragments.append(ToolCall(index=0, type=UNSET,
                                                       function=ToolCallFunction(arguments=arguments)))
                    else:
                        self.fragments.append(ToolCall(index=0, id=call_id,
                                                       function=ToolCallFunction(name=name, arguments=arguments)))
            content, calls = self.tools.feed(content)
            if update.finish_reason is not None:
                more_content, more_calls = self.tools.finish()
                content, calls = content + more_content, calls + more_calls
            if self.max_calls is not None:
                calls = calls[:max(0, self.max_calls - len(self.tool_calls))]
            self.tool_calls += calls
            self.new_calls += calls
        self.content.append(content)
        self.reasoning.append(reasoning)
        if self.num_logprobs is not None:
            entries = [self._logprob(token_id, logprobs) for token_id, logprobs in update.logprobs]
            self.logprobs.extend(entries)
            self.pending_logprobs.extend(entries)
        if self._streamed:   # (arguments cut short by max_tokens: already streamed as such, not again as content)
            content = ""
        return content, reasoning

    def _logprob(self, token_id: int, logprobs) -> ChatTokenLogprob:
        skip = self.state.params.skip_special_tokens
        text, raw = token_text_and_bytes(self.tokenizer, token_id, skip)
        top = []
        for top_id, value in top_entries(logprobs, self.num_logprobs):
            top_text, top_raw = token_text_and_bytes(self.tokenizer, top_id, False)
            top.append(TopLogprob(token=top_text, logprob=value, bytes=list(top_raw)))
        return ChatTokenLogprob(token=text, logprob=clamp_logprob(logprobs.logprob), bytes=list(raw),
                                top_logprobs=top)

    def take_pending_logprobs(self) -> ChatLogprobs | None:
        if self.num_logprobs is None:
            return None
        entries, self.pending_logprobs = self.pending_logprobs, []
        return ChatLogprobs(content=entries)

    def reasoning_tokens(self) -> int:
        """The reasoning text's length in tokens, re-encoded as candle-vllm counts it: the parser splits
        text, which does not map back onto the generated tokens one to one."""
        reasoning = "".join(self.reasoning)
        return len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0

    def message(self) -> ChatMessage:
        content, reasoning = "".join(self.content), "".join(self.reasoning)
        message = ChatMessage(content=content)
        if self.parser is not None and reasoning:
            message.reasoning_content = message.reasoning = reasoning
            message.content = content or None
        if self.tool_calls:
            message.tool_calls = [_tool_call(call) for call in self.tool_calls]
            message.content = content.strip() or None
        return message

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" for a choice that ended by itself with calls in it."""
        return "tool_calls" if reason == "stop" and self.tool_calls else reason

    def take_new_calls(self, first_index: int = 0) -> list[ToolCall]:
        """Streaming: the calls parsed since the last chunk, each with its index among the choice's calls (for a
        named forced call: the fragments of its arguments, the call already sent that way)."""
        if self.fragments is not None:
            fragments, self.fragments = self.fragments, []
            self.new_calls = []
            return fragments
        calls, self.new_calls = self.new_calls, []
        start = len(self.tool_calls) - len(calls)
        return [_tool_call(call, start + i) for i, call in enumerate(calls)]


def _tool_call(call, index: int | None = None) -> ToolCall:
    extra = {} if index is None else {"index": index}
    return ToolCall(id=call.id, function=ToolCallFunction(name=call.name, arguments=call.arguments), **extra)


class ChatService:
    def __init__(self, state: ServerState):
        self.state = state

    async def __call__(self, http_request: Request, body: bytes) -> Response:
        state = self.state
        request, model = state.parse_request(body, ChatCompletionRequest)
        state.require_tokenizer("Chat completion", param="messages")
        # max_tokens' range (SamplingParams checks that one), for the field only the chat API has
        if request.max_completion_tokens is not None and not 1 <= request.max_completion_tokens <= MAX_INT32:
            raise bad_request(f"max_completion_tokens must be in [1, 2**31 - 1], got {request.max_completion_tokens}",
                              param="max_completion_tokens")
        check_logprobs("top_logprobs", request.top_logprobs)
        structure = requested_structure(request)

        prompt = render_prompt(state, request.messages, add_generation_prompt=request.add_generation_prompt,
                               continue_final_message=request.continue_final_message, tools=request.tools,
                               chat_template_kwargs=_thinking_kwargs(request))
        prompt_ids = state.tokenizer.encode(prompt, add_special_tokens=False)  # the template wrote any BOS
        if not prompt_ids:
            raise bad_request("The messages render to an empty prompt", param="messages")
        requested = request.max_completion_tokens if request.max_completion_tokens is not None \
            else request.max_tokens
        max_tokens = state.max_tokens(requested, len(prompt_ids), chat=True)
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        if structure is not None and state.reasoning is not None:   # the grammar applies to the answer
            structure = reasoning_bounds(structure, prompt, state.reasoning(prompt).opened, state.tokenizer)
        params = state.sampling_params(request, max_tokens=max_tokens, logprobs=num_logprobs,
                                       structured_outputs=structure)
        state.check_token_ids(params.stop_token_ids, "stop_token_ids")

        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        tracker = start_request(state, request_id, prompt_ids, params)
        max_calls = 1 if request.parallel_tool_calls is False else None
        texts = [_ChoiceText(choice, state.reasoning(prompt) if state.reasoning else None, num_logprobs,
                             state.tokenizer, _tool_parser(state, request), max_calls)
                 for choice in tracker.choices]
        reply = _Reply(request_id, int(time.time()), model, tracker, texts)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return SSEResponse(reply.stream(include_usage), [tracker])
        return await run_until_disconnect(http_request, reply.complete(), tracker)


def _tool_parser(state: ServerState, request: ChatCompletionRequest):
    """The parser of this request's tool calls: the forced forms for tool_choice "required" or a named function
    (their grammar makes them parse), the model family's parser for "auto"; None without tools."""
    if not request.tools or request.tool_choice == "none":
        return None
    if request.tool_choice == "required":
        return ForcedCallsParser(None)
    if request.tool_choice is not None and request.tool_choice != "auto":
        return ForcedCallsParser(request.tool_choice.function.name)
    return state.tools() if state.tools is not None else None


class _Reply:
    def __init__(self, request_id: str, created: int, model: str, tracker: RequestTracker, texts: list[_ChoiceText]):
        self.id, self.created, self.model = request_id, created, model
        self.tracker, self.texts = tracker, texts
        self._content_chunk = TextChunks(lambda index, text: ChatCompletionChunk(
            id=request_id, created=created, model=model,
            choices=[ChatStreamChoice(index=index, delta=ChatDelta(content=text))]))

    def usage(self) -> UsageInfo:
        return usage_info([self.tracker], sum(text.reasoning_tokens() for text in self.texts))

    async def complete(self) -> Response:
        try:
            async for batch in self.tracker.updates():
                for choice, update in batch:
                    self.texts[choice.index].take(update)
        except RequestError as e:
            raise engine_error(e) from None
        choices = [ChatChoice(index=t.state.index, message=t.message(),
                              logprobs=ChatLogprobs(content=t.logprobs) if t.num_logprobs is not None else None,
                              finish_reason=t.finish_reason(t.state.finish_reason)) for t in self.texts]
        body = ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=self.usage())
        return Response(encode(body), media_type="application/json")

    def _chunk(self, choices: list[ChatStreamChoice], **usage: UsageInfo) -> bytes:
        return sse(encode(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                              **usage)))

    async def stream(self, include_usage: bool):
        try:
            for text in self.texts:
                yield self._chunk([ChatStreamChoice(index=text.state.index,
                                                    delta=ChatDelta(role="assistant", content=""))])
            async for batch in self.tracker.updates():
                out: list[bytes] = []   # one body write per batch (see serving_completions' stream)
                for choice, update in batch:
                    text = self.texts[choice.index]
                    content, reasoning = text.take(update)
                    calls = text.take_new_calls()   # each call whole: its id, name and arguments in one delta
                    if content and not reasoning and not calls and text.num_logprobs is None:   # the per-token chunk
                        out.append(self._content_chunk(choice.index, content))
                    elif content or reasoning or calls:
                        delta = ChatDelta()
                        if content:
                            delta.content = content
                        if reasoning:
                            delta.reasoning_content = delta.reasoning = reasoning
                        if calls:
                            delta.tool_calls = calls
                        out.append(self._chunk([ChatStreamChoice(index=choice.index, delta=delta,
                                                                 logprobs=text.take_pending_logprobs())]))
                    if update.finish_reason is not None:
                        leftover = text.take_pending_logprobs()
                        out.append(self._chunk([ChatStreamChoice(
                            index=choice.index, delta=ChatDelta(), finish_reason=text.finish_reason(
                                update.finish_reason),
                            logprobs=leftover if leftover is not None and leftover.content else None)]))
                if out:
                    yield b"".join(out)
            if include_usage:
                yield self._chunk([], usage=self.usage())
        except Exception as e:  # mid-stream: the status line is gone, so the error travels as an event
            yield sse(mid_stream_error(e, self.id).body())
        finally:
            self.tracker.close()
        yield SSE_DONE
