"""``naive_attention``: causal attention in float64, written out, the reference attention kernels are checked against."""

from __future__ import annotations

import torch


def naive_attention(q, keys, values, positions, scale):
    """float64 attention of queries [n, H, D] at ``positions`` over keys/values [kv_len, Hkv, D] (causal)."""
    H, Hkv = q.shape[1], keys.shape[1]
    k = keys.double().repeat_interleave(H // Hkv, dim=1).transpose(0, 1)  # [H, L, D]
    v = values.double().repeat_interleave(H // Hkv, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, n, L]
    visible = torch.arange(keys.shape[0])[None, :] <= torch.tensor(positions)[:, None]  # [n, L]
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)  # [n, H, D]
