"""Paged attention in pure PyTorch (runs on CPU; a GPU kernel may later sit behind the same call).

The model runner flattens every scheduled sequence's new tokens into one batch of ``T`` tokens and
describes, per sequence, where those tokens sit and where its KV lives::

    q:            [T, num_heads, head_dim]       new tokens of all sequences, concatenated
    k, v:         [T, num_kv_heads, head_dim]    their keys and values (written to the pool first)
    slot_pages:   [T] page id of each new token's KV slot
    slot_offsets: [T] offset inside that page
    per sequence: q_start, q_len (its slice of T), kv_len (tokens in cache after this step,
                  including the new ones), page_table [ceil(kv_len / page_size)]

A new token at absolute position p attends to keys 0..p (causal); the new tokens are the last
``q_len`` of the sequence's ``kv_len`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class SeqAttention:
    q_start: int
    q_len: int
    kv_len: int
    page_table: torch.Tensor  # [ceil(kv_len / page_size)] int64


@dataclass
class AttentionMetadata:
    slot_pages: torch.Tensor  # [T] int64
    slot_offsets: torch.Tensor  # [T] int64
    seqs: list[SeqAttention] = field(default_factory=list)

    @property
    def all_decode(self) -> bool:
        return all(s.q_len == 1 for s in self.seqs)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Store new keys/values [T, Hkv, D] into one layer's cache views [num_pages, page_size, Hkv, D]."""
    k_cache[meta.slot_pages, meta.slot_offsets] = k.to(k_cache.dtype)
    v_cache[meta.slot_pages, meta.slot_offsets] = v.to(v_cache.dtype)


def _gather(cache: torch.Tensor, page_table: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[num_pages, P, Hkv, D] -> [kv_len, Hkv, D] for one sequence."""
    pages = cache.index_select(0, page_table.to(cache.device))  # [n, P, Hkv, D]
    return pages.reshape(-1, *cache.shape[2:])[:kv_len]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of the new tokens over each sequence's cached KV. Returns [T, num_heads, head_dim]."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    gqa = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if meta.seqs and meta.all_decode and len(meta.seqs) > 1:
        return _batched_decode(q, k_cache, v_cache, meta, scale, gqa)
    for s in meta.seqs:
        qs = q[s.q_start:s.q_start + s.q_len].transpose(0, 1)  # [H, q_len, D]
        ks = _gather(k_cache, s.page_table, s.kv_len).transpose(0, 1)  # [Hkv, kv_len, D]
        vs = _gather(v_cache, s.page_table, s.kv_len).transpose(0, 1)
        if gqa > 1:
            ks = ks.repeat_interleave(gqa, dim=0)
            vs = vs.repeat_interleave(gqa, dim=0)
        if s.q_len == 1:
            mask = None
        else:
            # query i sits at absolute position kv_len - q_len + i and sees keys <= that position
            qpos = torch.arange(s.kv_len - s.q_len, s.kv_len, device=q.device).unsqueeze(1)
            mask = torch.arange(s.kv_len, device=q.device).unsqueeze(0) <= qpos  # [q_len, kv_len]
        o = F.scaled_dot_product_attention(qs.to(ks.dtype), ks, vs, attn_mask=mask, scale=scale)
        out[s.q_start:s.q_start + s.q_len] = o.transpose(0, 1).to(out.dtype)
    return out


def _batched_decode(q, k_cache, v_cache, meta, scale, gqa):
    """All sequences decode one token: pad their KV to the longest and run one masked SDPA."""
    B = len(meta.seqs)
    max_len = max(s.kv_len for s in meta.seqs)
    page_size = k_cache.shape[1]
    max_pages = (max_len + page_size - 1) // page_size
    table = torch.zeros((B, max_pages), dtype=torch.long)
    lens = torch.empty(B, dtype=torch.long)
    for i, s in enumerate(meta.seqs):
        table[i, :len(s.page_table)] = s.page_table
        lens[i] = s.kv_len
    table, lens = table.to(k_cache.device), lens.to(k_cache.device)
    ks = k_cache[table].flatten(1, 2)[:, :max_len]  # [B, max_len, Hkv, D]
    vs = v_cache[table].flatten(1, 2)[:, :max_len]
    ks, vs = ks.transpose(1, 2), vs.transpose(1, 2)  # [B, Hkv, L, D]
    if gqa > 1:
        ks = ks.repeat_interleave(gqa, dim=1)
        vs = vs.repeat_interleave(gqa, dim=1)
    mask = (torch.arange(max_len, device=k_cache.device).unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]  # [B,1,1,L]
    qb = q.unsqueeze(2).to(ks.dtype)  # q rows are in sequence order: [B, H, 1, D]
    o = F.scaled_dot_product_attention(qb, ks, vs, attn_mask=mask, scale=scale)
    return o.squeeze(2).to(q.dtype)
