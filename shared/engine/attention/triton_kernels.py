"""Triton kernels of the `triton` attention backend: paged attention that reads K/V in place through the block
tables, for decodes and prefill chunks alike, and the K/V write that a padded CUDA-graph batch can run.

Why Triton: it ships with every CUDA build of PyTorch (no wheel to fetch, nothing to compile at install), and
its kernels run in its interpreter on a CPU (TRITON_INTERPRET=1), so their logic is tested without a GPU.

`paged_attention`: one program per (request, tile of its queries, KV head). A program takes every query head
of its KV head (GQA: the group's heads share each K/V tile, read once) for BLOCK_Q query positions: its rows
are (position, head of the group) pairs, padded to a power of two. It walks the request's context BLOCK_N
tokens at a time, each token's slot found through the block table (block_id * block_size + offset), with an
online softmax in fp32, causal (a chunk's queries see the context before the chunk and the chunk up to
themselves) and optionally windowed. A decode-only batch (max_query_len == 1) has one tile per request, so
the grid depends on the batch size alone: what a CUDA graph captures.

`write_kv`: each new token's K and V into its slot; a negative slot (a padded row of a graph batch) writes
nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     value_offset, num_kv_heads, HEAD: tl.constexpr, HEAD_PAD: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        d = tl.arange(0, HEAD_PAD)
        dmask = d < HEAD
        dst = (slot * num_kv_heads + h) * HEAD + d
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=dmask)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=dmask)
        tl.store(cache_ptr + dst, k.to(cache_ptr.dtype.element_ty), mask=dmask)
        tl.store(cache_ptr + value_offset + dst, v.to(cache_ptr.dtype.element_ty), mask=dmask)


def write_kv(k, v, kv_cache, slot_mapping) -> None:
    """k, v [T, kvh, d] into kv_cache [2, blocks, bs, kvh, d] at slot_mapping[T] (int64; < 0: skipped)."""
    t, kvh, d = k.shape
    if t == 0:
        return
    value_offset = kv_cache[0].numel()
    _write_kv_kernel[(t, kvh)](k, v, kv_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               value_offset, kvh, HEAD=d, HEAD_PAD=triton.next_power_of_2(d))


@triton.jit
def _paged_attention_kernel(
    q_ptr, out_ptr, cache_ptr, tables_ptr, qsl_ptr, seq_lens_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
    value_offset, num_kv_heads, scale, window,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    r = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_start
    first_q = tile * BLOCK_Q
    if first_q < q_len:
        seq_len = tl.load(seq_lens_ptr + r)
        ctx_len = seq_len - q_len  # context before this chunk
        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
        q_in_chunk = first_q + rows // GROUP_PAD
        g = rows % GROUP_PAD
        row_ok = (q_in_chunk < q_len) & (g < GROUP)
        q_pos = ctx_len + q_in_chunk  # absolute position of each row's query
        d = tl.arange(0, HEAD_PAD)
        dmask = d < HEAD
        head = h * GROUP + g
        q = tl.load(q_ptr + (q_start + q_in_chunk)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & dmask[None, :], other=0.0)
        kv_end = ctx_len + tl.minimum(q_len, first_q + BLOCK_Q)  # the tile's last query sees keys below this
        # A window drops keys more than `window` positions before the tile's first query: start at their tile.
        kv_begin = ctx_len * 0
        if window > 0:
            kv_begin = (tl.maximum(ctx_len + first_q - window + 1, 0) // BLOCK_N) * BLOCK_N
        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_PAD], tl.float32)
        for start in range(kv_begin, kv_end, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < kv_end
            block = tl.load(tables_ptr + r * stride_table + n // BLOCK_SIZE, mask=n_ok, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
            row = (slot * num_kv_heads + h) * HEAD
            k = tl.load(cache_ptr + row[None, :] + d[:, None], mask=n_ok[None, :] & dmask[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, k.to(q.dtype), input_precision="ieee")
            else:
                s = tl.dot(q, k.to(q.dtype))
            s = s * scale
            keep = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
            keep = keep & ((window <= 0) | (n[None, :] > q_pos[:, None] - window))
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp(-inf) = 0
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            v = tl.load(cache_ptr + value_offset + row[:, None] + d[None, :], mask=n_ok[:, None] & dmask[None, :],
                        other=0.0)
            if IEEE:
                pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
            else:
                pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
            acc = acc * alpha[:, None] + pv
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (q_start + q_in_chunk)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dmask[None, :])


MIN_DOT_ROWS = 16  # tl.dot's smallest M


def paged_attention(q, out, kv_cache, block_tables, query_start_loc, seq_lens, num_reqs: int, max_query_len: int,
                    scale: float, window: int) -> None:
    """out[T, H, d] = attention of q[T, H, d] over each request's context in kv_cache (see the module doc)."""
    num_heads, head = q.shape[1], q.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # A decode has one query: its rows are the group's heads, padded up to tl.dot's minimum. A chunk takes as
    # many positions as make 64 rows.
    if max_query_len == 1:
        block_q = max(1, MIN_DOT_ROWS // group_pad)
    else:
        block_q = max(1, 64 // group_pad)
    head_pad = max(16, triton.next_power_of_2(head))
    block_n = 64 if block_size <= 64 else block_size
    grid = (num_reqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _paged_attention_kernel[grid](
        q, out, kv_cache, block_tables, query_start_loc, seq_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        kv_cache[0].numel(), num_kv_heads, scale, window,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD=head, HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, IEEE=q.dtype.itemsize == 4,
        num_warps=4, num_stages=2,
    )
