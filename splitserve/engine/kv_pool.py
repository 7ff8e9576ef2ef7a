"""The KV pool: one tensor per worker holding every layer's keys and values, in fixed-size pages.

Layout is page-major::

    buffer: [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]
                         (2 = key, value)

so one page of *all* layers is one contiguous span of ``page_nbytes`` bytes, and a run of
consecutive page ids is one contiguous span too. A KV transfer therefore needs one descriptor per
contiguous run of pages, not one per (layer, page) — descriptor count, not bytes, sets transfer
speed (docs/design.md §3). The attention layers see per-layer strided views of the same memory.

The pool owns memory only; which page belongs to whom is the page allocator's business
(``engine/page_allocator.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """The shape of a KV pool: what a peer must agree on before pages can cross (docs/design.md §3)."""

    num_pages: int
    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page across all layers, keys and values."""
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def total_tokens(self) -> int:
        return self.num_pages * self.page_size


class KVPool:
    """The memory of the KV cache. Shapes: see the module docstring."""

    def __init__(self, layout: KVLayout, device: str | torch.device = "cpu"):
        self.layout = layout
        self.buffer = torch.zeros(
            (layout.num_pages, layout.num_layers, 2, layout.page_size, layout.num_kv_heads, layout.head_dim),
            dtype=layout.dtype,
            device=device,
        )
        self._layers = [self.buffer[:, layer] for layer in range(layout.num_layers)]  # made once, read every step

    def layer(self, layer: int) -> torch.Tensor:
        """A view of one layer's keys and values, [num_pages, 2, page_size, num_kv_heads, head_dim]."""
        return self._layers[layer]

    @property
    def data_ptr(self) -> int:
        return self.buffer.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def page_offset(self, page: int) -> int:
        """Byte offset of a page from the start of the buffer."""
        return page * self.layout.page_nbytes

    def page_bytes(self, page: int) -> torch.Tensor:
        """One page as a flat uint8 view (for checks and the tcp backend)."""
        return self.buffer[page].view(-1).view(torch.uint8)
