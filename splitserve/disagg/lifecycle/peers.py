"""Peers and their liveness.

A :class:`Peer` is one *session* with one *incarnation* of a worker: its stable name (address or
transfer-agent name), the incarnation id it drew at start, and the session number of the
connection. A worker restarted on the same address is a new peer; so is the same worker reached
over a new session after the last one was declared lost (a healed partition).

The :class:`PeerTable` tracks the peers that rooms are bound to. Any sign of life refreshes
``last_heard``; a peer silent for ``heartbeat_misses`` intervals is declared lost by
:meth:`PeerTable.expire` and the room table fails every room bound to it. A *fresh* sign of life
(the answer to our own heartbeat) from a new incarnation of a name declares the older
incarnations of that name lost at once; only decode gives fresh signs (a prefill's address is
held by one process at a time, a decode's advertised name is not), and a control message is never
fresh (one from a dead incarnation may still sit in the inbox). A lost peer is remembered for the
tombstone lifetime, so that a late message from it is rejected, never acted on. Peers with no
rooms are not tracked: there is nothing of theirs to fail. See ``docs/lifecycle.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from splitserve.disagg.lifecycle.deadlines import DeadlineHeap, Deadlines
from splitserve.disagg.lifecycle.states import LifecycleError


@dataclass(frozen=True, order=True)
class Peer:
    name: str
    """Stable across restarts: host:port of its control socket, or its transfer-agent name."""
    incarnation: str
    """Fresh at every process start."""
    session: int = 0
    """Which connection between the two processes: decode numbers them per prefill address and
    starts a new one (new control socket, new receiving link) after declaring the last one lost,
    so a healed pair serves again while the lost session stays lost."""

    def __str__(self) -> str:
        return f"{self.name}#{self.incarnation}/{self.session}"


@dataclass
class PeerEntry:
    peer: Peer
    last_heard: float
    rooms: set[int] = field(default_factory=set)


Lost = tuple[Peer, frozenset[int]]
"""A peer just declared lost, and the rooms that were bound to it."""


class PeerTable:
    def __init__(self, deadlines: Deadlines):
        self._cfg = deadlines
        self._live: dict[Peer, PeerEntry] = {}
        self._lost: set[Peer] = set()
        self._timers: DeadlineHeap[tuple[str, Peer]] = DeadlineHeap()

    # -- queries ------------------------------------------------------------------------------

    def is_lost(self, peer: Optional[Peer]) -> bool:
        return peer is not None and peer in self._lost

    def is_tracked(self, peer: Peer) -> bool:
        return peer in self._live

    def next_due(self) -> Optional[float]:
        return self._timers.next_due()

    def __len__(self) -> int:
        return len(self._live)

    def live_peers(self) -> list[Peer]:
        """The peers rooms depend on now."""
        return sorted(list(self._live))

    def counts(self) -> dict[str, int]:
        """Peers rooms depend on now (``live``), and lost ones still remembered (``lost``)."""
        return {"live": len(self._live), "lost": len(self._lost)}

    def snapshot(self, now: float) -> list[dict]:
        interval = self._cfg.heartbeat_interval_s
        return [
            {"peer": str(e.peer), "rooms": len(e.rooms), "silent_s": now - e.last_heard,
             "misses": int((now - e.last_heard) // interval)}
            for e in sorted(list(self._live.values()), key=lambda e: e.peer)
        ]

    def canonical(self, now: float = 0.0) -> tuple:
        """A hashable summary, times relative to ``now`` (for the interleaving explorer)."""
        return (
            tuple(sorted((p, e.last_heard - now, tuple(sorted(e.rooms))) for p, e in self._live.items())),
            tuple(sorted(self._lost)),
            tuple(sorted((key, when - now) for key, when in self._timers.items())),
        )

    # -- changes ------------------------------------------------------------------------------

    def heard(self, peer: Peer, now: float, fresh: bool = False) -> list[Lost]:
        """``peer`` showed a sign of life. If ``fresh``, other incarnations of its name are
        declared lost: returned, with their rooms, for the room table to fail."""
        if peer in self._lost:
            return []
        lost = self._declare_others_lost(peer, now) if fresh else []
        entry = self._live.get(peer)
        if entry is not None and now > entry.last_heard:
            entry.last_heard = now
            self._timers.set(("silent", peer), now + self._cfg.peer_silence_s)
        return lost

    def bind(self, peer: Peer, room: int, now: float) -> None:
        """Room ``room`` now depends on ``peer``, which must not be lost."""
        if peer in self._lost:
            raise LifecycleError(f"binding room {room} to lost peer {peer}")
        entry = self._live.get(peer)
        if entry is None:
            entry = self._live[peer] = PeerEntry(peer, now)
            self._timers.set(("silent", peer), now + self._cfg.peer_silence_s)
        entry.rooms.add(room)

    def unbind(self, peer: Optional[Peer], room: int) -> None:
        entry = self._live.get(peer) if peer is not None else None
        if entry is None:
            return
        entry.rooms.discard(room)
        if not entry.rooms:
            self._untrack(peer)

    def declare_lost(self, peer: Peer, now: float) -> Optional[Lost]:
        """Declare ``peer`` lost (its connection broke, an operator said so). None if it already was."""
        if peer in self._lost:
            return None
        return self._declare_lost(peer, now)

    def expire(self, now: float) -> list[Lost]:
        """Peers declared lost now because they were silent too long; lost peers whose memory
        outlived the tombstone lifetime are forgotten."""
        lost = []
        for kind, peer in self._timers.pop_due(now):
            if kind == "silent":
                lost.append(self._declare_lost(peer, now))
            else:  # "forget"
                self._lost.discard(peer)
        return lost

    def _declare_others_lost(self, peer: Peer, now: float) -> list[Lost]:
        older = [p for p in self._live if p.name == peer.name and p != peer]
        return [self._declare_lost(p, now) for p in sorted(older)]

    def _declare_lost(self, peer: Peer, now: float) -> Lost:
        entry = self._live.get(peer)
        rooms = frozenset(entry.rooms) if entry else frozenset()
        self._untrack(peer)
        self._lost.add(peer)
        self._timers.set(("forget", peer), now + self._cfg.tombstone_s)
        return peer, rooms

    def _untrack(self, peer: Peer) -> None:
        self._live.pop(peer, None)
        self._timers.cancel(("silent", peer))
