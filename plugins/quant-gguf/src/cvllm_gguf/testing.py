"""A tiny Llama written as llama.cpp's converter writes it, for the GGUF tests (several test files use it; the
tests import it from here since pytest's importlib mode puts no test directory on the import path), and the pieces
of a converter the model plugins' GGUF tests share: tensor names, the common hyperparameters, the tiny tokenizer, a
tensor written as a given type, the file closed.

``write_tiny_llama`` keeps each tensor's blocks in Hugging Face row order, writes them to the GGUF under
llama.cpp's names (q/k rows permuted with convert_hf_to_gguf's ``LlamaModel.permute``) and their float values
(the gguf package's dequantizer) into a Hugging Face directory: two independent pictures of one model.
"""

from __future__ import annotations

import functools
import json

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from cvllm.testing.checkpoints import EOS_TOKEN_ID
from cvllm.testing.tokenizer import SPECIAL_TOKENS, build_tiny_tokenizer
from cvllm_gguf.quant_types import GGMLType

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 256, 4, 2, 2, 96
HEAD_DIM = HIDDEN // HEADS
LAYER_TENSORS = {  # HF module -> llama.cpp name (written out here, independently of gguf's TensorNameMap)
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# HF module -> llama.cpp tensor outside the layers, as most converters write them
GLOBAL_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# a mix like real files: Q8_0 embedding (SmolLM2's), legacy and K-quant linears, float norms
TYPES = {"embed_tokens": GGMLType.Q8_0, "lm_head": GGMLType.Q5_0, "q_proj": GGMLType.Q4_1,
         "k_proj": GGMLType.Q4_1, "v_proj": GGMLType.Q4_1, "o_proj": GGMLType.Q8_0, "gate_proj": GGMLType.Q5_1,
         "up_proj": GGMLType.Q5_1, "down_proj": GGMLType.Q4_K}


def llamacpp_permute(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute, applied to rows (of bytes or floats)."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def shapes(tied: bool) -> dict[str, tuple[int, int]]:
    out = {"model.embed_tokens": (VOCAB, HIDDEN), "model.norm": (HIDDEN,)}
    if not tied:
        out["lm_head"] = (VOCAB, HIDDEN)
    per_layer = {"input_layernorm": (HIDDEN,), "post_attention_layernorm": (HIDDEN,),
                 "self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN), "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
                 "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
                 "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN), "mlp.down_proj": (HIDDEN, INTER)}
    for i in range(LAYERS):
        out.update({f"model.layers.{i}.{name}": shape for name, shape in per_layer.items()})
    return out


def hf_to_gguf_name(name: str, layer_tensors: dict[str, str], global_tensors: dict[str, str] = GLOBAL_TENSORS) -> str:
    """A Hugging Face tensor name (``model.layers.{i}.{module}.{suffix}`` or a global one) as llama.cpp's converter
    writes it (``blk.{i}.{layer_tensors[module]}.{suffix}``); the tables spelled out by each test, independently of
    gguf's TensorNameMap."""
    module, _, suffix = name.rpartition(".")
    if module in global_tensors:
        return f"{global_tensors[module]}.{suffix}"
    _, _, block, rest = module.split(".", 3)
    return f"blk.{block}.{layer_tensors[rest]}.{suffix}"


def write_tiny_llama(tmp_path, make_rows, *, tied=False, types=None, float_linears=(), extra=None):
    """Returns (gguf path, HF directory, {module: raw HF-order bytes}) for the same weights."""
    types = {**TYPES, **(types or {})}
    path, hf_dir = tmp_path / "tiny.gguf", tmp_path / "hf"
    hf_dir.mkdir()
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(VOCAB)
    for key, value in (extra or {}).items():
        value(writer) if callable(value) else writer.add_string(key, value)
    floats, raw_rows = {}, {}
    rng = torch.Generator().manual_seed(0)
    for seed, (module, shape) in enumerate(shapes(tied).items()):
        leaf = module.rpartition(".")[2]
        if len(shape) == 1:  # norms: F32 around 1
            value = 1 + 0.1 * torch.randn(shape, generator=rng)
            writer.add_tensor(hf_to_gguf_name(f"{module}.weight", LAYER_TENSORS), value.numpy())
            floats[f"{module}.weight"] = value
            continue
        qtype = GGMLType.F16 if leaf in float_linears else types[leaf]
        rows = make_rows(qtype, *shape, seed=seed)  # HF row order
        raw_rows[module] = rows
        floats[f"{module}.weight"] = torch.from_numpy(
            gguf.quants.dequantize(rows.numpy(), gguf.GGMLQuantizationType(int(qtype))).astype(np.float32))
        heads = {"q_proj": HEADS, "k_proj": KV_HEADS}.get(leaf)
        stored = llamacpp_permute(rows, heads) if heads else rows
        writer.add_tensor(hf_to_gguf_name(f"{module}.weight", LAYER_TENSORS), stored.numpy(),
                          raw_dtype=gguf.GGMLQuantizationType(int(qtype)))
    write_file(writer)
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN, "intermediate_size": INTER,
              "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
              "vocab_size": VOCAB, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": tied, "torch_dtype": "float32"}
    (hf_dir / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in floats.items()}, str(hf_dir / "model.safetensors"))
    return path, hf_dir, raw_rows


def add_common_hyperparameters(writer: gguf.GGUFWriter, config) -> None:
    """What every convert_hf_to_gguf model writes from a config the same way: layers, context, widths, heads."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)


@functools.cache
def _tiny_vocabulary() -> tuple[list[str], list[str]]:
    """cvllm.testing's tiny byte-level BPE: its tokens by id and its merges (trained from a corpus: built once)."""
    spec = json.loads(build_tiny_tokenizer().to_str())
    by_id = {i: token for token, i in spec["model"]["vocab"].items()}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return [by_id[i] for i in range(len(by_id))], merges


def add_tiny_tokenizer(writer: gguf.GGUFWriter, pre: str = "qwen2") -> None:
    """The tiny byte-level BPE as llama.cpp's _set_vocab_gpt2 writes a vocabulary with pre-tokenizer ``pre``: the
    tokens (the special ones CONTROL), the merges, the EOS id. The caller adds what its converter writes besides
    (BOS and pad ids, add_bos_token, a chat template)."""
    tokens, merges = _tiny_vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(EOS_TOKEN_ID)


def add_tensor(writer: gguf.GGUFWriter, name: str, array: np.ndarray,
               qtype: gguf.GGMLQuantizationType) -> torch.Tensor:
    """Writes ``array`` as ``qtype`` (gguf's own quantizer); returns the float32 values the file then holds."""
    data = gguf.quants.quantize(array, qtype)
    writer.add_tensor(name, data, raw_dtype=qtype)
    return torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32))


def write_file(writer: gguf.GGUFWriter) -> None:
    """GGUFWriter's closing steps, in the order it requires."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
