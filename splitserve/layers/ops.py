"""The decoder's small per-layer ops, behind one interface with two implementations.

``TorchOps`` is the PyTorch reference (what the exact-match tests against ``transformers`` run);
``CompiledOps`` runs the same ops as fused C++ kernels (``cpu_kernels.cpp``), one pass and no
temporaries each. ``best_ops(device)`` picks the compiled one on CPU when it is built and not
switched off (``layers/kernels.py``), else the reference. Shapes::

    add_rms_norm(x [T, N] | None, residual [T, N], norm) -> (RMSNorm(residual + x) [T, N], residual + x)
    rope_tables(cos, sin [T, D/2] float32, dtype)        -> whatever rope_store takes, built once per step
    rope_store(qkv [T, (H + 2 Hkv) D], tables, H, Hkv, kv_layer, meta)  rotates q, k in place; stores k, v
    decode_attention(q [B, H, D], kv_layer, meta, scale) -> [B, H, D]   (the decode rows)
    prefill_attention(q [n, H, D], k, v [n, Hkv, D], kv_layer, s, scale) -> [n, H, D]   (one chunk)
    silu_mul(gate_up [T, 2I]) -> silu(gate) * up [T, I]                (the SwiGLU gate)
    linear, pack_linear, linear_packed     None, or the float32 matmuls (dense; packed once per weight)

``kv_layer``: [num_pages, 2, page_size, Hkv, D], one layer of the pool (``engine/kv_pool.py``); an
int8 pool's rows are ``D + 4`` bytes, the scale after the values (``layers/kv_int8.py``): both
implementations read and write them as they are.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F

from splitserve.layers import kernels
from splitserve.layers.kv_int8 import head_dim_of
from splitserve.layers.attention import (AttentionMetadata, SeqAttention, decode_attention_reference,
                                        prefill_attention, write_kv)


class TorchOps:
    name = "torch"
    linear = None
    pack_linear = None
    linear_packed = None

    def add_rms_norm(self, x: Optional[torch.Tensor], residual: torch.Tensor,
                     norm) -> tuple[torch.Tensor, torch.Tensor]:
        if x is not None:
            residual = residual + x
        return F.rms_norm(residual, norm.weight.shape, norm.weight, norm.eps), residual

    def rope_tables(self, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype):
        """cos, sin [T, D/2] -> [T, 1, D] cos and signed sin ([-sin, sin]) in ``dtype``: with them
        "rotate half" is one roll, ``x * cos + roll(x, D/2) * sin``."""
        return (torch.cat((cos, cos), dim=-1)[:, None, :].to(dtype),
                torch.cat((-sin, sin), dim=-1)[:, None, :].to(dtype))

    def rope_store(self, qkv: torch.Tensor, tables, H: int, Hkv: int, kv_layer: torch.Tensor,
                   meta: AttentionMetadata) -> None:
        cos, sin = tables
        T, D = qkv.shape[0], head_dim_of(kv_layer)
        qk = qkv[:, :(H + Hkv) * D].view(T, H + Hkv, D)
        torch.addcmul(qk * cos, torch.roll(qk, D // 2, dims=-1), sin, out=qk)
        write_kv(kv_layer, qkv[:, H * D:].view(T, 2, Hkv, D), meta)

    def decode_attention(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                         scale: float) -> torch.Tensor:
        return decode_attention_reference(q, kv_layer, meta, scale)

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                          s: SeqAttention, scale: float) -> torch.Tensor:
        return prefill_attention(q, k, v, kv_layer, s, scale)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class CompiledOps(TorchOps):
    """The same ops through the compiled kernels (float32 and bfloat16; CPU tensors)."""

    name = "compiled"

    def __init__(self, module: ModuleType):
        self.k = module
        self.linear = module.linear_f32
        self.pack_linear = module.f32_pack
        self.linear_packed = module.linear_f32_packed

    def add_rms_norm(self, x, residual, norm):
        return self.k.add_rms_norm(x, residual, norm.weight, norm.eps), residual  # residual updated in place

    def rope_tables(self, cos, sin, dtype):
        return cos.contiguous(), sin.contiguous()

    def rope_store(self, qkv, tables, H, Hkv, kv_layer, meta):
        self.k.rope_store(qkv, tables[0], tables[1], H, Hkv, kv_layer, meta.slot_pages, meta.slot_offsets)

    def decode_attention(self, q, kv_layer, meta, scale):
        return self.k.decode_attention(q, kv_layer, meta.block_table, meta.decode_lens, scale)

    def prefill_attention(self, q, k, v, kv_layer, s, scale):
        return self.k.prefill_attention(q, kv_layer, s.page_table, s.kv_len - s.q_len, scale)

    def silu_mul(self, gate_up):
        return self.k.silu_mul(gate_up)


def best_ops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> TorchOps:
    """The compiled ops where they apply and are available, else the PyTorch reference."""
    if torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        module = kernels.load()
        if module is not None:
            return CompiledOps(module)
    return TorchOps()
