"""Test helpers: tiny checkpoints with a real tokenizer, and transformers as the oracle.

Imported only by tests; transformers (a test dependency) is imported lazily inside the functions.
"""

from cvllm.testing.checkpoints import (
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    VARIANTS,
    cvllm_greedy,
    greedy_margins,
    hf_greedy,
    hf_logits,
    make_checkpoint,
    published_spelling,
    randomize_norms_and_biases,
    register_tiny_architecture,
    save_sharded,
    tiny_config,
)
from cvllm.testing.threads import one_torch_thread
from cvllm.testing.tokenizer import (
    CHATML_TEMPLATE,
    SPECIAL_TOKENS,
    build_tiny_tokenizer,
    write_tiny_tokenizer,
)

__all__ = [
    "CHATML_TEMPLATE",
    "EOS_TOKEN_ID",
    "PAD_TOKEN_ID",
    "SPECIAL_TOKENS",
    "VARIANTS",
    "build_tiny_tokenizer",
    "cvllm_greedy",
    "greedy_margins",
    "hf_greedy",
    "hf_logits",
    "make_checkpoint",
    "published_spelling",
    "one_torch_thread",
    "randomize_norms_and_biases",
    "register_tiny_architecture",
    "save_sharded",
    "tiny_config",
    "write_tiny_tokenizer",
]
