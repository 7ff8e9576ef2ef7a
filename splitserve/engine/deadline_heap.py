"""The heap a worker's deadlines sit in, and how a request ends when its own deadline passes.

A deadline is kept per key (what it guards: a room, a peer, a colocated request). Changing a key's
deadline pushes a new entry and leaves the old one in place (lazy deletion: an entry counts only
while it is the key's current one), so set, cancel and pop are O(log n) amortised; the heap is
rebuilt when stale entries outnumber live ones. The disaggregated roles' room tables keep theirs
here (``disagg/lifecycle/deadlines.py``), and so does the colocated role (``colocated.py``): one
mechanism, one ending, whichever role serves the request.
"""

from __future__ import annotations

import heapq
from typing import Generic, Hashable, Optional, TypeVar

from splitserve.outcomes import Ending, Reason

K = TypeVar("K", bound=Hashable)


def request_timeout(limit_s: float) -> Ending:
    """A request that outlived its own end-to-end limit (``request_timeout_s``, or the deadline
    its sender gave it: ``X-Splitserve-Deadline-S``): 504 ``request_timeout`` on every role."""
    return Ending(Reason.REQUEST_TIMEOUT, f"older than {limit_s:g}s")


class DeadlineHeap(Generic[K]):
    """At most one pending deadline per key, ordered by time.

    ``set(key, when)`` replaces the key's deadline, ``cancel(key)`` drops it, ``pop_next(now)``
    returns (and forgets) the earliest key whose deadline is ``<= now``. Popping one key at a time
    lets the caller act on each with the table as the previous one left it.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, K]] = []
        self._due: dict[K, tuple[float, int]] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._due)

    def __contains__(self, key: K) -> bool:
        return key in self._due

    def when(self, key: K) -> Optional[float]:
        entry = self._due.get(key)
        return entry[0] if entry else None

    def set(self, key: K, when: float) -> None:
        self._seq += 1
        self._due[key] = (when, self._seq)
        heapq.heappush(self._heap, (when, self._seq, key))
        self._compact_if_sparse()

    def cancel(self, key: K) -> None:
        self._due.pop(key, None)
        self._compact_if_sparse()

    def next_due(self) -> Optional[float]:
        """The earliest pending deadline, or None."""
        self._drop_stale_top()
        return self._heap[0][0] if self._heap else None

    def pop_next(self, now: float) -> Optional[K]:
        """The earliest key whose deadline is ``<= now`` (forgotten as it is returned), or None."""
        self._drop_stale_top()
        if not self._heap or self._heap[0][0] > now:
            return None
        _, _, key = heapq.heappop(self._heap)
        del self._due[key]
        return key

    def pop_due(self, now: float) -> list[K]:
        keys = []
        while (key := self.pop_next(now)) is not None:
            keys.append(key)
        return keys

    def items(self) -> list[tuple[K, float]]:
        """Pending (key, when) pairs, in no particular order."""
        return [(k, w) for k, (w, _) in self._due.items()]

    def _is_current(self, entry: tuple[float, int, K]) -> bool:
        when, seq, key = entry
        return self._due.get(key) == (when, seq)

    def _drop_stale_top(self) -> None:
        while self._heap and not self._is_current(self._heap[0]):
            heapq.heappop(self._heap)

    def _compact_if_sparse(self) -> None:
        if len(self._heap) > 2 * len(self._due) + 64:
            self._heap = [(w, s, k) for k, (w, s) in self._due.items()]
            heapq.heapify(self._heap)
