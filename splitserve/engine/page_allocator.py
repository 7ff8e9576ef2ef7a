"""The page allocator: which KV pages are free. Its free count is exact at every moment.

Allocation prefers contiguous runs of page ids, because a contiguous run of pages is one
contiguous span of the page-major pool and so one transfer descriptor (``kv_pool.py``). A sequence
that grows asks for pages right after its last one first.

Pages are freed exactly once: freeing a page that is already free is a bug in the caller and
raises at once instead of corrupting the count.
"""

from __future__ import annotations

import bisect


class PageAllocator:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages))  # sorted ascending
        self._free_set: set[int] = set(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Take ``n`` free pages: continuing ``after`` if those are free, else the first contiguous
        run of ``n``, else the lowest free pages."""
        if n <= 0:
            return []
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV pages, {len(self._free)} free")
        pages = self._continuation(after, n) or self._first_run(n) or self._free[:n]
        for p in pages:
            self._free.pop(bisect.bisect_left(self._free, p))
            self._free_set.remove(p)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p in self._free_set or not 0 <= p < self.num_pages:
                raise ValueError(f"page {p} freed twice or out of range")
        for p in pages:
            bisect.insort(self._free, p)
            self._free_set.add(p)

    def _continuation(self, after: int | None, n: int) -> list[int] | None:
        if after is None:
            return None
        want = list(range(after + 1, after + 1 + n))
        return want if all(p in self._free_set for p in want) else None

    def _first_run(self, n: int) -> list[int] | None:
        free = self._free
        start = 0
        for i in range(1, len(free) + 1):
            if i == len(free) or free[i] != free[i - 1] + 1:
                if i - start >= n:
                    return free[start:start + n]
                start = i
        return None
