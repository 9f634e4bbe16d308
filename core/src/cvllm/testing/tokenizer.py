"""A real byte-level BPE tokenizer for tiny test models, trained on a corpus held in this module.

Training is deterministic, so every call writes byte-identical files: checkpoints built in different
test sessions share the same token ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 256

# ChatML, as SmolLM2 and Qwen write it; the generation prompt opens the assistant's turn.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Mixed prose, code, numbers and non-ASCII text, so the merges cover more than one kind of input.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A paged cache keeps the keys and values of every
sequence in fixed-size blocks, and a scheduler decides which requests run in the next step.
When the pool runs out of blocks, the newest request is preempted and computed again later.
Continuous batching lets new requests join while older ones are still decoding their tokens.
The model reads the prompt, writes one token at a time, and stops at the end-of-sequence token.
Hello, world! How are you today? I am fine, thank you. What time is it? It is half past three.
She sells sea shells by the sea shore; the shells she sells are surely sea shells.
In the beginning there was a small model with two layers, four heads and a tiny vocabulary.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048 3.14159 2.71828 -7 +13 1e-5 99%.
Dates like 2024-05-17 and times like 09:30 or 23:59:07 appear in logs and in chat messages.
def generate(prompt, max_tokens=16):
    tokens = tokenize(prompt)
    for _ in range(max_tokens):
        logits = model(tokens)
        tokens.append(int(logits[-1].argmax()))
    return detokenize(tokens)
for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }
if x > 0 and y < 10: print("inside the box") else: print("outside")
{"role": "user", "content": "Tell me a story about a dragon."}
{"role": "assistant", "content": "Once upon a time, a dragon lived on a mountain."}
The user asked a question and the assistant answered it politely and briefly.
Café, naïve, façade, jalapeño, Über, smörgåsbord, crème brûlée — words with accents.
Grüße aus München! Ça va? ¿Dónde está la biblioteca? Mañana será otro día.
日本語のテキストも少し含まれています。中文也有一点。한국어도 조금 있습니다。
Emoji too: 🙂 🚀 🐍 ✨ — each one is several bytes in UTF-8.
Attention is all you need, they said, and then everyone needed a bigger cache.
Rotary position embeddings rotate pairs of channels by an angle that grows with the position.
Grouped-query attention shares each key and value head among several query heads.
A sliding window limits how far back each position may look, which bounds the cache per layer.
The weather was cold and windy, so we stayed inside, read books and drank hot tea.
Mountains, rivers, forests and deserts: the world is large and full of strange places.
Testing, testing, one two three. This is only a test; had it been real, you would know.
"""


def _train() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def build_tiny_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """Train the byte-level BPE; specials first so that `<|endoftext|>` is id 0."""
    tokenizer = _train()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        # The full byte alphabet, so any text (not only the corpus's characters) can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"corpus too small for vocab_size={vocab_size}: got {tokenizer.get_vocab_size()}")
    return tokenizer


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHATML_TEMPLATE,
    }


def write_tiny_tokenizer(dir: Path, vocab_size: int = 512) -> None:
    """Write tokenizer.json and tokenizer_config.json into `dir` (created if missing)."""
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(vocab_size).save(str(dir / "tokenizer.json"))
    (dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
