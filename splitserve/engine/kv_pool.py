"""The KV pool: one tensor per worker holding every layer's keys and values, in fixed-size pages.

Layout is page-major::

    buffer: [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]
                         (2 = key, value)

so one page of *all* layers is one contiguous span of ``page_nbytes`` bytes, and a run of
consecutive page ids is one contiguous span too: a KV transfer needs one descriptor per run of
pages (``docs/design.md``, few descriptors per transfer). The attention layers see per-layer
strided views of the same memory.

``--kv-cache-dtype int8`` makes the buffer int8 with rows of ``head_dim + 4`` bytes: each (token,
KV head) row's 8-bit values, then its float32 scale (``layers/kv_int8.py``), so the layout above
holds as it is. ``dtype`` stays the model's compute dtype either way. The pool owns memory only;
which page belongs to whom is the page allocator's business (``engine/page_allocator.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.discovery.record import KV_CACHE_DTYPES
from splitserve.layers.kv_int8 import SCALE_BYTES


@dataclass(frozen=True)
class KVLayout:
    """The shape of a KV pool: what a peer must agree on before pages can cross (docs/design.md §3)."""

    num_pages: int
    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model's compute dtype
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: one of {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache_dtype!r}")

    @property
    def storage_dtype(self) -> torch.dtype:
        """The buffer's element type."""
        return torch.int8 if self.kv_cache_dtype == "int8" else self.dtype

    @property
    def row_elements(self) -> int:
        """Elements of one (token, KV head) row of keys or values: its scale's bytes included for int8."""
        return self.head_dim + SCALE_BYTES if self.kv_cache_dtype == "int8" else self.head_dim

    @property
    def element_size(self) -> int:
        return self.storage_dtype.itemsize

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page across all layers, keys and values."""
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.row_elements * self.element_size

    @property
    def pages_dtype(self) -> str:
        """What a page holds, as the handshake compares it: ``bfloat16``, or ``int8`` rows of a
        ``bfloat16`` model (``int8/bfloat16``)."""
        compute = str(self.dtype).removeprefix("torch.")
        return compute if self.kv_cache_dtype == "auto" else f"{self.kv_cache_dtype}/{compute}"

    @property
    def total_tokens(self) -> int:
        return self.num_pages * self.page_size


class KVPool:
    """The memory of the KV cache. Shapes: see the module docstring."""

    def __init__(self, layout: KVLayout, device: str | torch.device = "cpu"):
        self.layout = layout
        self.buffer = torch.zeros(
            (layout.num_pages, layout.num_layers, 2, layout.page_size, layout.num_kv_heads, layout.row_elements),
            dtype=layout.storage_dtype,
            device=device,
        )
        self._layers = [self.buffer[:, layer] for layer in range(layout.num_layers)]  # made once, read every step

    def layer(self, layer: int) -> torch.Tensor:
        """A view of one layer's keys and values, [num_pages, 2, page_size, num_kv_heads, row_elements]."""
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
