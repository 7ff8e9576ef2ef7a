"""Quantized weights kept as GGUF blocks, and the matmul that runs on them (``matmul_kernels.cpp``).

A ``QuantWeight`` is an [N, K] matrix in one of ``TYPES`` (GGUF's Q8_0, Q4_0, Q4_1, Q4_K: the
file's own block bytes, repacked once into groups of 8 output rows for the kernel). It serves a
linear layer (``linear(x)``: the activations quantized per block of 32 as llama.cpp does, an exact
integer dot product per block, scaled and summed in float32 in a fixed order) and an embedding
(``rows(ids)``: the rows dequantized exactly as the ``gguf`` library dequantizes them). Shapes::

    raw     [N, K / block * block_bytes] uint8   the file's rows (``gguf.GGUFReader`` tensor data)
    x       [M, K] float32 or bfloat16          -> linear -> [M, N], x's dtype
    ids     [T] int64                           -> rows   -> [T, K] float32

Batch invariance: every output element is computed by the same operations in the same order
whatever ``M`` is and whichever other rows share the call, so a row gives the same bits alone, in
a decode batch or inside a prefill chunk (``matmul_kernels.cpp`` says how).

The kernels are the compiled ones (``layers/kernels.py``); without them no weight stays quantized
(``models/quantized.py`` expands them instead).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

# GGML type name -> (type id, values per block, bytes per block of one row)
TYPES = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144)}


def row_bytes(kind: str, K: int) -> int:
    """Bytes of one row of K values in ``kind``; ValueError if K is not a whole number of blocks."""
    _, block, nbytes = TYPES[kind]
    if K % block:
        raise ValueError(f"{kind} rows hold whole blocks of {block} values; {K} is not a multiple")
    return K // block * nbytes


class RawQuant(NamedTuple):
    """A checkpoint tensor as raw blocks: what the loader hands a layer that stays quantized."""

    kind: str
    raw: torch.Tensor  # [N, row_bytes(kind, K)] uint8
    shape: tuple[int, int]  # (N, K): the matrix it holds


PACKED_ROWS = 8  # quant_pack's group of output rows
# bytes of one row's block once packed (Q4_K: its scales unpacked)
PACKED_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 148}


def packed_shape(kind: str, N: int, K: int) -> tuple[int, int]:
    """The shape of ``quant_pack``'s output for an [N, K] matrix of ``kind``: [groups of 8 rows, bytes]."""
    row_bytes(kind, K)
    return -(-N // PACKED_ROWS), K // TYPES[kind][1] * PACKED_ROWS * PACKED_BLOCK_BYTES[kind]


class QuantWeight:
    """An [N, K] weight of ``kind`` packed for ``ops`` (the compiled kernels' namespace)."""

    def __init__(self, kind: str, raw: torch.Tensor, K: int, ops, bias: Optional[torch.Tensor] = None):
        if kind not in TYPES:
            raise ValueError(f"no kernel for {kind}; quantized types with one: {', '.join(TYPES)}")
        if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes(kind, K):
            raise ValueError(f"{kind} weight: raw rows [{tuple(raw.shape)}] {raw.dtype} do not hold K = {K}")
        self._set(kind, raw.shape[0], K, ops, ops.quant_pack(raw.contiguous(), TYPES[kind][0], K), bias)

    @classmethod
    def from_packed(cls, kind: str, packed: torch.Tensor, N: int, K: int, ops,
                    bias: Optional[torch.Tensor] = None) -> "QuantWeight":
        """The weight from blocks ``quant_pack`` already packed (a shared file's): no copy is made."""
        if kind not in TYPES:
            raise ValueError(f"no kernel for {kind}; quantized types with one: {', '.join(TYPES)}")
        if packed.dtype != torch.uint8 or tuple(packed.shape) != packed_shape(kind, N, K) or not packed.is_contiguous():
            raise ValueError(f"{kind} [{N}, {K}]: packed blocks [{tuple(packed.shape)}] {packed.dtype} do not fit")
        weight = cls.__new__(cls)
        weight._set(kind, N, K, ops, packed, bias)
        return weight

    def _set(self, kind: str, N: int, K: int, ops, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        self.kind, self.type_id = kind, TYPES[kind][0]
        self.N, self.K = N, K
        self.ops = ops
        self.packed = packed
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> x @ W.T (+ bias) [..., N] in x's dtype."""
        if x.dim() != 2:
            return self.linear(x.reshape(-1, self.K)).reshape(*x.shape[:-1], self.N)
        if x.stride(-1) != 1:
            x = x.contiguous()
        return self.ops.quant_linear(x, self.packed, self.type_id, self.N, self.bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids`` [T] dequantized: [T, K] float32."""
        return self.ops.quant_rows(self.packed, self.type_id, self.N, self.K, ids.reshape(-1).long())

    def dequantize(self) -> torch.Tensor:
        """The whole matrix [N, K] float32 (what the ``gguf`` library's dequantizer gives)."""
        return self.rows(torch.arange(self.N))

    def __repr__(self) -> str:
        return f"QuantWeight({self.kind}, [{self.N}, {self.K}], {self.nbytes / 2**20:.1f} MiB)"
