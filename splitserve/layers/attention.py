"""Paged attention over the KV pool, in PyTorch (the compiled decode kernel of ``cpu_kernels.cpp``
may stand in for the decode part: ``layers/ops.py``).

The model runner flattens every scheduled sequence's new tokens into one batch of ``T`` tokens.
``build_metadata`` describes that batch once per step; every layer reuses it::

    q:            [T, num_heads, head_dim]        new tokens of all sequences, concatenated
    k, v:         [T, num_kv_heads, head_dim]     their keys and values, written to the pool first
    kv_layer:     [num_pages, 2, page_size, num_kv_heads, head_dim]   one layer of the pool (2 = k, v)

A new token at position p attends to keys 0..p. **Decode** rows (``q_len == 1``) attend in one
call, through a padded block table [B, max_pages] of their pages. **Prefill** (``q_len > 1``) is
one SDPA call per sequence: a prompt from its start attends to its own new keys and values, a
later chunk or a recomputed sequence reads its earlier keys from its pages (the compiled kernel
reads every key from the pages, each row exactly as a decode row at its position would).
Grouped-query attention goes through SDPA's ``enable_gqa``. An int8 pool (``layers/kv_int8.py``)
is quantized by ``write_kv`` and dequantized on every read, the prompt's own new keys included (a
prompt attends to the keys decode will read).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

import torch
import torch.nn.functional as F

from splitserve.layers import kv_int8


class KVLayers(Protocol):
    """The KV cache as the attention sees it: one tensor per decoder layer, its pages (the engine's
    ``KVPool`` is one). The model reads and writes through it and never holds the pool's type."""

    def layer(self, layer: int) -> torch.Tensor:
        """Decoder layer ``layer``'s pages: [num_pages, 2, page_size, num_kv_heads, head_dim]."""
        ...


@dataclass
class SeqAttention:
    """One sequence of the batch: rows ``q_start .. q_start + q_len`` of ``q``, ``kv_len`` tokens
    in the cache after this step (the new ones included), held in ``page_table``."""

    q_start: int
    q_len: int
    kv_len: int
    page_table: Optional[torch.Tensor] = None  # [ceil(kv_len / page_size)] int64; prefill chunks only


@dataclass
class AttentionMetadata:
    slot_pages: torch.Tensor  # [T] int64: page of each new token's KV slot
    slot_offsets: torch.Tensor  # [T] int64: offset inside that page
    seqs: list[SeqAttention] = field(default_factory=list)  # every sequence, in batch order
    # decode sequences (q_len == 1), in batch order
    decode_rows: Optional[torch.Tensor] = None  # [B] their rows of q; None: rows 0..B-1
    block_table: Optional[torch.Tensor] = None  # [B, max_pages] int64, padded with page 0
    decode_lens: Optional[torch.Tensor] = None  # [B] int64 kv_len of each
    decode_mask: Optional[torch.Tensor] = None  # [B, 1, 1, max_pages * page_size] additive; None: no padding
    max_decode_len: int = 0
    prefills: list[SeqAttention] = field(default_factory=list)  # q_len > 1, in batch order

    @property
    def num_decode(self) -> int:
        return 0 if self.block_table is None else self.block_table.shape[0]

    @property
    def all_decode(self) -> bool:
        return not self.prefills


def build_metadata(seqs: Sequence[tuple[int, int, Sequence[int]]], page_size: int,
                   device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> AttentionMetadata:
    """Metadata of one step, once for all layers. ``seqs``: per sequence in batch order,
    ``(start, q_len, pages)``: tokens already in the cache, new tokens this step, and its pages
    (at least ``ceil((start + q_len) / page_size)`` of them). ``dtype``: of the queries (the mask's)."""
    slot_pages: list[int] = []
    slot_offsets: list[int] = []
    all_seqs, prefills = [], []
    decode_rows: list[int] = []
    decode_pages: list[Sequence[int]] = []
    decode_lens: list[int] = []
    row = 0
    for start, q_len, pages in seqs:
        kv_len = start + q_len
        n_pages = -(-kv_len // page_size)
        for pos in range(start, kv_len):
            slot_pages.append(pages[pos // page_size])
            slot_offsets.append(pos % page_size)
        s = SeqAttention(q_start=row, q_len=q_len, kv_len=kv_len)
        all_seqs.append(s)
        if q_len == 1:
            decode_rows.append(row)
            decode_pages.append(pages[:n_pages])
            decode_lens.append(kv_len)
        else:
            s.page_table = torch.tensor(pages[:n_pages], dtype=torch.long, device=device)
            prefills.append(s)
        row += q_len
    meta = AttentionMetadata(slot_pages=torch.tensor(slot_pages, dtype=torch.long, device=device),
                             slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=device),
                             seqs=all_seqs, prefills=prefills)
    if decode_rows:
        max_pages = max(len(p) for p in decode_pages)
        meta.block_table = torch.tensor([list(p) + [0] * (max_pages - len(p)) for p in decode_pages],
                                        dtype=torch.long, device=device)
        meta.decode_lens = torch.tensor(decode_lens, dtype=torch.long, device=device)
        meta.max_decode_len = max(decode_lens)
        if decode_rows != list(range(len(decode_rows))):
            meta.decode_rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
        width = max_pages * page_size
        if any(n != width for n in decode_lens):
            keys = torch.arange(width, device=device)
            hidden = keys[None, :] >= meta.decode_lens[:, None]  # [B, width]
            meta.decode_mask = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(
                hidden, float("-inf"))[:, None, None, :]
    return meta


def write_kv(kv_layer: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store the new keys and values ``kv`` [T, 2, Hkv, D] into one layer of the pool."""
    rows = kv_int8.quantize(kv) if kv_layer.dtype == torch.int8 else kv.to(kv_layer.dtype)
    kv_layer[meta.slot_pages, :, meta.slot_offsets] = rows


def gather_pages(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """One of k/v [num_pages, P, Hkv, D] gathered by ``table`` [..., n] -> [..., n * P, Hkv, D]."""
    pages = cache.index_select(0, table.flatten())  # [prod(table.shape), P, Hkv, D]
    return pages.view(*table.shape[:-1], table.shape[-1] * cache.shape[1], *cache.shape[2:])


def read_pages(cache: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``gather_pages`` in ``dtype``: an int8 pool's rows dequantized, [..., n * P, Hkv, D]."""
    rows = gather_pages(cache, table)
    return kv_int8.dequantize(rows, dtype) if cache.dtype == torch.int8 else rows


def decode_attention_reference(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                               scale: float) -> torch.Tensor:
    """The decode rows' attention, PyTorch only: q [B, H, D] -> [B, H, D]. Gathers every page of
    every decode sequence (one copy of its KV) and runs one padded SDPA."""
    k = read_pages(kv_layer[:, 0], meta.block_table, q.dtype).transpose(1, 2)  # [B, Hkv, L, D]
    v = read_pages(kv_layer[:, 1], meta.block_table, q.dtype).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.unsqueeze(2).to(k.dtype), k, v, attn_mask=meta.decode_mask,
                                       scale=scale, enable_gqa=True)  # [B, H, 1, D]
    return o.squeeze(2).to(q.dtype)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                      s: SeqAttention, scale: float) -> torch.Tensor:
    """One prefilling sequence: q [n, H, D], its new k, v [n, Hkv, D] -> [n, H, D]."""
    n = s.q_len
    if s.kv_len == n and kv_layer.dtype != torch.int8:  # from the start: the new keys are all there is
        ks, vs, mask, causal = k.transpose(0, 1), v.transpose(0, 1), None, True
    else:  # a later chunk (or int8 pages): the keys come from the pages
        ks = read_pages(kv_layer[:, 0], s.page_table, q.dtype)[:s.kv_len].transpose(0, 1)  # [Hkv, kv_len, D]
        vs = read_pages(kv_layer[:, 1], s.page_table, q.dtype)[:s.kv_len].transpose(0, 1)
        qpos = torch.arange(s.kv_len - n, s.kv_len, device=q.device).unsqueeze(1)
        mask, causal = torch.arange(s.kv_len, device=q.device).unsqueeze(0) <= qpos, False  # [n, kv_len]
    o = F.scaled_dot_product_attention(q.transpose(0, 1).to(ks.dtype), ks, vs, attn_mask=mask, is_causal=causal,
                                       scale=scale, enable_gqa=True)  # [H, n, D]
    return o.transpose(0, 1).to(q.dtype)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    decode: Callable = decode_attention_reference,
                    prefill: Callable = prefill_attention) -> torch.Tensor:
    """Attention of the new tokens [T, H, D] (their k, v [T, Hkv, D] already in ``kv_layer``).
    ``decode(q [B, H, D], kv_layer, meta, scale) -> [B, H, D]`` runs the decode rows,
    ``prefill(q [n, H, D], k, v [n, Hkv, D], kv_layer, s, scale) -> [n, H, D]`` each prefill chunk."""
    if meta.all_decode:
        return decode(q if meta.decode_rows is None else q[meta.decode_rows], kv_layer, meta, scale)
    out = torch.empty_like(q)
    if meta.num_decode:
        rows = meta.decode_rows if meta.decode_rows is not None else slice(0, meta.num_decode)
        out[rows] = decode(q[rows], kv_layer, meta, scale)
    for s in meta.prefills:
        rows = slice(s.q_start, s.q_start + s.q_len)
        out[rows] = prefill(q[rows], k[rows], v[rows], kv_layer, s, scale)
    return out
