"""Caps on what peers can make a lifecycle table remember (``docs/security.md``)."""

from __future__ import annotations

from collections import Counter
from typing import Optional

from splitserve.disagg.lifecycle.peers import Peer


class PeerQuota:
    """Room ids that peers made us remember (pending registrations, tombstones of rooms we never
    saw), counted per peer and in total against two caps (``docs/security.md``): a peer's
    identity is its own claim, so a flood under rotating identities meets the total."""

    def __init__(self, per_peer: int, total: int):
        self.per_peer, self.total = per_peer, total
        self.owner: dict[int, Peer] = {}
        self._count: Counter = Counter()

    def full(self, peer: Peer) -> Optional[str]:
        """Why ``peer`` may not add one more, or None."""
        if len(self.owner) >= self.total:
            return f"{len(self.owner)} held in total"
        if self._count[peer] >= self.per_peer:
            return f"{self._count[peer]} held for {peer}"
        return None

    def take(self, room: int, peer: Peer) -> Optional[str]:
        """Count ``room`` against ``peer`` (None), or why not (at a cap: nothing changes)."""
        why = self.full(peer)
        if why is None:
            self.add(room, peer)
        return why

    def add(self, room: int, peer: Peer) -> None:
        if room not in self.owner:
            self.owner[room] = peer
            self._count[peer] += 1

    def drop(self, room: int) -> None:
        peer = self.owner.pop(room, None)
        if peer is not None:
            self._count[peer] -= 1
            if not self._count[peer]:
                del self._count[peer]
