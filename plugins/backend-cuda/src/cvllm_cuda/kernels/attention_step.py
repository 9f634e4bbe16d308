"""One step of paged attention's inner loop (paged_attention._attention_kernel): BLOCK_N keys of one KV head
looked up in the block table, scored, and folded into the online softmax.

Values by key. A 16-bit V tile [keys, D] reaches the tensor cores as the second operand of P @ V through
``ldmatrix.trans``; 8-bit operands must lie contiguous along the reduction (the keys), and ldmatrix has no 8-bit
transpose on sm_90, so an e4m3 cache laid out like the 16-bit one was read from shared memory a byte at a time (128
LDS.U8 a thread a 64-key step: 1,488 SASS instructions in the loop against 873 for bf16, sm_90 compile). An FP8
value cache therefore keeps, within a page, each dimension's keys contiguous (``empty_value_cache``: vLLM's V
layout). A tile's keys are contiguous in runs of min(BLOCK_SIZE, BLOCK_N), aligned when its first key is (the
caller's start), which the loads are told so they copy 16 bytes at a time.

Masks. Slots past a sequence's length may hold anything (the cache is allocated uninitialised; NaN * 0 = NaN), so
values of keys that are not the sequence's must be zero, not only their probabilities. With values by key that zeroing
is a select per byte, so the caller takes the steps whose keys all lie below the sequence's length without any load
mask (``MASKED=False``) and only the last step masked.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # tl has no tanh; this form saturates cleanly to +-1 (no inf / inf)
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def attend_keys(acc, m_i, l_i, q, start, split_end, q_pos, table, k_cache_ptr, v_cache_ptr, kv_head, dims, dim_valid,
                scale, soft_cap, sliding_window, stride_cb, stride_cs, stride_ch, stride_vb, stride_vh, stride_vd,
                BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr,
                USE_SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr,
                VALUES_BY_KEY: tl.constexpr, MASKED: tl.constexpr):
    """(acc, m_i, l_i) after the keys start .. start + BLOCK_N - 1 (those below ``split_end`` count). ``MASKED``:
    keys of the step may lie past the sequence's length, their pages absent and their slots garbage; without it
    every key of the step is one of the sequence's (its K and V written, its page in the table). ``VALUES_BY_KEY``:
    V's keys contiguous within a page (``stride_v*``: its page's, head's and dimension's strides), else V is laid
    out as K is (``stride_c*``)."""
    keys = start + tl.arange(0, BLOCK_N)
    key_valid = keys < split_end
    if MASKED:
        page = tl.load(table + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
    else:
        page = tl.load(table + keys // BLOCK_SIZE).to(tl.int64)
    key_offset = page * stride_cb + (keys % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    if MASKED:
        k = tl.load(k_cache_ptr + key_offset[None, :] + dims[:, None],
                    mask=dim_valid[:, None] & key_valid[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
    else:
        k = tl.load(k_cache_ptr + key_offset[None, :] + dims[:, None], mask=dim_valid[:, None], other=0.0)
    if FP8:
        k = k.to(q.dtype)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
    if USE_SOFT_CAP:
        s = soft_cap * _tanh(s / soft_cap)
    visible = key_valid[None, :] & (keys[None, :] <= q_pos[:, None])
    if USE_WINDOW:
        visible = visible & (q_pos[:, None] - keys[None, :] < sliding_window)
    s = tl.where(visible, s, float("-inf"))

    # online softmax; a row that has seen no visible key yet keeps m = -inf, and subtracting 0
    # instead makes exp() give 0 rather than NaN
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_ref[:, None])
    alpha = tl.exp(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    if VALUES_BY_KEY:
        # runs of RUN keys share a page and lie contiguous there (the caller starts steps on a multiple of RUN)
        RUN: tl.constexpr = min(BLOCK_SIZE, BLOCK_N)
        value_offset = (page * stride_vb + kv_head * stride_vh + keys % BLOCK_SIZE)[:, None] + dims[None, :] * stride_vd
        value_offset = tl.max_contiguous(tl.multiple_of(value_offset, [RUN, 1]), [RUN, 1])
        if MASKED:
            # whole pages masked (runs keep their 16-byte copies), then the sequence's tail zeroed
            page_valid = (keys // BLOCK_SIZE) * BLOCK_SIZE < split_end
            v = tl.load(v_cache_ptr + value_offset, mask=page_valid[:, None] & dim_valid[None, :], other=0.0)
            v = tl.where(key_valid[:, None], v, 0.0)
        else:
            v = tl.load(v_cache_ptr + value_offset, mask=dim_valid[None, :], other=0.0)
    elif MASKED:   # V laid out as K is
        v = tl.load(v_cache_ptr + key_offset[:, None] + dims[None, :],
                    mask=key_valid[:, None] & dim_valid[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    else:
        v = tl.load(v_cache_ptr + key_offset[:, None] + dims[None, :], mask=dim_valid[None, :], other=0.0)
    if FP8:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i
