"""Deadlines: how long each non-terminal state may last, and the heap that enforces them.

Every live room has exactly one pending deadline (docs/design.md, rule 3); so do the things that are
not rooms but must not live forever: a registration that came before its request, a tombstone, a
terminal room still holding memory, a peer's heartbeat. They all sit in a :class:`DeadlineHeap`
keyed by what they guard (``engine/deadline_heap.py``: the colocated role's requests sit in one too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

from splitserve.engine.deadline_heap import DeadlineHeap  # noqa: F401 (the lifecycle's timers)


@dataclass(frozen=True)
class Deadlines:
    """Time limits, in seconds, and the caps on what peers can make a table remember
    (``max_*``, docs/security.md). The defaults are the CLI defaults."""

    bootstrap_s: float = 60.0
    """Prefill BOOTSTRAPPING: decode's registration must arrive. -> FAILED(bootstrap_timeout).
    Longer than ``prealloc_s``: decode registers only once it holds pages."""
    queue_s: float = 60.0
    """Prefill QUEUED: the forward pass must start. -> FAILED(overloaded). Decode: a room's
    sequence must be admitted by the scheduler (its stall bounds start there)."""
    prefill_stall_s: float = 30.0
    """PREFILLING (prefill, and decode once admitted): the next chunk must finish. -> FAILED(stalled)."""
    transfer_floor_s: float = 10.0
    """Prefill TRANSFERRING: the fixed part of the transfer deadline. -> FAILED(transfer_timeout)."""
    transfer_s_per_gib: float = 4.0
    """Prefill TRANSFERRING: seconds added per GiB still to write (4 s/GiB: a floor of 0.25 GiB/s)."""
    write_drain_s: float = 30.0
    """A terminal prefill room whose writes have not settled: after this, reset the transfer
    connection to that peer (and again every ``write_drain_s`` until they settle)."""
    prealloc_s: float = 45.0
    """Decode PREALLOC: KV pages and the prefill's info must be in hand. -> FAILED(overloaded) when
    pages are missing, FAILED(bootstrap_timeout) when the info is."""
    kv_wait_s: float = 300.0
    """Decode AWAITING_KV: every write and the first token must arrive; covers the prefill's queue,
    forward pass and transfer. -> FAILED(transfer_timeout)."""
    decode_stall_s: float = 30.0
    """Decode DECODING, once admitted: the next decode step must happen. -> FAILED(stalled)."""
    reclaim_s: float = 45.0
    """Decode RECLAIMING: a room whose KV will not come, falling back to computing its prompt, waits
    this long for prefill to settle its writes (or to be declared lost) before it computes into its
    pages. -> FAILED(its reason), the pages quarantined. Longer than prefill's ``write_drain_s``
    plus the peer-silence bound, after which prefill has settled or declared the session lost."""
    register_resend_s: float = 5.0
    """Decode AWAITING_KV: the registration is sent again this often until the KV comes (prefill
    takes a duplicate as a no-op), so a lost one costs a delay, not the request. Not a deadline."""
    quarantine_resend_s: float = 5.0
    """A terminal decode room with quarantined pages re-sends its abort this often until the peer
    says its writes have settled (or the peer is declared lost). Not a deadline on the pages."""
    pending_registration_s: float = 60.0
    """Prefill: a registration that came before its request waits this long for it."""
    heartbeat_interval_s: float = 1.0
    """Peers send heartbeats this often."""
    heartbeat_misses: int = 5
    """A peer not heard from for this many intervals is declared lost; its rooms fail."""
    tombstone_s: float = 900.0
    """How long a room id is remembered after it ended or was aborted before it arrived. Must
    exceed every other deadline (:meth:`validate`)."""
    request_timeout_s: Optional[float] = None
    """Optional end-to-end limit per request, on both sides. -> FAILED(request_timeout)."""
    max_pending_registrations: int = 65536
    """Prefill: registrations held for requests not here yet, in total. Past it (or past the cap
    per peer) a new one is dropped and counted (notice `capped`); decode sends it again."""
    max_pending_registrations_per_peer: int = 4096
    """Prefill: the same, per decode session (a decode holds at most its running and waiting rooms)."""
    max_peer_tombstones: int = 65536
    """Room ids a peer's abort or failure made us remember for rooms never seen here, in total.
    Past it (or past the cap per peer) such a message is dropped unanswered and counted; the
    tombstones of our own rooms, which the lifecycle rules need, are never capped."""
    max_peer_tombstones_per_peer: int = 4096
    """The same, per peer session."""

    def transfer_s(self, nbytes: int) -> float:
        """The TRANSFERRING deadline for ``nbytes`` still to write."""
        return self.transfer_floor_s + self.transfer_s_per_gib * nbytes / 2**30

    @property
    def peer_silence_s(self) -> float:
        """How long a peer may stay silent before it is declared lost."""
        return self.heartbeat_interval_s * self.heartbeat_misses

    def validate(self, max_transfer_bytes: int = 0) -> "Deadlines":
        """Raise ValueError unless every limit is positive (``transfer_s_per_gib`` may be 0) and
        the tombstone outlives every other
        deadline (the transfer deadline taken at ``max_transfer_bytes``). Returns self."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            least_ok = 0 if f.name == "transfer_s_per_gib" else 1e-9  # 0 s/GiB: a flat transfer deadline
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= least_ok):
                raise ValueError(f"deadline {f.name} must be a positive finite number, got {value!r}")
        if self.heartbeat_misses < 1 or self.heartbeat_misses != int(self.heartbeat_misses):
            raise ValueError(f"heartbeat_misses must be a whole number >= 1, got {self.heartbeat_misses!r}")
        others = {
            f.name: getattr(self, f.name) for f in fields(self)
            if f.name.endswith("_s") and f.name not in ("tombstone_s", "transfer_s_per_gib")
            and getattr(self, f.name) is not None
        }
        others["transfer_s(max_transfer_bytes)"] = self.transfer_s(max_transfer_bytes)
        others["peer_silence_s"] = self.peer_silence_s
        longest = max(others, key=others.get)
        if self.tombstone_s <= others[longest]:
            raise ValueError(
                f"tombstone_s ({self.tombstone_s}) must exceed every other deadline; "
                f"{longest} is {others[longest]}")
        return self
