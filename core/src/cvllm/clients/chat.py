"""``cvllm chat``: talk to a running server from the terminal, with streamed, markdown-rendered replies.

The HTTP side (``stream_chat``) is a plain generator over one streamed chat completion, so it is
testable without a terminal; ``run_repl`` is the loop around it, reading lines from any callable.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, field

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.markdown import Markdown
from rich.text import Text

from cvllm.clients import DEFAULT_URL, api_url, auth_headers, error_message, sse_events

HELP = "/reset clears the conversation, /exit (or Ctrl-D) quits"


class ChatError(RuntimeError):
    """The server refused or failed the request; the message is the server's."""


@dataclass(slots=True)
class ChatDelta:
    """What one SSE chunk added to the (single) choice."""
    content: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    usage: dict | None = None


def stream_chat(client: httpx.Client, url: str, payload: dict, api_key: str | None = None) -> Iterator[ChatDelta]:
    """POST a streamed chat completion and yield its deltas; raises ChatError on an HTTP error
    before the stream starts, or on an ``{"error": ...}`` event in the middle of it."""
    body = {**payload, "stream": True}
    try:
        with client.stream("POST", f"{api_url(url)}/chat/completions", json=body,
                           headers=auth_headers(api_key)) as response:
            if response.status_code != 200:
                raise ChatError(error_message(response.status_code, response.read()))
            for event in sse_events(response.iter_lines()):
                if "error" in event:
                    raise ChatError(event["error"].get("message", str(event["error"])))
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    # Servers send reasoning as reasoning_content, newer vLLM also as reasoning: take one.
                    reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
                    yield ChatDelta(delta.get("content") or "", reasoning, choice.get("finish_reason"))
                if event.get("usage"):
                    yield ChatDelta(usage=event["usage"])
    except httpx.TransportError as exc:
        raise ChatError(f"cannot reach {api_url(url)} ({exc}); is cvserve running?") from None


@dataclass(slots=True)
class ChatOptions:
    url: str = DEFAULT_URL
    model: str | None = None
    system: str | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    thinking: bool | None = None      # None: the chat template's default
    api_key: str | None = None


@dataclass(slots=True)
class Reply:
    content: str = ""
    reasoning: str = ""
    finish_reason: str | None = None


@dataclass
class ChatSession:
    """The conversation so far and how to ask for the next turn."""
    options: ChatOptions
    client: httpx.Client
    history: list[dict] = field(default_factory=list)

    def reset(self) -> None:
        self.history.clear()

    def payload(self) -> dict:
        o = self.options
        system = [{"role": "system", "content": o.system}] if o.system else []
        body: dict = {"messages": system + self.history}
        extras = {"model": o.model, "temperature": o.temperature, "top_k": o.top_k, "top_p": o.top_p,
                  "max_tokens": o.max_tokens}
        body.update({key: value for key, value in extras.items() if value is not None})
        if o.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": o.thinking}
        return body

    def ask(self, text: str, on_update: Callable[[Reply], None] = lambda reply: None) -> Reply:
        """Send ``text`` and return the answer, calling ``on_update`` as it grows. A failed turn
        leaves no trace in the history; an interrupted one (Ctrl-C) keeps what was shown."""
        reply = Reply()
        self.history.append({"role": "user", "content": text})
        try:
            # closing(): on Ctrl-C the connection is dropped at once, so the server aborts the request.
            with closing(stream_chat(self.client, self.options.url, self.payload(), self.options.api_key)) as deltas:
                for delta in deltas:
                    reply.content += delta.content
                    reply.reasoning += delta.reasoning
                    reply.finish_reason = delta.finish_reason or reply.finish_reason
                    on_update(reply)
        except ChatError:
            self.history.pop()
            raise
        except KeyboardInterrupt:
            self._keep(reply)
            raise
        self._keep(reply)
        return reply

    def _keep(self, reply: Reply) -> None:
        if reply.content:
            # Only the answer goes back into the context: templates of thinking models drop earlier
            # turns' reasoning themselves, and sending it would spend context for nothing.
            self.history.append({"role": "assistant", "content": reply.content})
        else:
            self.history.pop()  # nothing came back: forget the question too


def _render(reply: Reply) -> Group:
    parts = []
    if reply.reasoning:
        parts.append(Text(reply.reasoning.strip(), style="dim italic"))
    if reply.content:
        parts.append(Markdown(reply.content))
    return Group(*parts)


def run_repl(session: ChatSession, console: Console, read_line: Callable[[str], str]) -> int:
    while True:
        try:
            text = read_line("> ").strip()
        except (EOFError, KeyboardInterrupt):
            console.print()
            return 0
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            session.reset()
            console.print("[dim]conversation cleared[/dim]")
            continue
        if text.startswith("/") and " " not in text:
            console.print(f"[dim]unknown command {text}: {HELP}[/dim]")
            continue
        try:
            with Live(Group(), console=console, refresh_per_second=15, vertical_overflow="visible") as live:
                reply = session.ask(text, lambda partial: live.update(_render(partial)))
            if not console.is_terminal:
                console.line()  # Live ends its last line itself only on a terminal
        except ChatError as exc:
            console.print(f"[red]error:[/red] {exc}")
        except KeyboardInterrupt:
            console.print("[dim]interrupted[/dim]")
        else:
            if reply.finish_reason == "length":
                console.print("[dim](cut off: max tokens reached)[/dim]")


def _first_model(client: httpx.Client, options: ChatOptions) -> str | None:
    """The server's first model, to show in the banner; None if /models does not say. ChatError if the
    server cannot be reached: better said at start than after the first question has been typed."""
    try:
        # a timeout of its own: the client's reads wait forever, for replies that take long to start
        response = client.get(f"{api_url(options.url)}/models", headers=auth_headers(options.api_key), timeout=10.0)
    except httpx.TransportError as exc:
        raise ChatError(f"cannot reach {api_url(options.url)}: {_reason(exc)}") from None
    except httpx.HTTPError:
        return None
    try:
        return response.json()["data"][0]["id"] if response.status_code == 200 else None
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def _reason(exc: BaseException) -> str:
    """Why a connection failed in the system's words ("connection refused"), found in the causes of
    httpx's error, whose own message is "[Errno 111] Connection refused"."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror[:1].lower() + cause.strerror[1:]
        cause = cause.__cause__ or cause.__context__
    return str(exc) or type(exc).__name__


def main(args: argparse.Namespace, client: httpx.Client | None = None, console: Console | None = None,
         read_line: Callable[[str], str] | None = None) -> int:
    options = ChatOptions(url=args.url, model=args.model, system=args.system, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, max_tokens=args.max_tokens, thinking=args.thinking,
                          api_key=args.api_key or os.environ.get("CVLLM_API_KEY"))
    console = console or Console()
    if read_line is None:
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
        read_line = console.input
    with client or httpx.Client(timeout=httpx.Timeout(10.0, read=None)) as http:
        try:
            served = _first_model(http, options)   # also when --model is given: it checks the server is there
        except ChatError as exc:
            print(f"cvllm chat: error: {exc}", file=sys.stderr)
            return 1
        model = options.model or served
        console.print(f"[bold]cvllm chat[/bold] with {model or 'the default model'} at {api_url(options.url)}"
                      f"\n[dim]{HELP}[/dim]")
        return run_repl(ChatSession(options, http), console, read_line)
