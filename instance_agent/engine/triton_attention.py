"""Triton paged-decode attention for CUDA: one query token per sequence against its paged KV.

Contract:
- `paged_decode_attention(query, kv_cache, block_tables, context_lens, scale)` returns
  ``[num_seqs, heads, head_dim]``, equal (up to float rounding) to the torch implementation in
  `attention.decode_attention_torch`. ``kv_cache`` is one layer's ``[2, num_blocks, block_size,
  kv_heads, head_dim]``; ``block_tables`` ``[num_seqs, max_blocks]`` may be padded past each
  sequence's ``context_lens`` entry.
- One program per (sequence, KV head) walks the sequence's blocks with an online softmax, serving all
  query heads of its group at once, so each KV block is read once per group. Accumulation is float32
  whatever the cache dtype.
- `supports(block_size)`: the kernel needs a power-of-two block size; callers fall back to torch
  otherwise. Triton is imported lazily, on first use; the kernel also runs under ``TRITON_INTERPRET=1``
  with CPU tensors, which is how CPU-only CI checks it.
"""

from __future__ import annotations

from typing import Any

import torch

_kernel: Any = None


def supports(block_size: int) -> bool:
    return block_size > 0 and block_size & (block_size - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _build_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode_kernel(
        out_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        block_tables_ptr,
        context_lens_ptr,
        scale,
        stride_q_seq,
        stride_q_head,
        stride_o_seq,
        stride_o_head,
        stride_kv_block,
        stride_kv_token,
        stride_kv_head,
        stride_bt_seq,
        GROUPS: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        context_len = tl.load(context_lens_ptr + seq)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_PAD)
        t = tl.arange(0, BLOCK_SIZE)
        g_mask = g < GROUPS
        d_mask = d < HEAD_DIM
        heads = kv_head * GROUPS + g
        q_mask = g_mask[:, None] & d_mask[None, :]
        q = tl.load(
            q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
            mask=q_mask,
            other=0.0,
        ).to(tl.float32)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
        num_blocks = tl.cdiv(context_len, BLOCK_SIZE)
        for b in range(0, num_blocks):
            block = tl.load(block_tables_ptr + seq * stride_bt_seq + b).to(tl.int64)
            t_mask = b * BLOCK_SIZE + t < context_len
            kv_offsets = (
                block * stride_kv_block
                + t[:, None] * stride_kv_token
                + kv_head * stride_kv_head
                + d[None, :]
            )
            kv_mask = t_mask[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, BLOCK_SIZE]
            s = tl.where(t_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )

    return paged_decode_kernel


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    global _kernel
    if _kernel is None:
        _kernel = _build_kernel()
    num_seqs, num_heads, head_dim = query.shape
    _, _, block_size, kv_heads, _ = kv_cache.shape
    if not supports(block_size):
        raise ValueError(
            f"the Triton decode kernel needs a power-of-two block size, got {block_size}"
        )
    if kv_cache.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError("query and KV cache need a contiguous head_dim")
    groups = num_heads // kv_heads
    out = torch.empty_like(query)
    block_tables = block_tables.contiguous()
    _kernel[(num_seqs, kv_heads)](
        out,
        query,
        kv_cache[0],
        kv_cache[1],
        block_tables,
        context_lens,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        GROUPS=groups,
        GROUP_PAD=max(_next_pow2(groups), 1),
        HEAD_DIM=head_dim,
        HEAD_PAD=_next_pow2(head_dim),
        BLOCK_SIZE=block_size,
    )
    return out
