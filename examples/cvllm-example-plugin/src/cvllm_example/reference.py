"""TinyGPT in plain torch, the oracle for the cvllm model: dense causal attention over the whole
sequence (no paging, no KV cache, no fused layers), reading the checkpoint's tensors by name.

It recomputes the full sequence for every generated token, so it is slow and only meant for tests.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


@dataclass(slots=True)
class GreedyResult:
    token_ids: list[int]
    logprobs: list[float]  # log-softmax of each chosen token
    margins: list[float]  # top-1 minus top-2 logit at each step: how far from a tie the choice was


class TinyGPTReference:
    def __init__(self, config: dict[str, Any], weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float64):
        self.config = config
        self.w = {name: tensor.to(dtype) for name, tensor in weights.items()}
        self.dtype = dtype
        self.num_heads = config["num_attention_heads"]
        self.head_dim = config["hidden_size"] // self.num_heads
        self.eps = config["rms_norm_eps"]
        self.act = {"gelu": "none", "gelu_pytorch_tanh": "tanh"}[config.get("hidden_act", "gelu")]

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str], dtype: torch.dtype = torch.float64) -> TinyGPTReference:
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        return cls(config, load_file(str(path / "model.safetensors")), dtype)

    def _rms_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Neox-style rotary embedding of ``x[T, heads, head_dim]``: the two halves of each head
        form the (real, imaginary) pairs."""
        half = self.head_dim // 2
        inv_freq = self.config["rope_theta"] ** (-torch.arange(half, dtype=self.dtype) * 2 / self.head_dim)
        angles = positions.to(self.dtype)[:, None] * inv_freq[None, :]  # [T, half]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def _attention(self, x: torch.Tensor, block: str) -> torch.Tensor:
        seq_len = x.shape[0]
        positions = torch.arange(seq_len)

        def heads(proj: str) -> torch.Tensor:
            return (x @ self.w[f"{block}.attn.{proj}.weight"].T).view(seq_len, self.num_heads, self.head_dim)

        q, k, v = self._rotate(heads("q_proj"), positions), self._rotate(heads("k_proj"), positions), heads("v_proj")
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.head_dim)
        future = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        out = torch.einsum("hqk,khd->qhd", weights, v).reshape(seq_len, -1)
        return out @ self.w[f"{block}.attn.o_proj.weight"].T

    def _mlp(self, x: torch.Tensor, block: str) -> torch.Tensor:
        fc_in, fc_out = f"{block}.mlp.fc_in", f"{block}.mlp.fc_out"
        up = x @ self.w[f"{fc_in}.weight"].T + self.w[f"{fc_in}.bias"]
        return F.gelu(up, approximate=self.act) @ self.w[f"{fc_out}.weight"].T + self.w[f"{fc_out}.bias"]

    @torch.no_grad()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """``[len(token_ids), vocab_size]``: the next-token logits after each prefix."""
        x = self.w["transformer.wte.weight"][torch.tensor(token_ids)]
        for i in range(self.config["num_hidden_layers"]):
            block = f"transformer.h.{i}"
            x = x + self._attention(self._rms_norm(x, f"{block}.ln_1.weight"), block)
            x = x + self._mlp(self._rms_norm(x, f"{block}.ln_2.weight"), block)
        return self._rms_norm(x, "transformer.ln_f.weight") @ self.w["lm_head.weight"].T

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> GreedyResult:
        tokens, result = list(prompt_ids), GreedyResult([], [], [])
        for _ in range(max_new_tokens):
            last = self.logits(tokens)[-1]
            top2 = last.topk(2)
            token = int(top2.indices[0])
            result.token_ids.append(token)
            result.logprobs.append(float(last.log_softmax(-1)[token]))
            result.margins.append(float(top2.values[0] - top2.values[1]))
            tokens.append(token)
        return result
