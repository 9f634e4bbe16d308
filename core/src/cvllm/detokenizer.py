"""Incremental detokenization with stop strings.

Text grows one token at a time through ``tokenizers``' DecodeStream, which never emits half a
UTF-8 character. Stop strings are searched only in the new text plus the ``len(stop) - 1``
characters before it, so the scan per token is short whatever the output length.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: list[str], skip_special_tokens: bool = True,
                 include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.stream = tokenizer.decode_stream(skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.longest_stop = max((len(s) for s in stop), default=0)
        self.text = ""

    def update(self, token_id: int) -> str | None:
        """Add one token; returns the stop string when one completed (the text is then cut there)."""
        piece = self.stream.step(self.tokenizer.tokenizer, token_id)
        if not piece:
            return None
        scan_from = max(0, len(self.text) - self.longest_stop + 1)
        self.text += piece
        if not self.stop:
            return None
        best: tuple[int, str] | None = None
        for stop in self.stop:
            at = self.text.find(stop, scan_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop)] if self.include_stop else self.text[:at]
        return stop
