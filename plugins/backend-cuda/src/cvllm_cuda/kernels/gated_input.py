"""The gated activation left to the down projection's GEMV: an experiment, ``CVLLM_GATED_GEMV=1`` (off by default).

Why: at batch 1 a step's kernels run one after another, each waiting for the one before, and the MLP's
``silu(gate) * up`` is one of them a layer (1.1 us on the H100's critical path; the launch and its wait cost more).
The tensor-core GEMV of GPTQ/AWQ's 1-8 rows (quant_gemv_mma.py) can compute it as it loads x, each program its own
K slice, with no other program waited for; the activation's launch then drops out of the step. With fast exp and
division (mma_gemv_step.gated_words: the exact ones cost the GEMV a quarter of its programs an SM), so an input may be
a bf16 ulp off the activation kernel's, rarely. Not yet timed: ``bash bench/device/run_all.sh gatedgemv``.

How: ``silu_and_mul`` told the layer its output goes to (SiluAndMul.feeds) and that this layer's GEMV is that kernel
(``defers``) returns its output unwritten and leaves the gate+up tensor with the layer's weight (``defer``);
``quant_matmul`` takes it back (``take``) and hands it to the GEMV, or, where another kernel runs for that x, computes
the activation into the output first. By the output's address, as the int8 form's hand-over (quant_gemv_int8.py):
between the activation and the GEMV come reshapes that make new tensor objects over the same memory. So it relies on
the feeds link's promise (layers/decoder.feed): nothing reads the output before that linear layer does.
"""

from __future__ import annotations

import os

import torch

from cvllm_cuda.quant_planes import QuantWeight

ENABLED = os.environ.get("CVLLM_GATED_GEMV", "0") == "1"


def defers(feeds, rows: int, dtype: torch.dtype) -> QuantWeight | None:
    """The weight of ``feeds`` (the linear layer a gated activation's output [rows, K] goes to) whose GEMV would
    compute the activation itself, or None: switched off, another kind of layer (parts of different types, inputs
    reordered first: GPTQ's act-order) or another kernel for these rows."""
    weight = getattr(feeds, "quant_weight", None)
    if not ENABLED or weight is None or getattr(feeds, "quant_perm", None) is not None:
        return None
    from cvllm_cuda.kernels.quant_matmul import routes_to_mma

    return weight if routes_to_mma(weight, rows, dtype) else None


def defer(out: torch.Tensor, gate_up: torch.Tensor, weight: QuantWeight) -> None:
    """Leave ``gate_up`` ([rows, 2K], contiguous rows) with ``weight``: its next GEMV on ``out`` computes ``out``.
    ``out`` itself is held until then, so that no other tensor can take its memory meanwhile and pass for it."""
    weight.gated = (out, gate_up)


def take(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor | None:
    """The gate+up tensor left for x (``out`` or a view of it: the same memory and size), taken once; a stale one
    (its forward pass ended before its GEMV) is dropped."""
    pending, weight.gated = weight.gated, None
    if pending is None or pending[0].data_ptr() != x.data_ptr() or pending[0].numel() != x.numel():
        return None
    return pending[1]
