"""The tokenizer a GGUF file describes, rebuilt with ``tokenizers`` so that token ids equal llama.cpp's.

A GGUF carries no ``tokenizer.json``: only the vocabulary, merges or scores, token types and special ids as
``tokenizer.*`` metadata. llama.cpp tokenizes from those with its own rules (``llama-vocab.cpp``), which this
module reproduces: the pre-tokenizer regexes per ``tokenizer.ggml.pre``, BPE-by-score for SentencePiece
vocabularies, which tokens are matched whole in the text, when BOS is added, and which ids end generation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from cvllm.checkpoint.base import CheckpointError
from cvllm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class GGUFTokenizerError(CheckpointError):
    """The tokenizer metadata asks for something llama.cpp would refuse or that is not supported here."""


class TokenType(IntEnum):  # tokenizer.ggml.token_type values
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# -- pre-tokenizer splits: llama.cpp's regex lists, applied one after the other, each splitting the pieces
# -- the previous one left (llama.cpp uses its own adapted forms of some upstream regexes; these are those).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_CASED_WORDS = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+<C>"
                r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*<C>")
_TEKKEN = _CASED_WORDS.replace("<C>", "") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O = (_CASED_WORDS.replace("<C>", _CONTRACTIONS + "?")
          + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp runs the regexes below through std::regex after replacing every non-ASCII whitespace character by
# \x0B, so a class with explicit ranges never matches one (U+3000 lies inside ࠀ-一): "&&[^\s]" says the same
_CJK_HANGUL = r"[一-龥ࠀ-一가-\x{D7FF}&&[^\s]]+"
_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\x{1F7D}ᾀ-ᾴᾶ-ᾼ\x{1FBE}ῂ-ῄῆ-ῌῐ-\x{1FD3}ῖ-\x{1FDB}ῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\x{2126}ℨ\x{212A}-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",  # noqa: E501
    r"\s?[!-/:-~！-／：-～‘-‟\x{3000}-。&&[^\s]]+",
    r"\s+$",
    _CJK_HANGUL,
    r"\p{N}+",
)
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    r"[一-龥\x{3040}-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
)


@dataclass(frozen=True, slots=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False   # a piece that is itself a token is emitted whole (llama3 and others)
    add_bos: bool = False         # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token
    no_default_bos: bool = False  # llama.cpp drops the gpt2 default BOS id (11): BOS only if the file names one


def _names(names: str, spec: PreTokenizer) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names.split(), spec)


# tokenizer.ggml.pre → split; the groups are llama.cpp's (llama_vocab::impl::load and llm_tokenizer_bpe)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_names("default", PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))),
    **_names("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
             PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)),
    **_names("dbrx smaug-bpe", PreTokenizer((_LLAMA3,))),
    # CHATGLM4 (GLM-4 and later): llama3's regex; glm4/glm5 also ignore merges, chatglm-bpe does not
    **_names("chatglm-bpe", PreTokenizer((_LLAMA3,), no_default_bos=True)),
    **_names("glm4 glm5", PreTokenizer((_LLAMA3,), ignore_merges=True, no_default_bos=True)),
    **_names("deepseek-llm", PreTokenizer(_DEEPSEEK_LLM)),
    **_names("deepseek-coder", PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"))),
    **_names("deepseek-v3 hunyuan-dense joyai-llm hy_v4", PreTokenizer(_DEEPSEEK_V3)),
    **_names("falcon", PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"))),
    **_names("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2",
             PreTokenizer((r"\p{N}", _GPT2))),
    **_names("gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert exaone4 mpt "
             "olmo jais trillion granite-docling", PreTokenizer((_GPT2,))),
    **_names("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open", PreTokenizer((_QWEN2,))),
    **_names("qwen35", PreTokenizer((_QWEN35,))),
    **_names("tekken", PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True)),
    **_names("gpt-4o llama4 kanana2 talkie minimax-m2", PreTokenizer((_GPT4O,))),
}

# -- end of generation: llama.cpp decides it from token texts (llama_vocab::impl::load), not from metadata alone
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
})
# special roles llama.cpp finds by text when the file gives no id; a token found so becomes a control token
_ROLE_TEXTS: dict[str, frozenset[str]] = {
    "eot": frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
                      "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"}),
    "eom": frozenset({"<|eom_id|>"}),
    "fim_pre": frozenset({"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                          "<|code_prefix|>", "<|prefix|>"}),
    "fim_suf": frozenset({"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                          "<|code_suffix|>", "<|suffix|>"}),
    "fim_mid": frozenset({"<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                          "<|code_middle|>", "<|middle|>"}),
    "fim_pad": frozenset({"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"}),
    "fim_rep": frozenset({"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"}),
    "fim_sep": frozenset({"<|file_sep|>"}),
}
_ROLE_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "eot": "eot_token_id", "eom": "eom_token_id",
              "unk": "unknown_token_id", "pad": "padding_token_id", "fim_pre": "fim_pre_token_id",
              "fim_suf": "fim_suf_token_id", "fim_mid": "fim_mid_token_id", "fim_pad": "fim_pad_token_id",
              "fim_rep": "fim_rep_token_id", "fim_sep": "fim_sep_token_id"}
_DEFAULT_IDS = {"llama": {"bos": 1, "eos": 2, "unk": 0}, "gpt2": {"bos": 11, "eos": 11}}
_ALWAYS_USER_DEFINED = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})  # gpt-oss


@dataclass(slots=True)
class Vocab:
    """The vocabulary as llama.cpp sees it after loading: texts, effective token types, special ids, EOG set."""
    model: str
    tokens: list[str]
    types: list[int]
    ids: dict[str, int]   # role (bos, eos, eot, ...) → token id, only for roles that are set
    eog: set[int]

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> Vocab:
        model = fields.get("tokenizer.ggml.model")
        raw = fields.get("tokenizer.ggml.tokens")
        if not raw:
            raise GGUFTokenizerError("GGUF metadata has no tokenizer.ggml.tokens")
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(raw)]  # llama.cpp renames empty tokens
        n = len(tokens)
        types = [int(t) for t in fields.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * n][:n]
        types += [TokenType.NORMAL] * (n - len(types))
        ids = {role: i for role, i in _DEFAULT_IDS.get(model, {}).items() if i < n}
        pre = PRE_TOKENIZERS.get(fields.get("tokenizer.ggml.pre") or "default") if model == "gpt2" else None
        if pre is not None and pre.no_default_bos:
            ids.pop("bos", None)  # cleared before the file's ids are read, so a bos_token_id still sets it
        for role, key in _ROLE_KEYS.items():
            value = fields.get(f"tokenizer.ggml.{key}")
            if value is not None and 0 <= int(value) < n:  # llama.cpp ignores out-of-range ids
                ids[role] = int(value)
        by_text = {t: i for i, t in enumerate(tokens)}  # duplicates: the last one wins, as in llama.cpp
        for role, texts in _ROLE_TEXTS.items():
            found = sorted(by_text[t] for t in texts if t in by_text)
            if role not in ids and found:
                # llama.cpp takes the first in its hash map's order; with several candidates we take the lowest id
                ids[role] = found[0]
                types[found[0]] = TokenType.CONTROL
        eog = {ids[role] for role in ("fim_pad", "fim_rep", "fim_sep") if role in ids}
        for text, i in by_text.items():
            if text in EOG_TEXTS:
                eog.add(i)
                types[i] = TokenType.CONTROL
            if text in _ALWAYS_USER_DEFINED:
                types[i] = TokenType.USER_DEFINED
        eog |= {ids[role] for role in ("eos", "eot", "eom") if role in ids}
        texts = {tokens[i]: i for i in eog}
        has_call = "<|call|>" in texts or "<|calls|>" in texts
        if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
            # harmony / solar-open: <|end|> closes a message, not the generation
            eog.discard(texts["<|end|>"])
            types[texts["<|end|>"]] = TokenType.USER_DEFINED
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(texts["</s>"])  # gemma4, plamo: </s> is an ordinary token
            types[texts["</s>"]] = TokenType.NORMAL
        return cls(model, tokens, types, ids, eog)

    def text(self, role: str) -> str | None:
        return self.tokens[self.ids[role]] if role in self.ids else None


def stop_token_ids(fields: dict[str, Any]) -> set[int]:
    """The ids llama.cpp treats as end of generation (``llama_vocab_is_eog``): eos, eot, eom, the FIM pad/repo/
    separator tokens and every token spelled like a known end-of-turn marker."""
    return set(Vocab.from_fields(fields).eog)


def tokenizer_from_gguf(fields: dict[str, Any]) -> Tokenizer:
    """A cvllm Tokenizer equal to llama.cpp's for the ``tokenizer.*`` metadata of a GGUF file."""
    vocab = Vocab.from_fields(fields)
    if vocab.model == "gpt2":
        tokenizer, default_bos = _byte_level_bpe(vocab, fields)
    elif vocab.model == "llama":
        tokenizer, default_bos = _sentencepiece_bpe(vocab, fields), True
    else:
        raise GGUFTokenizerError(f"GGUF tokenizer model {vocab.model!r} is not supported (supported: gpt2, llama)")
    # llama.cpp matches control, unknown and user-defined tokens whole in the text before anything else
    added = [AddedToken(text, special=kind != TokenType.USER_DEFINED, normalized=False)
             for text, kind in zip(vocab.tokens, vocab.types)
             if kind in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED)]
    tokenizer.add_tokens(added)
    add_bos = _flag(fields, "add_bos_token", default_bos)
    add_eos = _flag(fields, "add_eos_token", False)
    if add_bos or add_eos:
        tokenizer.post_processor = _bos_eos_processor(vocab, add_bos, add_eos)
    return Tokenizer(tokenizer, bos_token=vocab.text("bos"), eos_token=vocab.text("eos"),
                     pad_token=vocab.text("pad"), chat_template=fields.get("tokenizer.chat_template"),
                     named_templates={key.removeprefix("tokenizer.chat_template."): value
                                      for key, value in fields.items()
                                      if key.startswith("tokenizer.chat_template.") and isinstance(value, str)})


def _flag(fields: dict[str, Any], key: str, default: bool) -> bool:
    value = fields.get(f"tokenizer.ggml.{key}")
    return default if value is None else bool(value)


def _byte_level_bpe(vocab: Vocab, fields: dict[str, Any]) -> tuple[HFTokenizer, bool]:
    pre_name = fields.get("tokenizer.ggml.pre")
    if not pre_name:
        logger.warning("GGUF file names no pre-tokenizer (tokenizer.ggml.pre); using 'default' as llama.cpp does, "
                       "which may not split text the way the vocabulary was trained")
        pre_name = "default"
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise GGUFTokenizerError(f"GGUF pre-tokenizer {pre_name!r} (tokenizer.ggml.pre) is not supported; "
                                 f"supported: {', '.join(sorted(PRE_TOKENIZERS))}")
    by_text = {t: i for i, t in enumerate(vocab.tokens)}
    merges: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for merge in fields.get("tokenizer.ggml.merges") or ():
        cut = merge.find(" ", 1)  # llama.cpp splits at the first space after the first character
        pair = (merge[:cut], merge[cut + 1:])
        # tokenizers needs both parts and the result in the vocabulary; llama.cpp keeps the first duplicate
        if cut > 0 and pair not in seen and pair[0] in by_text and pair[1] in by_text and pair[0] + pair[1] in by_text:
            seen.add(pair)
            merges.append(pair)
    tokenizer = HFTokenizer(BPE(by_text, merges, ignore_merges=pre.ignore_merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, pre.add_bos


def _sentencepiece_bpe(vocab: Vocab, fields: dict[str, Any]) -> HFTokenizer:
    """llama.cpp's SPM tokenizer: characters merged pairwise, the pair whose joined text is the highest-scoring
    token first (leftmost on ties), unknown characters as <0xNN> byte tokens. The same as BPE whose merges are
    every split of every token, ranked by the token's score -- except that equal scores (rare among real pieces)
    rank by token id here, not by position."""
    by_text = {t: i for i, t in enumerate(vocab.tokens)}
    scores = fields.get("tokenizer.ggml.scores")
    scores = np.zeros(len(vocab.tokens)) if scores is None else np.asarray(scores, dtype=np.float64)
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, i in by_text.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in by_text and right in by_text:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    unk = vocab.text("unk")
    tokenizer = HFTokenizer(BPE(by_text, [(left, right) for *_, left, right in ranked], unk_token=unk,
                                byte_fallback=True))
    space_prefix = _flag(fields, "add_space_prefix", True)
    # llama.cpp prepends the space to every stretch of text between special tokens, as a normalizer does here
    # (transformers' Metaspace(prepend_scheme="first") would only do it at the very start)
    escape = [normalizers.Replace(" ", "▁")]
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), *escape] if space_prefix else escape)
    strip = [decoders.Strip(" ", 1, 0)] if space_prefix else []
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           *strip])
    return tokenizer


def _bos_eos_processor(vocab: Vocab, add_bos: bool, add_eos: bool) -> processors.TemplateProcessing:
    pieces: dict[str, list[str]] = {}
    specials = []
    for role, wanted in (("bos", add_bos), ("eos", add_eos)):
        if not wanted:
            pieces[role] = []
            continue
        if role not in vocab.ids:
            raise GGUFTokenizerError(f"GGUF metadata asks to add the {role.upper()} token but names none")
        text = vocab.text(role)
        # the template names tokens by a string it parses ("<x>:1", "$A"): stand in for texts it would misread
        name = text if ":" not in text and not text.startswith("$") and text.strip() == text else role.upper()
        pieces[role] = [name]
        specials.append((name, vocab.ids[role]))
    head, tail = pieces["bos"], pieces["eos"]
    return processors.TemplateProcessing(single=[*head, "$A", *tail], pair=[*head, "$A", *tail, *head, "$B:1", *tail],
                                         special_tokens=specials)


def read_gguf_fields(metadata: dict[str, Any], prefix: str = "tokenizer.") -> dict[str, Any]:
    """The entries of a GGUF file's metadata (``GGUFFile.metadata``) whose key starts with ``prefix``."""
    return {name: value for name, value in metadata.items() if name.startswith(prefix)}
