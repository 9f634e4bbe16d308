"""A GGUF file of random quantized weights in a model shape of random_checkpoint.py (no tokenizer): what a
quantized file of that size costs to load, to hold and to decode, without downloading one.

    python bench/random_gguf.py qwen3-30b-a3b-q4_k.gguf --shape qwen3-30b-a3b      # ~17 GB, ~1 min
    python bench/random_gguf.py llama3-8b-q4_k_m.gguf --shape llama3-8b --mix q4_k_m   # ~4.9 GB
    python bench/latency.py --model qwen3-30b-a3b-q4_k.gguf --skip-hf --contexts 1024

Qwen3-MoE shapes: every matrix Q4_K (blocks of random 4-bit values and 6-bit scales under small f16 super-scales, the
router float32 as llama.cpp keeps it). Llama shapes: llama.cpp's type mixes of a file, ``--mix q4_k_m`` (Q4_K, with
Q6_K for the head and for attn_v and ffn_down in llama.cpp's ``use_more_bits`` layers: the first and last eighth and
every third between) or ``q8_0`` (every matrix). Norms are ones.
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


Q6_K_BYTES, Q8_0_BYTES, Q8_0_BLOCK = 210, 34, 32


def q6_k_blocks(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """uint8 [rows, row bytes] Q6_K blocks: random 6-bit quants (ql, qh), int8 scales in 1..16 and a small f16 d,
    so that the values (d * scale * (q - 32)) stay within +-0.5."""
    rows, cols = shape
    blocks = rng.integers(0, 256, size=(rows, cols // Q4_K_BLOCK, Q6_K_BYTES), dtype=np.uint8)
    blocks[..., 192:208] = rng.integers(1, 17, size=(rows, cols // Q4_K_BLOCK, 16), dtype=np.uint8)
    blocks[..., 208:210] = np.array([0.001], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, cols // Q4_K_BLOCK * Q6_K_BYTES)


def q8_0_blocks(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """uint8 [rows, row bytes] Q8_0 blocks: a small f16 d and 32 random int8 quants each."""
    rows, cols = shape
    blocks = rng.integers(0, 256, size=(rows, cols // Q8_0_BLOCK, Q8_0_BYTES), dtype=np.uint8)
    blocks[..., :2] = np.array([0.002], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, cols // Q8_0_BLOCK * Q8_0_BYTES)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down a Q4_K_M file keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def write_llama(path: Path, cfg: dict, mix: str = "q4_k_m", seed: int = 0) -> None:
    """A Llama-architecture file of ``cfg``'s shape in llama.cpp's ``mix`` (q4_k_m or q8_0)."""
    import gguf

    rng = np.random.default_rng(seed)
    kinds = gguf.GGMLQuantizationType
    writers = {kinds.Q4_K: q4_k_blocks, kinds.Q6_K: q6_k_blocks, kinds.Q8_0: q8_0_blocks}
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim, layers = cfg.get("head_dim", hidden // heads), cfg["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])   # no tokenizer: the size is said outright
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M if mix == "q4_k_m" else gguf.LlamaFileType.MOSTLY_Q8_0)

    def kind(name: str, layer: int = 0) -> int:
        if mix == "q8_0":
            return kinds.Q8_0
        if name == "output.weight" or (name.endswith(("attn_v.weight", "ffn_down.weight"))
                                       and use_more_bits(layer, layers)):
            return kinds.Q6_K
        return kinds.Q4_K

    def matrix(name: str, rows: int, cols: int, layer: int = 0) -> None:
        k = kind(name, layer)
        writer.add_tensor(name, writers[k](rng, (rows, cols)), raw_dtype=k)

    def ones(name: str, size: int) -> None:
        writer.add_tensor(name, np.ones(size, dtype=np.float32))

    matrix("token_embd.weight", cfg["vocab_size"], hidden)
    for b in range(layers):
        p = f"blk.{b}."
        ones(p + "attn_norm.weight", hidden)
        ones(p + "ffn_norm.weight", hidden)
        matrix(p + "attn_q.weight", heads * head_dim, hidden, b)
        matrix(p + "attn_k.weight", kv_heads * head_dim, hidden, b)
        matrix(p + "attn_v.weight", kv_heads * head_dim, hidden, b)
        matrix(p + "attn_output.weight", hidden, heads * head_dim, b)
        matrix(p + "ffn_gate.weight", cfg["intermediate_size"], hidden, b)
        matrix(p + "ffn_up.weight", cfg["intermediate_size"], hidden, b)
        matrix(p + "ffn_down.weight", hidden, cfg["intermediate_size"], b)
    ones("output_norm.weight", hidden)
    if not cfg.get("tie_word_embeddings"):
        matrix("output.weight", cfg["vocab_size"], hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


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
    ap.add_argument("--mix", choices=("q4_k_m", "q8_0"), default="q4_k_m", help="a Llama shape's types")
    args = ap.parse_args()
    cfg = SHAPES[args.shape]
    architecture = cfg.get("architecture", "LlamaForCausalLM")
    if architecture not in ("Qwen3MoeForCausalLM", "LlamaForCausalLM"):
        ap.error(f"{args.shape}: only Qwen3-MoE and Llama shapes are written")
    started = time.perf_counter()
    if architecture == "LlamaForCausalLM":
        write_llama(args.path, cfg, args.mix)
    else:
        write_qwen3_moe(args.path, cfg)
    print(f"{args.path}: {args.path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
