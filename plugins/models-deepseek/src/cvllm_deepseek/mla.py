"""Multi-head latent attention (DeepSeek-V2/V3), over a paged cache of the compressed latent.

Per token the cache holds what the keys and values are made from, not the keys and values: the normalised
latent ``c`` (``kv_lora_rank`` values) and the shared rotary key ``k_pe`` (``qk_rope_head_dim``), 576 values for
DeepSeek-V3 against 2 x 128 heads x 192 of full K/V. Attention runs on it directly ("weight absorption"):
``kv_b_proj`` makes head h's key ``W_UK[h] c`` and value ``W_UV[h] c``, so

    q_nope . (W_UK[h] c) = (W_UK[h]^T q_nope) . c        and        sum_j p_j W_UV[h] c_j = W_UV[h] (sum_j p_j c_j)

and each head's query becomes ``[W_UK[h]^T q_nope, q_pe]`` against the one "key" ``[c, k_pe]`` of every
position: multi-query attention with head size ``kv_lora_rank + qk_rope_head_dim``, the cache its own values
(``Attention(shared_kv=True)``: one tensor), the output's first ``kv_lora_rank`` features times ``W_UV[h]``.
Same math as transformers' decompressed form; only the rounding order differs.

Decode steps take this form: on the CPU the backend's attention is plain MQA over the latent (the rope part of
its output dropped: ``value_dim``), on CUDA cvllm_cuda.kernels.mla_attention (the latent and rope parts loaded
apart, the latents serving as keys and values). Prompts and long chunks can take the decompressed form, keys and
values made from the cached latents (mla_prefill.py: less compute once a sequence has more than ~170 new tokens;
by default off a GPU only, where it is not yet the faster one).
"""

from __future__ import annotations

import torch
from torch import nn

from cvllm.config import ModelConfig
from cvllm.distributed import tp_rank, tp_size
from cvllm.forward_context import current_forward_context, forward_context
from cvllm.layers import Attention, ColumnParallelLinear, ReplicatedLinear, RMSNorm, RowParallelLinear, get_rope
from cvllm.layers.rotary import _yarn_mscale
from cvllm_deepseek import mla_prefill


def softmax_scale(config: ModelConfig) -> float:
    """1 / sqrt(qk_head_dim), times YaRN's ``mscale(factor, mscale_all_dim)**2`` when the rope is scaled (as
    transformers' yarn_apply_mscale)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        mscale = _yarn_mscale(rope["factor"], rope["mscale_all_dim"])
        scale *= mscale * mscale
    return scale


class DeepseekV2Attention(nn.Module):
    # its prefill path (mla_prefill.py, also a verify step's) slices the cache by the host's sequence lengths
    reads_host_lengths = True

    def __init__(self, config: ModelConfig, interleaved_rope: bool):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        if heads % tp_size():
            raise ValueError(f"{heads} attention heads do not split over {tp_size()} tensor-parallel ranks")
        self.num_heads = heads // tp_size()
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.q_lora_rank = config.get("q_lora_rank")
        bias = bool(config.get("attention_bias", False))
        qk_head_dim = self.nope + self.rope
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_head_dim)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk_head_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        # read as W_UK / W_UV by the absorbed attention, never called as a layer
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.nope + self.v_head_dim))
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, hidden, bias=bias)
        self.rotary_emb = get_rope(self.rope, config.max_position_embeddings, config.rope_parameters or {},
                                   interleaved=interleaved_rope)
        self.attn = Attention(self.num_heads, self.kv_lora_rank + self.rope, softmax_scale(config), 1,
                              shared_kv=True, value_dim=self.kv_lora_rank)

    def load_split_kv_b(self, part: str, tensor: torch.Tensor) -> None:
        """llama.cpp's MLA files split kv_b_proj per head: ``k_b_proj`` [H, kv_lora, nope] (transposed) and
        ``v_b_proj`` [H, v_head, kv_lora]. Each goes to its rows of this rank's heads in kv_b_proj's weight."""
        first = tp_rank() * self.num_heads
        heads = tensor[first:first + self.num_heads]
        rows = self.kv_b_proj.weight.data.view(self.num_heads, self.nope + self.v_head_dim, self.kv_lora_rank)
        if part == "k_b_proj":
            rows[:, : self.nope].copy_(heads.transpose(1, 2))
        else:
            rows[:, self.nope:].copy_(heads)

    def after_weights_loaded(self) -> None:
        """Called by build_model once every layer has its compute form. The absorbed attention multiplies by
        kv_b_proj's weight itself, so a quantized kv_b_proj (FP8 DeepSeek-V3 checkpoints, --isq, GGUF) whose compute
        form keeps no float weight gets one: the layer applied to the identity is W^T (~33 MB a layer for V3)."""
        weight = self.kv_b_proj.weight
        expected = (self.num_heads * (self.nope + self.v_head_dim), self.kv_lora_rank)
        if tuple(weight.shape) == expected and weight.dtype in (torch.float32, torch.float16, torch.bfloat16):
            self.kv_b_weight = weight.data   # a plain reference (not a second parameter)
            return
        identity = torch.eye(self.kv_lora_rank, device=weight.device, dtype=self.kv_a_layernorm.weight.dtype)
        with torch.no_grad():
            self.register_buffer("kv_b_weight", self.kv_b_proj(identity).t().contiguous(), persistent=False)

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, c], W_UV [H, v, c]): views of kv_b_proj's float weight."""
        weight = getattr(self, "kv_b_weight", None)
        if weight is None:
            self.after_weights_loaded()
            weight = self.kv_b_weight
        per_head = weight.view(self.num_heads, self.nope + self.v_head_dim, self.kv_lora_rank)
        return per_head[:, : self.nope], per_head[:, self.nope:]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        tokens = hidden.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(tokens, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = self.rotary_emb(positions, q_pe.contiguous(), k_pe.contiguous())
        q_pe = q_pe.view(tokens, self.num_heads, self.rope)
        w_uk, w_uv = self._absorbed()
        key = torch.cat([latent, k_pe.view(tokens, self.rope)], dim=-1)
        ctx = current_forward_context()
        split = None if ctx is None else mla_prefill.split_step(ctx, self)
        if split is None:
            return self.o_proj(self._absorbed_attention(q_nope, q_pe, key, w_uk, w_uv).reshape(tokens, -1))
        # long prompts and chunks decompressed (mla_prefill.py), the other sequences in the absorbed form
        cache = self.attn.k_cache
        cached = key.view(tokens, 1, -1)
        ctx.backend.write_kv(cached, cached, cache, cache, ctx.slot_mapping)   # every token's latent, once
        out = torch.empty(tokens, self.num_heads, self.v_head_dim, dtype=key.dtype, device=key.device)
        if split.absorbed is not None:
            sub, rows = split.absorbed
            with forward_context(sub):
                out[rows] = self._absorbed_attention(q_nope[rows], q_pe[rows], key[rows], w_uk, w_uv)
        for seq in split.decompress:
            rows = slice(ctx.query_start_loc_cpu[seq], ctx.query_start_loc_cpu[seq + 1])
            out[rows] = mla_prefill.decompressed_attention(self, ctx, seq, q_nope[rows], q_pe[rows])
        return self.o_proj(out.reshape(tokens, -1))

    def _absorbed_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, key: torch.Tensor, w_uk: torch.Tensor,
                            w_uv: torch.Tensor) -> torch.Tensor:
        """The absorbed form over the latent cache (writing ``key``, the tokens' latents): [T, H, v_head_dim]."""
        tokens = q_nope.shape[0]
        query = torch.cat([torch.einsum("thd,hdc->thc", q_nope, w_uk), q_pe], dim=-1)
        out = self.attn(query, key, key).view(tokens, self.num_heads, self.kv_lora_rank)
        return torch.einsum("thc,hvc->thv", out, w_uv)
