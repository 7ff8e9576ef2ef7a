"""The 8-bit KV cache's row format (``--kv-cache-dtype int8``), in PyTorch.

A page of an int8 pool holds, for every token and KV head, one row of ``head_dim + SCALE_BYTES``
bytes: the ``head_dim`` keys (or values) as int8, then their float32 scale (little-endian, as the
CPU stores it). So the scales live inside the page, a page stays one contiguous span for the
transfer, and a pool row reads as ``x = q * scale``.

Quantization is symmetric and per row: ``scale = absmax / 127``, ``q = round(x / scale)`` (half to
even), ``q = 0`` where ``absmax == 0``. Every operation is an exactly rounded float32 one, so the
same row always gives the same bits (a recomputed page equals the one it replaces), and the
compiled kernels' ``rope_store`` (``cpu_kernels.cpp``) writes the same bits from the same input.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 scale per (token, KV head) row
QMAX = 127.0


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Rows ``x`` [..., D] (any float dtype) -> int8 pool rows [..., D + SCALE_BYTES]."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / QMAX  # [..., 1]
    q = torch.where(scale > 0, torch.round(xf / scale), torch.zeros((), dtype=torch.float32))
    rows = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=torch.int8, device=x.device)
    rows[..., :x.shape[-1]] = q.clamp_(-QMAX, QMAX).to(torch.int8)
    rows[..., x.shape[-1]:] = scale.view(torch.int8)
    return rows


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scales [..., 1] of int8 pool rows [..., D + SCALE_BYTES]."""
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 pool rows [..., D + SCALE_BYTES] -> [..., D] in ``dtype`` (``q * scale`` in float32)."""
    return (rows[..., :-SCALE_BYTES].float() * scales(rows)).to(dtype)


def head_dim_of(kv_layer: torch.Tensor) -> int:
    """The head dim of a pool layer's rows, whichever their format."""
    return kv_layer.shape[-1] - (SCALE_BYTES if kv_layer.dtype == torch.int8 else 0)
