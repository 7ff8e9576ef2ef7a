"""Linear layers that know how to load Hugging Face weights.

``MergedLinear`` stacks several projections of the same input along the output dim (q|k|v,
gate|up), so a layer does one matmul where the checkpoint stores several matrices; each part is
loaded from its own checkpoint tensor into the view ``part(name, kind)``.

Tensor parallelism (DESIGN §6) is not built. When it is, these loaders are where a rank takes its
slice: output-dim parts (q, k, v, gate, up) split by rows, ``o_proj``/``down_proj`` by columns
followed by an all-reduce. Nothing else in the models needs to change.
"""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
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

    def part(self, name: str, kind: str) -> torch.Tensor:
        """The rows of ``weight`` or ``bias`` (``kind``) that hold part ``name``: a view to load into."""
        start, size = self.offsets[name]
        return getattr(self, kind)[start:start + size]

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.sizes, dim=-1)
