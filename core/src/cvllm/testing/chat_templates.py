"""A model plugin's chat templates rendered by cvllm and by transformers, for tests that compare the two character
for character (the family plugins' tests/data templates).

``ChatTemplates(data_dir, templates, control_tokens)``: ``templates`` maps a template's name (``<name>.jinja`` in
``data_dir``) to the special tokens its model's tokenizer names; ``control_tokens`` are added to the tiny test
tokenizer as special tokens. ``reference(...)`` is transformers' ``apply_chat_template(tokenize=False)``;
``ours(...)`` is cvllm's ``render_chat`` and ``Tokenizer.apply_chat_template``, which must agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from cvllm.chat_template import render_chat
from cvllm.testing.tokenizer import build_tiny_tokenizer


def check_source_notes(data_dir: Path, templates: Iterable[str]) -> None:
    """Each ``<name>.jinja`` in ``data_dir`` has a ``<name>.source.md`` naming its license and the sha256 of the
    verbatim copy, which the file matches; no other templates are there."""
    import hashlib
    import re

    data_dir, names = Path(data_dir), set(templates)
    assert {p.stem for p in data_dir.glob("*.jinja")} == names
    for name in names:
        note = (data_dir / f"{name}.source.md").read_text(encoding="utf-8")
        assert "License" in note, f"{name}.source.md names no license"
        digest = re.search(r"sha256 `([0-9a-f]{64})`", note)
        assert digest, f"{name}.source.md gives no sha256"
        assert hashlib.sha256((data_dir / f"{name}.jinja").read_bytes()).hexdigest() == digest[1], name


def template_cases(templates: Iterable[str], conversations: Mapping[str, list], continue_final: list,
                   no_system_role: Iterable[str] = ()) -> list[tuple[str, str, list, dict[str, Any]]]:
    """(template, case id, messages, keyword arguments) for each template: every conversation with and without the
    generation prompt (a leading system message dropped for the templates in ``no_system_role``), and
    ``continue_final`` (ending in an assistant message) continued."""
    cases = []
    for name in templates:
        for conversation, messages in conversations.items():
            if name in no_system_role and messages[0]["role"] == "system":
                messages = messages[1:]
            for prompt in (True, False):
                cases.append((name, f"{conversation}-prompt={prompt}", messages, {"add_generation_prompt": prompt}))
        cases.append((name, "continue_final", continue_final,
                      {"add_generation_prompt": False, "continue_final_message": True}))
    return cases


class ChatTemplates:
    def __init__(self, data_dir: Path, templates: Mapping[str, Mapping[str, str]], control_tokens: Iterable[str],
                 workdir: Path):
        """``workdir``: where the tiny tokenizer with the control tokens is written (a pytest tmp dir)."""
        from tokenizers import AddedToken

        self.data_dir, self.templates = Path(data_dir), {name: dict(t) for name, t in templates.items()}
        tokenizer = build_tiny_tokenizer()
        tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in control_tokens])
        self.tokenizer_file = Path(workdir) / "tokenizer.json"
        tokenizer.save(str(self.tokenizer_file))

    def source(self, name: str) -> str:
        return (self.data_dir / f"{name}.jinja").read_text(encoding="utf-8")

    def reference(self, name: str, messages: list, **kwargs: Any) -> str:
        from transformers import PreTrainedTokenizerFast

        specials = self.templates[name]
        hf = PreTrainedTokenizerFast(tokenizer_file=str(self.tokenizer_file), **specials)
        assert hf.special_tokens_map == specials  # the template sees exactly these tokens, and no others
        return hf.apply_chat_template(messages, chat_template=self.source(name), tokenize=False, **kwargs)

    def ours(self, name: str, messages: list, **kwargs: Any) -> str:
        from tokenizers import Tokenizer as HFTokenizersTokenizer

        from cvllm.tokenizer import Tokenizer

        source, specials = self.source(name), self.templates[name]
        direct = render_chat(source, messages, special_tokens=specials, **kwargs)
        tokenizer = Tokenizer(HFTokenizersTokenizer.from_file(str(self.tokenizer_file)), chat_template=source,
                              **specials)
        assert tokenizer.apply_chat_template(messages, **kwargs) == direct
        return direct
