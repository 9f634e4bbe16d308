"""A thin tokenizer over the ``tokenizers`` library with the chat template and special tokens."""

from __future__ import annotations

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


class Tokenizer:
    def __init__(self, tokenizer: _HFTokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.chat_template = chat_template
        self.bos_token_id = self.token_to_id(bos_token)
        self.eos_token_id = self.token_to_id(eos_token)
        self.special_ids = frozenset(
            id_ for id_, tok in tokenizer.get_added_tokens_decoder().items() if tok.special)

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
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(tok, bos_token=_token_text(cfg.get("bos_token")), eos_token=_token_text(cfg.get("eos_token")),
                   pad_token=_token_text(cfg.get("pad_token")), chat_template=template)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> DecodeStream:
        return DecodeStream(skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this model's tokenizer has no chat template; pass chat_template= or use generate()")
        specials = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                    "pad_token": self.pad_token or ""}
        return render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=specials, **kwargs)
