"""A GGUF file of random quantized weights in a model shape of random_checkpoint.py (no tokenizer): what a
quantized file of that size costs to load, to hold and to decode, without downloading one.

    python bench/random_gguf.py qwen3-30b-a3b-q4_k.gguf --shape qwen3-30b-a3b      # ~17 GB, ~1 min
    python bench/latency.py --model qwen3-30b-a3b-q4_k.gguf --skip-hf --contexts 1024

Every matrix is Q4_K (blocks of random 4-bit values and 6-bit scales under small f16 super-scales, the router
float32 as llama.cpp keeps it), norms are ones. Only the qwen3moe architecture (the issue's shape) is written.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from random_checkpoint import SHAPES  # noqa: E402

Q4_K_BYTES, Q4_K_BLOCK = 144, 256


def q4_k_blocks(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """uint8 [..., rows, row bytes] blocks of a [..., rows, cols] Q4_K tensor: random quants and scales, each
    super-block's d and dmin small float16s, so the values stay in a sane range."""
    *lead, cols = shape
    blocks = rng.integers(0, 256, size=(*lead, cols // Q4_K_BLOCK, Q4_K_BYTES), dtype=np.uint8)
    # d and dmin: with q averaging 7.5 and the 6-bit scale and min alike, d*sc*q - dmin*mn averages about 0
    scales = np.array([0.002, 0.015], dtype=np.float16).view(np.uint8)
    blocks[..., :4] = scales
    return blocks.reshape(*lead, cols // Q4_K_BLOCK * Q4_K_BYTES)


def write_qwen3_moe(path: Path, cfg: dict, seed: int = 0) -> None:
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_expert_count(cfg["num_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_vocab_size(cfg["vocab_size"])   # no tokenizer: the size is said outright
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    q4_k = gguf.GGMLQuantizationType.Q4_K
    hidden, heads, kv_heads, head_dim = (cfg[k] for k in ("hidden_size", "num_attention_heads",
                                                          "num_key_value_heads", "head_dim"))
    experts, inter = cfg["num_experts"], cfg["moe_intermediate_size"]

    def matrix(name: str, *shape: int) -> None:
        writer.add_tensor(name, q4_k_blocks(rng, shape), raw_dtype=q4_k)

    def ones(name: str, size: int) -> None:
        writer.add_tensor(name, np.ones(size, dtype=np.float32))

    matrix("token_embd.weight", cfg["vocab_size"], hidden)
    for b in range(cfg["num_hidden_layers"]):
        p = f"blk.{b}."
        ones(p + "attn_norm.weight", hidden)
        ones(p + "ffn_norm.weight", hidden)
        ones(p + "attn_q_norm.weight", head_dim)
        ones(p + "attn_k_norm.weight", head_dim)
        matrix(p + "attn_q.weight", heads * head_dim, hidden)
        matrix(p + "attn_k.weight", kv_heads * head_dim, hidden)
        matrix(p + "attn_v.weight", kv_heads * head_dim, hidden)
        matrix(p + "attn_output.weight", hidden, heads * head_dim)
        writer.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((experts, hidden), dtype=np.float32) * 0.02)
        matrix(p + "ffn_gate_exps.weight", experts, inter, hidden)
        matrix(p + "ffn_up_exps.weight", experts, inter, hidden)
        matrix(p + "ffn_down_exps.weight", experts, hidden, inter)
    ones("output_norm.weight", hidden)
    matrix("output.weight", cfg["vocab_size"], hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path)
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    args = ap.parse_args()
    cfg = SHAPES[args.shape]
    if cfg.get("architecture") != "Qwen3MoeForCausalLM":
        ap.error(f"{args.shape}: only Qwen3-MoE shapes are written")
    started = time.perf_counter()
    write_qwen3_moe(args.path, cfg)
    print(f"{args.path}: {args.path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
