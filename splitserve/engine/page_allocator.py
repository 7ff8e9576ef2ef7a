"""The page allocator and the prefix cache: which KV pages are free, cached or owned — an exact
account at every moment (``free + cached + owned = total``).

- **free**: in no one's hands; ``allocate`` takes them.
- **owned**: held by a sequence or a room (several at once for a shared cached page: its
  reference count); quarantined pages of a disaggregated role count as owned.
- **cached**: a full page whose KV stays indexed for reuse with no owner left; evictable (least
  recently used first), so a full cache never makes anyone wait.

A full computed page is indexed by a key chaining its tokens with every page before it and the
request's ``cache_salt`` (:func:`page_keys`; ``docs/prefix_cache.md``). A new sequence takes the
longest run of its prompt's pages found in the index (``match``) and computes only the rest. A
cached page is read-only: nothing is ever written into it, and a disaggregated decode never lets a
remote write target one. Allocation prefers contiguous runs of page ids (one transfer descriptor
per run, ``kv_pool.py``). Pages are released exactly once per reference: releasing a page that is
free, or a cached page no one references, raises at once instead of corrupting the account.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Optional

PageKey = bytes


def salt_key(salt: str) -> PageKey:
    """The key a chain of page keys starts from: the hash of the request's ``cache_salt``. Any
    string hashes (``surrogatepass``: a lone surrogate, refused at the edge anyway, cannot make it
    raise), and different strings hash apart."""
    return hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def page_keys(tokens: Sequence[int], page_size: int, n_pages: int, salt: str = "",
              parent: Optional[PageKey] = None) -> list[PageKey]:
    """The keys of the first ``n_pages`` full pages of ``tokens`` (after the page whose key is
    ``parent``, if given: then ``tokens`` start at that page's end; else from ``salt_key(salt)``)."""
    keys: list[PageKey] = []
    prev = parent if parent is not None else salt_key(salt)
    for i in range(n_pages):
        page = tokens[i * page_size:(i + 1) * page_size]
        if len(page) < page_size:
            break
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(b"".join(t.to_bytes(8, "little", signed=True) for t in page))
        prev = h.digest()
        keys.append(prev)
    return keys


class PageAllocator:
    def __init__(self, num_pages: int, cache: bool = True):
        self.num_pages = num_pages
        self.cache_enabled = cache
        self._free: list[int] = list(range(num_pages))  # sorted ascending
        self._free_set: set[int] = set(self._free)
        self._page_of: dict[PageKey, int] = {}  # the index: key -> its cached page
        self._key_of: dict[int, PageKey] = {}  # cached page -> its key
        self._refs: dict[int, int] = {}  # cached page -> owners now (0: evictable, in _lru)
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, oldest first
        self.evictions = 0
        self.hit_pages = 0

    # -- the account ------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Cached pages no one owns: evictable."""
        return len(self._lru)

    @property
    def num_owned(self) -> int:
        return self.num_pages - self.num_free - self.num_cached

    @property
    def num_available(self) -> int:
        """What an allocation can get: free pages and evictable cached ones."""
        return len(self._free) + len(self._lru)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_available

    # -- owning pages -----------------------------------------------------------------------------

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Take ``n`` pages, evicting least recently used cached pages if too few are free:
        continuing ``after`` if those are free, else the first contiguous run of ``n``, else the
        lowest free pages."""
        if n <= 0:
            return []
        if n > self.num_available:
            raise MemoryError(f"asked for {n} KV pages, {self.num_available} available")
        while len(self._free) < n:
            self._evict_oldest()
        pages = self._continuation(after, n) or self._first_run(n) or self._free[:n]
        for p in pages:
            self._free.pop(bisect.bisect_left(self._free, p))
            self._free_set.remove(p)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Give back one reference to each page: a plain page becomes free; a cached one loses an
        owner and, with none left, stays cached and evictable."""
        for p in pages:
            if p in self._free_set or not 0 <= p < self.num_pages or (p in self._key_of and not self._refs[p]):
                raise ValueError(f"page {p} freed twice or out of range")
        for p in pages:
            if p in self._key_of:
                self._refs[p] -= 1
                if not self._refs[p]:
                    self._lru[p] = None
            else:
                bisect.insort(self._free, p)
                self._free_set.add(p)

    # -- the prefix cache ---------------------------------------------------------------------------

    def match(self, keys: Sequence[PageKey]) -> list[int]:
        """The cached pages of the longest prefix of ``keys`` found, each with one more reference
        (the caller owns them now, read-only)."""
        pages = []
        if not self.cache_enabled:
            return pages
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            if not self._refs[page]:
                del self._lru[page]
            self._refs[page] += 1
            pages.append(page)
        self.hit_pages += len(pages)
        return pages

    def insert(self, page: int, key: PageKey) -> bool:
        """Index ``page`` (owned by the caller, full, its KV computed) under ``key``; False if the
        cache is off or another page already holds that key (this one stays a plain page)."""
        if not self.cache_enabled or key in self._page_of or page in self._key_of:
            return False
        self._page_of[key], self._key_of[page], self._refs[page] = page, key, 1
        return True

    def is_cached(self, page: int) -> bool:
        return page in self._key_of

    def is_free(self, page: int) -> bool:
        """Whether ``page`` is free: in no one's hands and not cached (for checks of the account)."""
        return page in self._free_set

    def is_evictable(self, page: int) -> bool:
        """Whether ``page`` is cached with no owner left (for checks of the account)."""
        return page in self._lru

    def refcounts(self) -> Mapping[int, int]:
        """Each cached page's owners now (0: evictable), read-only (for checks of the account)."""
        return MappingProxyType(self._refs)

    def flush(self) -> int:
        """Evict every cached page no one owns; how many."""
        n = len(self._lru)
        while self._lru:
            self._evict_oldest()
        return n

    def _evict_oldest(self) -> None:
        page, _ = self._lru.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        del self._refs[page]
        bisect.insort(self._free, page)
        self._free_set.add(page)
        self.evictions += 1

    # -- contiguous runs --------------------------------------------------------------------------

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
