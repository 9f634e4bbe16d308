"""Test helpers: tiny checkpoints with a real tokenizer, transformers as the oracle, and the harness of the
model plugins' oracle tests.

Imported only by tests; transformers (a test dependency) is imported lazily inside the functions.
"""

from cvllm.testing.checkpoints import (
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    ROTARY_SPELLINGS,
    VARIANTS,
    cvllm_greedy,
    greedy_margins,
    hf_greedy,
    hf_logits,
    make_checkpoint,
    make_partial_rotary_checkpoint,
    published_spelling,
    randomize_norms_and_biases,
    register_tiny_architecture,
    save_sharded,
    tiny_config,
)
from cvllm.testing.oracle import CheckpointFactory, Harness, TinyCheckpoint, checkpoint_factory
from cvllm.testing.threads import one_torch_thread
from cvllm.testing.tokenizer import (
    CHATML_TEMPLATE,
    SPECIAL_TOKENS,
    build_tiny_tokenizer,
    write_tiny_tokenizer,
)

__all__ = [
    "CHATML_TEMPLATE",
    "CheckpointFactory",
    "EOS_TOKEN_ID",
    "Harness",
    "PAD_TOKEN_ID",
    "ROTARY_SPELLINGS",
    "SPECIAL_TOKENS",
    "TinyCheckpoint",
    "VARIANTS",
    "build_tiny_tokenizer",
    "checkpoint_factory",
    "cvllm_greedy",
    "greedy_margins",
    "hf_greedy",
    "hf_logits",
    "make_checkpoint",
    "make_partial_rotary_checkpoint",
    "published_spelling",
    "one_torch_thread",
    "randomize_norms_and_biases",
    "register_tiny_architecture",
    "save_sharded",
    "tiny_config",
    "write_tiny_tokenizer",
]
