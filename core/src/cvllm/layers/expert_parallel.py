"""Expert parallelism: which of a MoE layer's experts this rank holds (``enable_expert_parallel``).

Rank r of N holds experts [r * E / N, (r + 1) * E / N) whole (all of the intermediate dimension), instead of a
1 / N slice of every expert. Routing stays global: the router is replicated, so every rank picks the same top-k
global ids for every token. Tensor parallelism here replicates the activations between layers, so every rank
already has every token: no dispatch is needed. Each rank runs its own experts on the tokens routed to them and
adds nothing for the pairs routed elsewhere; the one all-reduce that ends the layer (the row-parallel reduce of
the sharded form) then sums the ranks' partial outputs into the whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    """``num_experts`` global experts split over ``size`` ranks; this is ``rank``'s share. Size 1 holds all."""

    num_experts: int
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.num_experts % self.size:
            fits = [n for n in range(1, self.num_experts + 1) if self.num_experts % n == 0]
            raise ValueError(
                f"enable_expert_parallel: the model's {self.num_experts} experts do not split evenly over "
                f"{self.size} ranks; tensor_parallel_size values that would: {', '.join(map(str, fits))} "
                "(or leave expert parallelism off: each expert is then sharded over the ranks)")

    @property
    def num_local(self) -> int:
        return self.num_experts // self.size

    @property
    def start(self) -> int:
        """The global id of this rank's first expert; its local id 0."""
        return self.rank * self.num_local

    def local_id(self, expert: int) -> int | None:
        """Global id -> this rank's local id, None for an expert another rank holds."""
        local = expert - self.start
        return local if 0 <= local < self.num_local else None

    def expert_map(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``[E]`` int64: each global id's local id here, -1 for experts held elsewhere."""
        mapping = torch.full((self.num_experts,), -1, dtype=torch.long, device=device)
        mapping[self.start:self.start + self.num_local] = torch.arange(self.num_local, device=device)
        return mapping

    def localize(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """``expert_map`` applied to routed ids, with ``num_local`` (one past the last local expert, so such pairs
        sort last) instead of -1 for the pairs other ranks run. Arithmetic on the ids, not a lookup in a mapping
        tensor: nothing to keep on the device, and nothing read back to the host (CUDA graphs capture it)."""
        if self.size == 1:
            return topk_ids
        local = topk_ids - self.start
        return torch.where((local >= 0) & (local < self.num_local), local, self.num_local)
