"""Linear layers that know how to load Hugging Face weights.

``MergedLinear`` stacks several projections of the same input along the output dim (q|k|v,
gate|up), so a layer does one matmul where the checkpoint stores several matrices; each part is
loaded from its own checkpoint tensor into the view ``part(name, kind)``. These loaders are where
a tensor-parallel rank would take its slice (``docs/design.md``; not built).

Quantized weights (``layers/quant.py``): a layer told ``expect_quantized(kind)`` before loading
(``models/quantized.py`` decides) makes no dense weight, collects its parts' raw blocks
(``stage_part``) and packs them as one ``QuantWeight`` (``finish_quantized``).

Dense float32 weights on CPU: ``Linear.pack_f32`` repacks each projection once into panels of 16
output columns for ``linear_f32_packed`` (``matmul_kernels.cpp``), which gives a row the same bits
whatever the batch. bfloat16 weights on CPU: ``Linear.pack`` swaps the dense weight for oneDNN's
packed copy once, instead of the reorder ``F.linear`` does on every call (the same bits, faster).

``shared_tensors`` names the tensors a layer's weight is held in once loaded and packed, so that
``models/packed_file.py`` can point them at one file all of a host's workers map (oneDNN's packed
copy stays private); ``shared_shapes`` and ``attach_shared`` take a weight from such a file.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.layers.quant import QuantWeight, packed_shape

log = logging.getLogger(__name__)


def packing_available(dtype: torch.dtype, device: torch.device | str) -> bool:
    """True where ``Linear.pack`` applies: bfloat16 on a CPU that oneDNN runs bf16 on."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(4, 4, dtype=dtype)
        y = packed_linear(torch.ones(1, 4, dtype=dtype), pack_weight(w, 1))
        return (bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
                and torch.equal(y, F.linear(torch.ones(1, 4, dtype=dtype), w)))
    except (AttributeError, RuntimeError) as exc:
        log.info("packed linear weights unavailable: %s", exc)
        return False


def pack_weight(weight: torch.Tensor, batch_hint: int = 16) -> torch.Tensor:
    """oneDNN's packed copy of a dense [out, in] weight (``batch_hint``: the row count it is tuned for)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` through a packed weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def placeholder(like: nn.Parameter) -> nn.Parameter:
    """An empty parameter of ``like``'s dtype and device, standing where a dense weight was."""
    return nn.Parameter(like.new_empty(0), requires_grad=False)


class Linear(nn.Linear):
    """``nn.Linear`` that may run through a packed weight (``pack``) or a quantized one (``quant``)."""

    packed: Optional[torch.Tensor] = None
    quant: Optional[QuantWeight] = None
    f32_packed: Optional[torch.Tensor] = None  # the weight in linear_f32_packed's panels (pack_f32)
    f32_linear: Optional[Callable] = None  # f32_linear(x, f32_packed, N, bias)
    quant_kind: Optional[str] = None  # set before loading: the weight arrives as raw blocks of it
    _staged: Optional[dict] = None

    def expect_quantized(self, kind: str) -> None:
        """The weight will arrive as raw ``kind`` blocks (``stage_part``): no dense copy is made."""
        self.quant_kind = kind
        self._staged = {}
        self.weight = placeholder(self.weight)

    def stage_part(self, part: Optional[str], raw: torch.Tensor) -> None:
        """Raw blocks [rows, bytes] of one part (None: the whole weight) of an ``expect_quantized`` layer."""
        self._staged[part] = raw

    def parts(self) -> list[Optional[str]]:
        return [None]

    def finish_quantized(self, ops) -> None:
        """Pack the staged parts, in order, into the layer's ``QuantWeight``."""
        raw = torch.cat([self._staged.pop(p) for p in self.parts()])
        self.quant = QuantWeight(self.quant_kind, raw, self.in_features, ops,
                                 None if self.bias is None else self.bias.detach())
        self._staged = None

    def pack(self, batch_hint: int = 16) -> None:
        """Keep only oneDNN's packed copy of the weight; the dense ``weight`` becomes an empty
        placeholder (load weights before packing)."""
        self.packed = pack_weight(self.weight.detach(), batch_hint)
        self.weight = placeholder(self.weight)

    def pack_f32(self, pack: Callable, linear: Callable) -> None:
        """Keep only the float32 weight repacked by ``pack`` (the kernels' ``f32_pack``), which every
        call then runs through ``linear`` (``linear_f32_packed``); ``weight`` becomes a placeholder."""
        self.f32_packed = pack(self.weight.detach().contiguous())
        self.f32_linear = linear
        self.weight = placeholder(self.weight)

    def shared_tensors(self) -> dict[str, Optional[torch.Tensor]]:
        """The tensors holding this layer's weight as it runs (None or empty: not held)."""
        return {**dict(self.named_parameters(recurse=False)), "f32_packed": self.f32_packed, "packed": self.packed,
                "quant": None if self.quant is None else self.quant.packed}

    def shared_shapes(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """What a layer made but not loaded needs from a shared file: attribute -> (dtype, shape)."""
        return _needed(self, self.out_features, self.in_features)

    def attach_shared(self, attr: str, tensor: torch.Tensor, ops) -> None:
        """Take ``attr`` (of ``shared_shapes``) as ``tensor``, a mapped file's view, instead of loading it."""
        _attach(self, attr, tensor, ops, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.linear(x)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        if self.f32_packed is not None:
            if x.dim() != 2:
                return self(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
            bias = None if self.bias is None else self.bias.detach()
            return self.f32_linear(x if x.stride(-1) == 1 else x.contiguous(), self.f32_packed, self.out_features, bias)
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """``y = x @ W.T (+ b)`` with ``W = cat([W_part for part in parts])``; ``parts`` maps a part name
    to its output size, in order. Output [T, sum(sizes)]; ``split(y)`` gives the parts back."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.sizes = list(parts.values())
        self.offsets: dict[str, tuple[int, int]] = {}  # part -> (start row, rows)
        start = 0
        for name, size in parts.items():
            self.offsets[name] = (start, size)
            start += size

    def parts(self) -> list[Optional[str]]:
        return list(self.offsets)

    def part(self, name: str, kind: str) -> torch.Tensor:
        """The rows of ``weight`` or ``bias`` (``kind``) that hold part ``name``: a view to load into."""
        start, size = self.offsets[name]
        return getattr(self, kind)[start:start + size]

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.sizes, dim=-1)


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose table may be a ``QuantWeight`` (the rows looked up are dequantized);
    a tied logits head shares it (``quant.linear``)."""

    quant: Optional[QuantWeight] = None
    quant_kind: Optional[str] = None
    _staged: Optional[dict] = None
    expect_quantized = Linear.expect_quantized
    stage_part = Linear.stage_part
    parts = Linear.parts

    def finish_quantized(self, ops) -> None:
        self.quant = QuantWeight(self.quant_kind, self._staged.pop(None), self.embedding_dim, ops)
        self._staged = None

    def shared_tensors(self) -> dict[str, Optional[torch.Tensor]]:
        """The tensors holding the table as it runs (a tied head reads the same ones)."""
        return {"weight": self.weight, "quant": None if self.quant is None else self.quant.packed}

    def shared_shapes(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return _needed(self, self.num_embeddings, self.embedding_dim)

    def attach_shared(self, attr: str, tensor: torch.Tensor, ops) -> None:
        _attach(self, attr, tensor, ops, self.num_embeddings, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.rows(ids).to(self.weight.dtype).view(*ids.shape, self.embedding_dim)
        return super().forward(ids)


def _needed(layer: nn.Module, N: int, K: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A layer's parameters that hold values, and its packed blocks if it expects quantized ones."""
    needed = {name: (str(p.dtype).removeprefix("torch."), tuple(p.shape))
              for name, p in layer.named_parameters(recurse=False) if p.numel()}
    if layer.quant_kind is not None:
        needed["quant"] = ("uint8", packed_shape(layer.quant_kind, N, K))
    return needed


@torch.no_grad()
def _attach(layer: nn.Module, attr: str, tensor: torch.Tensor, ops, N: int, K: int) -> None:
    if attr == "quant":  # after the bias (shared_tensors' order), which the kernel reads as float32
        bias = getattr(layer, "bias", None)
        layer.quant = QuantWeight.from_packed(layer.quant_kind, tensor, N, K, ops, bias)
        layer._staged = None
    elif attr in dict(layer.named_parameters(recurse=False)):
        getattr(layer, attr).set_(tensor)
    else:
        raise ValueError(f"{type(layer).__name__} has no shared tensor {attr!r}")
