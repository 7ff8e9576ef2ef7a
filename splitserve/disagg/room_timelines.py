"""The timelines of a prefill or decode worker's rooms, read off the actions its table emits.

The lifecycle tables keep no history (``docs/lifecycle.md``); the role sees every action they
emit, and that is enough (:meth:`RoomTimelines.note`, called with each list of actions before it
is carried out): every move of a room is a ``Moved`` (its state, or its ending, and the event that
caused it), and a request refused on arrival, which never had a room, is its ``NotifyClient``
alone. Which states are the room's queue, and which wait for the peer's KV, is the role's
``transitions``. A fallback's step says why the room moved (``kv_fallback(peer_lost)``,
from the ``KVFallback`` before it).

The same pass counts for the metrics what only the actions show: a prefill room's writes
(``StartWrite`` → ``WriteDone``, per write and per request, and the bytes), and transfers that
failed (a prefill room that had started writing, or a decode room waiting for its KV, ending
``FAILED``), by reason.
"""

from __future__ import annotations

from typing import Callable, Optional

from splitserve.disagg.lifecycle import (
    KVFallback, Moved, NotifyClient, Outcome, QuarantinePages, StartWrite, WriteDone, WriteFailed, is_terminal,
)
from splitserve.disagg.lifecycle.transitions import BY_ROLE, Waits
from splitserve.outcomes import Ending
from splitserve.timeline import Timeline, TimelineBook


def _names(role: str, waits: Waits) -> frozenset[str]:
    transitions = BY_ROLE.get(role)
    return frozenset(s.value for s in transitions.waiting(waits)) if transitions is not None else frozenset()


class RoomTimelines(TimelineBook):
    """A :class:`~splitserve.timeline.TimelineBook` fed from a room table's actions. The
    ``observer`` (the worker's metrics) is also told ``write_done(seconds)``,
    ``transfer_done(seconds, nbytes)`` and ``transfer_failed(reason)``."""

    def __init__(self, role: str, clock: Callable[[], float], page_nbytes: int = 0, **kw):
        super().__init__(role, clock, **kw)
        self.page_nbytes = page_nbytes
        self.queue_states = _names(role, Waits.QUEUE)
        """Where a request waits for this worker's resources (prefill: decode's registration and the
        forward pass; decode: pages and prefill's info); its queue time ends when it leaves them."""
        self.transfer_wait = _names(role, Waits.PEER)
        self._writes: dict[tuple[int, int], float] = {}  # (room, write id) -> started; each is reported once
        self._transfers: dict[int, list] = {}  # room -> [first write started, bytes], until the room ends

    def note(self, actions: list, now: float) -> None:
        fallbacks: dict[int, str] = {}  # room -> why its KV will not come (its next move says so)
        for a in actions:
            if isinstance(a, Moved):
                self._moved(a, now, fallbacks.pop(a.room, None))
            elif isinstance(a, NotifyClient):  # a request refused on arrival (a room's end was its Moved)
                self._end(a.room, a.rid, a.ending, now, "RequestArrived")
            elif isinstance(a, QuarantinePages):
                self.released(a.room, "quarantined", now)
            elif isinstance(a, KVFallback):
                fallbacks[a.room] = f"kv_fallback({a.reason.value})"
            elif isinstance(a, StartWrite):
                self._writes[(a.room, a.write_id)] = now
                t = self._transfers.setdefault(a.room, [now, 0])
                t[1] += len(a.src_pages) * self.page_nbytes

    def event(self, event: object, now: float) -> None:
        """An event the role is about to hand its table: a write's report."""
        if isinstance(event, (WriteDone, WriteFailed)):
            started = self._writes.pop((event.room, event.write_id), None)
            if started is not None and isinstance(event, WriteDone) and self.observer is not None:
                self.observer.write_done(now - started)

    def released(self, room: int, what: str, now: float) -> None:
        """What became of a room's memory after its end: ``quarantined``, ``released``."""
        tl = self.by_room.get(room)
        if tl is not None and not tl.live and tl.steps[-1].state != what:
            tl.note(what, now, "pages")

    def _moved(self, a: Moved, now: float, fallback: Optional[str] = None) -> None:
        tl = self.by_room.get(a.room)
        if tl is None or not tl.live:
            return
        cause = f"{a.cause}: {fallback}" if fallback else a.cause
        if is_terminal(a.after):
            self._end(a.room, tl.rid, a.ending, now, cause)
        elif tl.enter(a.after.value, now, cause) and a.after.value not in self.queue_states:
            self.started_work(tl, now)

    def _end(self, room: int, rid: str, ending: Ending, now: float, cause: str) -> None:
        tl = self.by_room.get(room)
        if tl is None or not tl.live or tl.rid != rid:
            return
        tl.end(str(ending.outcome.value) + f"({ending.reason.value})", now, cause)
        self.ended(tl)
        self._count_transfer(tl, room, ending, now)

    def _count_transfer(self, tl: Timeline, room: int, ending: Ending, now: float) -> None:
        transfer = self._transfers.pop(room, None)
        obs = self.observer
        if obs is None:
            return
        failed = ending.outcome is Outcome.FAILED
        if transfer is not None and ending.outcome is Outcome.FINISHED:
            obs.transfer_done(now - transfer[0], transfer[1])
        elif failed and (transfer is not None or any(s.state in self.transfer_wait for s in tl.steps)):
            obs.transfer_failed(ending.reason.value)
