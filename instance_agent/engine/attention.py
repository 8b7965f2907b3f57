"""Paged attention over the engine's block-structured KV cache (torch implementation).

Contract:
- The KV cache of one layer is ``[2, num_blocks, block_size, kv_heads, head_dim]`` (tokens-first); a
  token's slot is ``block_id * block_size + offset``. `store_kv` writes the step's keys and values at
  their slots before attention reads them.
- A step is one flattened batch: first the decodes (one query token each), then the prefill chunks
  (``query_len`` tokens continuing after ``num_computed`` tokens whose KV is already in the cache, from
  an earlier chunk or a prefix-cache hit). `AttentionMetadata` describes that layout once per step;
  masks and block tables are built there, not per layer.
- Query token j of a chunk attends to keys ``0 .. num_computed + j`` (causal with an offset). Grouped
  query attention maps query head h to KV head ``h // (heads / kv_heads)``.
- `paged_attention` is the CPU path (gather by block table + SDPA). On CUDA the decodes go through the
  Triton kernel in `triton_attention` (same results up to float rounding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillChunk:
    query_start: int  # offset of the chunk's first token in the flattened batch
    query_len: int
    num_computed: int  # tokens before the chunk whose KV is already cached
    block_ids: torch.Tensor  # long, blocks covering num_computed + query_len tokens
    mask: torch.Tensor | None  # bool [query_len, num_computed + query_len]; None: plain causal


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # long [num_tokens]
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # long [num_decodes, max_blocks], padded
    decode_context_lens: torch.Tensor | None = None  # int32 [num_decodes]
    decode_mask: torch.Tensor | None = None  # bool [num_decodes, 1, 1, max_blocks * block_size]
    prefills: list[PrefillChunk] = field(default_factory=list)
    use_triton: bool = False
    workspace: torch.Tensor | None = None  # flat scratch for gathered decode KV (CPU path)


def build_metadata(
    block_size: int,
    decodes: list[tuple[list[int], int]],
    prefills: list[tuple[int, list[int], int, int]],
    slot_mapping: torch.Tensor,
    device: torch.device,
    use_triton: bool = False,
) -> AttentionMetadata:
    """Metadata of one step.

    `decodes`: (block_ids, context_len) per decode, in batch order. `prefills`: (query_start,
    block_ids, num_computed, query_len) per prefill chunk, in batch order after the decodes.
    """
    meta = AttentionMetadata(
        slot_mapping=slot_mapping, num_decodes=len(decodes), use_triton=use_triton
    )
    if decodes:
        max_blocks = max(len(ids) for ids, _ in decodes)
        table = torch.zeros(len(decodes), max_blocks, dtype=torch.long)
        for row, (ids, _) in enumerate(decodes):
            table[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        lens = torch.tensor([n for _, n in decodes], dtype=torch.int32)
        meta.decode_block_tables = table.to(device)
        meta.decode_context_lens = lens.to(device)
        if not use_triton:
            positions = torch.arange(max_blocks * block_size)
            valid = positions[None, :] < lens[:, None]
            meta.decode_mask = valid[:, None, None, :].to(device)
    for query_start, ids, num_computed, query_len in prefills:
        mask: torch.Tensor | None = None
        if num_computed:
            keys = torch.arange(num_computed + query_len)
            queries = torch.arange(query_len) + num_computed
            mask = (keys[None, :] <= queries[:, None]).to(device)
        meta.prefills.append(
            PrefillChunk(
                query_start=query_start,
                query_len=query_len,
                num_computed=num_computed,
                block_ids=torch.tensor(ids, dtype=torch.long, device=device),
                mask=mask,
            )
        )
    return meta


def store_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write keys/values ``[num_tokens, kv_heads, head_dim]`` into their slots of one layer's cache."""
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def gather_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[num_tokens, kv_heads, head_dim]`` of the first tokens of a block table."""
    _, _, block_size, kv_heads, head_dim = kv_cache.shape
    n_blocks = -(-num_tokens // block_size)
    # index_select copies K and V in one pass (advanced indexing is 2-3x slower on CPU).
    kv = kv_cache.index_select(1, block_ids[:n_blocks])
    kv = kv.view(2, n_blocks * block_size, kv_heads, head_dim)
    return kv[0, :num_tokens], kv[1, :num_tokens]


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention output ``[num_tokens, heads, head_dim]`` for one layer; stores the step's KV first."""
    store_kv(kv_cache, key, value, meta.slot_mapping)
    out = torch.empty_like(query)
    nd = meta.num_decodes
    if nd:
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        if meta.use_triton:
            from instance_agent.engine.triton_attention import paged_decode_attention

            out[:nd] = paged_decode_attention(
                query[:nd], kv_cache, meta.decode_block_tables, meta.decode_context_lens, scale
            )
        else:
            assert meta.decode_mask is not None
            out[:nd] = decode_attention_torch(
                query[:nd],
                kv_cache,
                meta.decode_block_tables,
                meta.decode_mask,
                scale,
                meta.workspace,
            )
    groups = query.shape[1] // key.shape[1]
    for chunk in meta.prefills:
        q_slice = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        if chunk.num_computed:
            k_all, v_all = gather_kv(
                kv_cache, chunk.block_ids, chunk.num_computed + chunk.query_len
            )
        else:  # nothing cached before the chunk: its own KV is all there is
            k_all, v_all = key[q_slice], value[q_slice]
        # 4-D inputs with KV repeated per query head take SDPA's fused CPU kernel; 3-D inputs or
        # enable_gqa fall back to slower paths (3-10x slower on long prompts).
        o = F.scaled_dot_product_attention(
            query[q_slice].transpose(0, 1)[None],
            k_all.transpose(0, 1).repeat_interleave(groups, dim=0)[None],
            v_all.transpose(0, 1).repeat_interleave(groups, dim=0)[None],
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
        )
        out[q_slice] = o[0].transpose(0, 1)
    return out


def decode_attention_torch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence against its paged context; padding masked out.

    `workspace`, if given, is a flat buffer of at least ``2 * n * length * kv_heads * head_dim``
    elements that receives the gathered KV: reusing it across layers and steps saves allocating
    (and page-faulting) megabytes per layer.
    """
    n, _, _ = query.shape
    _, _, block_size, kv_heads, head_dim = kv_cache.shape
    length = block_tables.shape[1] * block_size
    index = block_tables.flatten()
    shape = (2, index.numel(), block_size, kv_heads, head_dim)
    if workspace is None:
        kv = kv_cache.index_select(1, index)
    else:
        kv = torch.index_select(kv_cache, 1, index, out=workspace[: math.prod(shape)].view(shape))
    kv = kv.view(2, n, length, kv_heads, head_dim)
    k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)
    o = F.scaled_dot_product_attention(
        query[:, :, None, :], k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return o[:, :, 0, :]
