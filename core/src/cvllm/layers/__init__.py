"""Backend-neutral building blocks that model plugins compose."""

from cvllm.layers.activation import GeluAndMul, SiluAndMul
from cvllm.layers.attention import Attention
from cvllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from cvllm.layers.fused_moe import (
    FusedMoE,
    FusedMoEMethod,
    UnquantizedFusedMoEMethod,
    load_weights_with_experts,
    select_experts,
)
from cvllm.layers.layernorm import LayerNorm, RMSNorm
from cvllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from cvllm.layers.rotary import RotaryEmbedding, get_rope

__all__ = [
    "Attention", "ColumnParallelLinear", "FusedMoE", "FusedMoEMethod", "GeluAndMul", "LayerNorm",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear", "RMSNorm", "ReplicatedLinear", "RotaryEmbedding", "RowParallelLinear", "SiluAndMul",
    "UnquantizedFusedMoEMethod", "VocabParallelEmbedding", "get_rope", "load_weights_with_experts", "select_experts",
]
