"""A thin tokenizer over the ``tokenizers`` library with the chat template and special tokens."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

from cvllm.chat_template import render_chat
from cvllm.checkpoint.base import CheckpointError
from cvllm.config import load_json


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


@cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable character each byte is spelled with → the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    def __init__(self, tokenizer: _HFTokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None, chat_template: str | None = None,
                 named_templates: dict[str, str] | None = None):
        """``named_templates``: a model's other chat templates by name (Command-R's and Hermes-2-Pro's
        "tool_use", "rag"); ``chat_template`` is the default one."""
        self.tokenizer = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.chat_template = chat_template
        self.named_templates = dict(named_templates or {})
        self.bos_token_id = self.token_to_id(bos_token)
        self.eos_token_id = self.token_to_id(eos_token)
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(id_ for id_, tok in added.items() if tok.special)
        self._added_text = {id_: tok.content for id_, tok in added.items()}
        self._token_bytes: dict[int, bytes] = {}
        self._spelling: str | None = None   # "byte_level" | "sentencepiece" | "plain", found on first use

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        try:
            tok = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:
            raise CheckpointError(f"{path / 'tokenizer.json'}: cannot load tokenizer ({e})") from None
        cfg: dict[str, Any] = {}
        if (path / "tokenizer_config.json").exists():
            cfg = load_json(path / "tokenizer_config.json", "tokenizer_config.json")
        template, named = cfg.get("chat_template"), {}
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(tok, bos_token=_token_text(cfg.get("bos_token")), eos_token=_token_text(cfg.get("eos_token")),
                   pad_token=_token_text(cfg.get("pad_token")), chat_template=template,
                   named_templates={name: text for name, text in named.items() if name != "default" and text})

    def template_for(self, tools: list | None) -> str | None:
        """The chat template a chat uses: the model's "tool_use" one when tools are given and it has one (as
        transformers picks it), else the default."""
        if tools and "tool_use" in self.named_templates:
            return self.named_templates["tool_use"]
        return self.chat_template

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a byte-level BPE token or a SentencePiece ``<0xNN>`` token
        may be part of a UTF-8 character), so that the bytes of consecutive tokens concatenate to the text."""
        cached = self._token_bytes.get(token_id)
        if cached is not None:
            return cached
        if token_id in self._added_text:
            raw = self._added_text[token_id].encode("utf-8")
        else:
            token = self.tokenizer.id_to_token(token_id)
            raw = b"" if token is None else self._spelled_bytes(token)
        self._token_bytes[token_id] = raw
        return raw

    def _spelled_bytes(self, token: str) -> bytes:
        if self._spelling is None:
            self._spelling = _vocabulary_spelling(self.tokenizer)
        if self._spelling == "byte_level":
            table = _byte_level_decoder()
            if all(c in table for c in token):
                return bytes(table[c] for c in token)
        elif self._spelling == "sentencepiece":
            byte = _BYTE_TOKEN.fullmatch(token)
            if byte:
                return bytes([int(byte.group(1), 16)])
            return token.replace("\u2581", " ").encode("utf-8")
        return token.encode("utf-8")

    def decode_stream(self, skip_special_tokens: bool = True) -> DecodeStream:
        return DecodeStream(skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], /, add_generation_prompt: bool = True,
                            chat_template: str | None = None, *, continue_final_message: bool | str = False,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """The prompt text for a chat, as transformers' ``apply_chat_template(tokenize=False)`` renders it.

        ``kwargs`` become template variables (``enable_thinking``, ``documents``...). Raises ChatTemplateError
        (a ValueError) when the template or the input is at fault.
        """
        template = chat_template or self.template_for(tools)
        if template is None:
            raise ValueError("this model's tokenizer has no chat template; pass chat_template= or use generate()")
        # Unset tokens stay undefined in the template, as in transformers' special_tokens_map.
        specials = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token}
        return render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, special_tokens=specials, tools=tools,
                           **kwargs)


def _vocabulary_spelling(tokenizer: _HFTokenizer) -> str:
    """How vocabulary strings spell bytes: GPT-2 byte-level, SentencePiece (▁ and <0xNN>), or plain text."""
    spec = json.loads(tokenizer.to_str())

    def mentions_byte_level(part: Any) -> bool:
        if not isinstance(part, dict):
            return False
        if part.get("type") == "ByteLevel":
            return True
        children = part.get("decoders") or part.get("pretokenizers") or []
        return any(mentions_byte_level(child) for child in children)

    if mentions_byte_level(spec.get("decoder")) or mentions_byte_level(spec.get("pre_tokenizer")):
        return "byte_level"
    model = spec.get("model") or {}
    if model.get("byte_fallback") or _mentions_metaspace(spec.get("decoder")):
        return "sentencepiece"
    return "plain"


def _mentions_metaspace(decoder: Any) -> bool:
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "Metaspace":
        return True
    if decoder.get("type") == "Replace" and "\u2581" in json.dumps(decoder, ensure_ascii=False):
        return True
    return any(_mentions_metaspace(child) for child in decoder.get("decoders") or [])
