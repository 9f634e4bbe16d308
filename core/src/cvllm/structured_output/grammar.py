"""The engine's side of structured output, on llguidance: one matcher per sequence, and each step the bitmask of
the tokens its grammar allows next.

- Grammars compile on a small thread pool (llguidance drops the GIL; a large schema takes up to a second): a
  request joins the scheduler when its matchers are built, and never holds up the others' steps.
- The tokenizer llguidance needs (the model's ``tokenizers`` vocabulary, with the model's EOS ids and logit width)
  is built once, on the first structured request, in that pool too.
- Masks are filled by llguidance's own threads into one int32 bitmask (bit j of word w allows token 32w + j),
  which the sampler unpacks on the device. Under async scheduling the engine fills them after launching the
  forward pass and before sampling (llm_engine.py), so the CPU work overlaps the GPU's.
- Reasoning models: the grammar starts after the thinking section (``reasoning_end``); where the model may open
  its thinking itself, the first token may also be ``reasoning_start``.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from cvllm.structured_output.params import StructuredOutputsParams, grammar_text

logger = logging.getLogger(__name__)

COMPILE_THREADS = 2

# what a sequence's grammar does with its next token
_FIRST, _THINKING, _ACTIVE = range(3)


class SequenceGrammar:
    """One sequence's matcher and where its output stands: before the grammar (thinking) or in it."""

    __slots__ = ("matcher", "state", "reasoning_end", "reasoning_start")

    def __init__(self, matcher, params: StructuredOutputsParams):
        self.matcher = matcher
        self.reasoning_end = params.reasoning_end
        self.reasoning_start = params.reasoning_start
        if not params.reasoning_end:
            self.state = _ACTIVE
        else:
            self.state = _THINKING if params.reasoning_start is None else _FIRST

    @property
    def constrained(self) -> bool:
        """The next token is masked."""
        return self.state != _THINKING

    def accept(self, token: int, seq) -> bool:
        """Advance past ``token`` (already appended to ``seq``); False if the grammar refuses it."""
        if self.state == _THINKING:
            end = self.reasoning_end
            if seq.num_output_tokens >= len(end) and seq.token_ids[-len(end):] == end:
                self.state = _ACTIVE
            return True
        if self.state == _FIRST:
            if token == self.reasoning_start:
                self.state = _THINKING
                return True
            self.state = _ACTIVE
        return self.matcher.consume_token(token)

    def error(self) -> str:
        return self.matcher.get_error() or "the grammar does not allow the sampled token"


class GrammarMasks:
    """The structured-output state of one engine: the llguidance tokenizer, the compile pool, the bitmask buffer."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int], max_rows: int):
        """``tokenizer``: the model's (cvllm.tokenizer.Tokenizer); ``vocab_size``: the logits' width; ``max_rows``:
        the most sequences a step samples."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.words = (vocab_size + 31) // 32
        self.bits = torch.empty((max_rows, self.words), dtype=torch.int32)
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="cvllm-grammar")
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._executor = None

    def compile(self, params: StructuredOutputsParams, n: int) -> Future[list[SequenceGrammar]]:
        """A future of ``n`` grammars (one per completion) for ``params``."""
        return self._pool.submit(self._compile, params, n)

    def _compile(self, params: StructuredOutputsParams, n: int) -> list[SequenceGrammar]:
        from llguidance import LLMatcher

        started = time.perf_counter()
        matcher = LLMatcher(self._tokenizer(), grammar_text(params), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs {params.describe()}: {matcher.get_error()}")
        matchers = [matcher] + [matcher.deep_copy() for _ in range(n - 1)]
        logger.debug("grammar %s compiled in %.1f ms", params.describe(), (time.perf_counter() - started) * 1e3)
        return [SequenceGrammar(m, params) for m in matchers]

    def _tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                from llguidance import LLExecutor, LLTokenizer

                started = time.perf_counter()
                hf = self.tokenizer.tokenizer   # a tokenizers.Tokenizer (GGUF vocabularies are converted to one)
                self._ll_tokenizer = LLTokenizer(hf.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
                self._executor = LLExecutor()
                logger.info("structured output: the vocabulary indexed for grammars in %.2f s",
                            time.perf_counter() - started)
            return self._ll_tokenizer

    def bitmask(self, seqs) -> tuple[list[int], torch.Tensor] | None:
        """(rows, bitmask [len(rows), words]) for the constrained ones among ``seqs`` (a step's sampling sequences,
        every token before this step consumed); None when none is. The bitmask is this object's buffer: valid until
        the next call (the step that reads it has been sampled by then)."""
        rows = [i for i, seq in enumerate(seqs)
                if seq.grammar is not None and seq.grammar.constrained and not seq.is_finished]
        if not rows:
            return None
        from llguidance.torch import fill_next_token_bitmask_par

        bits = self.bits[:len(rows)]
        fill_next_token_bitmask_par(self._executor, [(seqs[i].grammar.matcher, k) for k, i in enumerate(rows)], bits)
        for k, i in enumerate(rows):   # a model that may open its thinking itself: the tag is allowed first
            grammar = seqs[i].grammar
            if grammar.state == _FIRST:
                word, bit = divmod(grammar.reasoning_start, 32)
                bits[k, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)   # bit 31 is int32's sign
        return rows, bits

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, V] with the tokens that ``bits`` (int32 [len(rows), ceil(V / 32)], on the logits' device)
    does not allow set to -inf in ``rows``."""
    vocab = logits.shape[1]
    # unpacked a byte at a time (a quarter of the temporary an int32 shift makes): on a little-endian machine token
    # 32w + j is bit j % 8 of byte 4w + j // 8
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    allowed = ((bits.view(torch.uint8).unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    masked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy(0, rows, masked)
