"""Rotary position embeddings: default, linear, dynamic NTK, llama3, YaRN, LongRoPE; partial rotary.

The inverse frequencies follow transformers' ``modeling_rope_utils`` formulas so logits match it.
cos/sin are tabulated once per position (fp32) and looked up by position: no per-step trig.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from cvllm.backends.base import forward_backend
from cvllm.forward_context import current_forward_context


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def _llama3_inv_freq(p: dict[str, Any], dim: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(p["rope_theta"], dim)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(p: dict[str, Any], dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    base = p["rope_theta"]
    original_max = p.get("original_max_position_embeddings") or max_position
    factor = p.get("factor") or max_position / original_max
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def _longrope_angles(p: dict[str, Any], dim: int, positions: torch.Tensor,
                     max_position: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): ``short_factor`` for positions below ``original_max_position_embeddings``, ``long_factor``
    from there on. transformers picks one set for a whole sequence (long once it is longer than the original
    context); a per-position choice, as vLLM makes it, gives a position the same angles in every sequence, which
    chunked prefill and prefix caching need. The cos/sin scale is transformers' attention factor."""
    max_position = p.get("_max_position_embeddings", max_position)   # the config's, as transformers reads it
    original = p.get("original_max_position_embeddings") or max_position
    factor = p.get("factor") or max_position / original
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    if len(p["short_factor"]) != dim // 2 or len(p["long_factor"]) != dim // 2:
        raise ValueError(f"longrope: short_factor and long_factor need {dim // 2} values each (rotary dim {dim}), "
                         f"got {len(p['short_factor'])} and {len(p['long_factor'])}")
    base_freq = p["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    short = 1.0 / (torch.tensor(p["short_factor"], dtype=torch.float32) * base_freq)
    long = 1.0 / (torch.tensor(p["long_factor"], dtype=torch.float32) * base_freq)
    inv_freq = torch.where((positions < original)[:, None], short[None, :], long[None, :])  # [P, dim/2]
    return positions[:, None] * inv_freq, float(attention_factor)


def rope_frequencies(params: dict[str, Any], dim: int, max_position: int) -> torch.Tensor:
    """Per-position angles ``[max_position, dim // 2]`` (fp32) and the cos/sin scale, as a pair."""
    rope_type = params.get("rope_type", "default")
    positions = torch.arange(max_position, dtype=torch.float32)
    scale = 1.0
    if rope_type == "default":
        inv_freq = _base_inv_freq(params["rope_theta"], dim)
    elif rope_type == "linear":
        inv_freq = _base_inv_freq(params["rope_theta"], dim) / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(params, dim)
    elif rope_type == "yarn":
        inv_freq, scale = _yarn_inv_freq(params, dim, max_position)
    elif rope_type == "dynamic":
        # transformers rescales the base from the current sequence length (max(len, original)); a
        # position p is first seen in a sequence of length p + 1, so tabulate each position with
        # the base for that length. Inside the original context this is the plain base.
        original = params["_max_position_embeddings"]
        factor = params["factor"]
        seq_len = torch.clamp(positions + 1, min=original).double()
        bases = params["rope_theta"] * ((factor * seq_len / original) - (factor - 1)) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        inv_freq = (1.0 / (bases.float()[:, None] ** exponents[None, :]))  # [P, dim/2]
        return positions[:, None] * inv_freq, scale
    elif rope_type == "longrope":
        return _longrope_angles(params, dim, positions, max_position)
    else:
        raise ValueError(f"unsupported rope_type '{rope_type}' "
                         "(supported: default, linear, dynamic, llama3, yarn, longrope)")
    return positions[:, None] * inv_freq[None, :], scale


_tables: dict[tuple, torch.Tensor] = {}


def _cos_sin_table(key: str, params: dict[str, Any], dim: int, max_position: int) -> torch.Tensor:
    """``[max_position, dim]`` = cos ‖ sin, computed on the CPU once and shared by all layers."""
    cache_key = (key, dim, max_position)
    if cache_key not in _tables:
        with torch.device("cpu"):  # models are built under torch.device("meta")
            angles, scale = rope_frequencies(params, dim, max_position)
            _tables[cache_key] = torch.cat([angles.cos() * scale, angles.sin() * scale], dim=-1)
    return _tables[cache_key]


_copies: dict[tuple, torch.Tensor] = {}


def _shared_copy(table: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """One copy of a table per (device, dtype), shared by every layer that uses it."""
    key = (id(table), table.data_ptr(), str(device), dtype)
    if key not in _copies:
        _copies[key] = table.to(device=device, dtype=dtype)
    return _copies[key]


class RotaryEmbedding(nn.Module):
    """Neox-style rotation (``rotate_half``) of the first ``rotary_dim`` features of each head; ``interleaved``:
    GPT-J style, features (2i, 2i + 1) rotated as a pair (DeepSeek, GLM4); a backend's ``rotary`` kernel takes
    ``interleaved=True`` for it."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, params: dict[str, Any],
                 interleaved: bool = False):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        # A plain attribute, not a buffer: the model is built on the meta device and materialised
        # with to_empty(), which would leave a buffer uninitialised. Moved to the device on first use.
        self.table = _cos_sin_table(repr(sorted(params.items())), params, rotary_dim, max_position)  # fp32, CPU
        self.cos_sin = self.table   # the copy in use: on the activations' device and dtype

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos_sin = self.cos_sin_for(positions, q)
        backend = forward_backend()
        # the backend's kernel gathers cos/sin by position itself; None: it does not take these inputs (base.py)
        if backend is not None and backend.rotary is not None:
            pair = {"interleaved": True} if self.interleaved else {}
            if (out := backend.rotary(positions, q, k, cos_sin, self.head_dim, **pair)) is not None:
                return out
        if self.interleaved:
            return self._rotate_pairs(q, cos_sin[positions]), self._rotate_pairs(k, cos_sin[positions])
        cos, sin = self._lookup(positions)
        qk = _side_by_side(q, k)
        if qk is not None:  # the first columns of a fused qkv output: one rotation of both takes half the ops
            return self._rotate(qk, cos, sin).split([q.shape[-1], k.shape[-1]], dim=-1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def cos_sin_for(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The table ``[max_position, rotary_dim]`` (cos ‖ sin) on ``positions``' device in ``x``'s dtype, as
        the backends' fused kernels take it."""
        if self.cos_sin.device != positions.device or self.cos_sin.dtype != x.dtype:
            # cast once, not per call: transformers also computes cos/sin in fp32 and casts them to
            # the activations' dtype, so a table cast up front gives the same numbers
            self.cos_sin = _shared_copy(self.table, positions.device, x.dtype)
        return self.cos_sin

    def _lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos ‖ cos, -sin ‖ sin)`` of each position, ``[T, 1, rotary_dim]``: every layer of a forward
        pass rotates by the same positions, so inside one the lookup is made once and shared."""
        ctx = current_forward_context()
        key = (id(self.cos_sin), id(positions))
        if ctx is not None and key in ctx.per_step:
            return ctx.per_step[key][2:]
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)  # [T, rotary_dim/2] each
        cos, sin = torch.cat([cos, cos], dim=-1)[:, None], torch.cat([-sin, sin], dim=-1)[:, None]
        if ctx is not None:  # the tensors are kept with their key, so neither id can be reused meanwhile
            ctx.per_step[key] = (self.cos_sin, positions, cos, sin)
        return cos, sin

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x * cos + rotate_half(x) * sin, with rotate_half's negation folded into the sin table: the
        # same products and sums as transformers' apply_rotary_pos_emb, so the same rounding
        shape, half = x.shape, self.rotary_dim // 2
        x = x.view(shape[0], -1, self.head_dim)  # [T, H, D]
        rot = x[..., : self.rotary_dim] if self.rotary_dim != self.head_dim else x
        swapped = torch.cat([rot[..., half:], rot[..., :half]], dim=-1)
        rotated = rot * cos + swapped * sin
        if self.rotary_dim != self.head_dim:
            rotated = torch.cat([rotated, x[..., self.rotary_dim:]], dim=-1)
        return rotated.reshape(shape)


    def _rotate_pairs(self, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """(x[2i], x[2i+1]) -> (x[2i] cos - x[2i+1] sin, x[2i+1] cos + x[2i] sin): DeepSeek-V2's complex product,
        kept interleaved (V3's transformers code writes the evens then the odds: the same dot products)."""
        shape = x.shape
        x = x.reshape(shape[0], -1, self.head_dim)
        cos, sin = cos_sin[:, None].chunk(2, dim=-1)   # [T, 1, rotary_dim / 2]
        even, odd = x[..., : self.rotary_dim:2], x[..., 1: self.rotary_dim:2]
        rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
        if self.rotary_dim != self.head_dim:
            rotated = torch.cat([rotated, x[..., self.rotary_dim:]], dim=-1)
        return rotated.reshape(shape)


def _side_by_side(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """``[T, q + k]``, one view of both, when ``k``'s columns follow ``q``'s in the same rows of one buffer."""
    if q.dim() != 2 or k.dim() != 2 or q.stride() != k.stride() or q.stride(-1) != 1 or q.dtype != k.dtype:
        return None
    width = q.shape[1] + k.shape[1]
    adjacent = k.data_ptr() == q.data_ptr() + q.shape[1] * q.element_size() and q.stride(0) >= width
    same_buffer = q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    return q.as_strided((q.shape[0], width), q.stride()) if adjacent and same_buffer else None


def get_rope(head_dim: int, max_position: int, params: dict[str, Any], interleaved: bool = False) -> RotaryEmbedding:
    params = dict(params)
    params.setdefault("_max_position_embeddings", max_position)
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    return RotaryEmbedding(head_dim, rotary_dim, max_position, params, interleaved)
