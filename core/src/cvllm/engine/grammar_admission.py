"""Structured requests wait outside the scheduler while their grammars compile (on GrammarMasks' worker threads),
and join it once compiled; a grammar that fails to compile fails its request, nothing else."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures

from cvllm.engine.sequence import Sequence
from cvllm.structured_output.grammar import GrammarMasks

logger = logging.getLogger(__name__)


class GrammarAdmission:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, max_num_seqs: int):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self.max_num_seqs = max_num_seqs
        self.masks: GrammarMasks | None = None   # structured output's state, made on the first request for it
        self.compiling: list[tuple[Future, list[Sequence]]] = []

    def _masks(self) -> GrammarMasks:
        if self.masks is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer, and this model is served without "
                                 "one")
            self.masks = GrammarMasks(self.tokenizer, self.vocab_size, self.eos_token_ids, self.max_num_seqs)
        return self.masks

    def submit(self, spec, seqs: list[Sequence]) -> None:
        """Start compiling ``spec`` (a request's structured_outputs) for its completions ``seqs``."""
        self.compiling.append((self._masks().compile(spec, len(seqs)), seqs))

    def admit(self, block: bool, add: Callable[[Sequence], None],
              retire: Callable[[Sequence, str], None]) -> list[Sequence]:
        """Requests whose grammars have compiled are ``add``ed to the scheduler (``block``: the engine has nothing
        else to do, so wait for the first). Returns the sequences of grammars that failed, ``retire``d."""
        if not self.compiling:
            return []
        if block:
            wait_futures([future for future, _ in self.compiling], return_when=FIRST_COMPLETED)
        failed, pending = [], []
        for future, seqs in self.compiling:
            if not future.done():
                pending.append((future, seqs))
            elif not seqs[0].is_finished:   # (aborted while it compiled)
                try:
                    grammars = future.result()
                except Exception as e:
                    logger.error("request %s: its grammar does not compile for this model: %s", seqs[0].request_id, e)
                    for seq in seqs:
                        retire(seq, "abort")
                    failed += seqs
                    continue
                for seq, grammar in zip(seqs, grammars):
                    seq.grammar = grammar
                    if seq.num_output_tokens and not seq.replay_grammar():   # resumed: its output so far
                        logger.error("request %s: its output does not fit its grammar: %s", seq.request_id,
                                     grammar.error())
                        retire(seq, "abort")
                        failed.append(seq)
                        continue
                    add(seq)
        self.compiling = pending
        return failed

    def shutdown(self) -> None:
        if self.masks is not None:
            self.masks.shutdown()
