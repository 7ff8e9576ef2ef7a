"""The timelines of a prefill or decode worker's rooms, read off the actions its table emits.

The lifecycle tables keep no history (``docs/lifecycle.md``); the role sees every action they
emit, and that is enough (:meth:`RoomTimelines.note`, called with each list of actions before it
is carried out):

- ``ObserveStateTime(state, seconds)`` is emitted whenever a room leaves a state. When the next
  action is ``NotifyClient(room)`` the room ended (``RoomTable._end``); otherwise the room that
  left it is the room of the event being handled (only that room ever moves to another live
  state), and the state it moved to is asked of the table afterwards (``state_of``).
- ``NotifyClient`` alone (a request refused on arrival) ends a room that never had a state.
- ``KVFallback`` and ``ComputePrompt`` name a decode room that moved (to ``RECLAIMING`` or
  ``PREFILLING``) whatever the event's room: a lost peer or a deadline moves rooms of their own.
  The step shows why (``kv_fallback(peer_lost)``).

The same pass counts for the metrics what only the actions show: a prefill room's writes
(``StartWrite`` → ``WriteDone``, per write and per request, and the bytes), and transfers that
failed (a prefill room that had started writing, or a decode room waiting for its KV, ending
``FAILED``), by reason.
"""

from __future__ import annotations

from typing import Callable, Optional

from splitserve.disagg.lifecycle import (
    ComputePrompt, FromPeer, KVFallback, LocalFailure, NotifyClient, ObserveStateTime, Outcome, QuarantinePages,
    StartWrite, WriteDone, WriteFailed,
)
from splitserve.timeline import Timeline, TimelineBook

QUEUE_STATES = {"prefill": {"BOOTSTRAPPING", "QUEUED"}, "decode": {"PREALLOC"}}
"""Where a request waits for this worker's resources (prefill: decode's registration and the
forward pass; decode: pages and prefill's info); its queue time ends when it leaves them."""
TRANSFER_WAIT = {"decode": "AWAITING_KV"}


def describe(event: object) -> str:
    """An event's name as a timeline shows it."""
    if isinstance(event, FromPeer):
        return f"{type(event.msg).__name__} from {event.peer}"
    if isinstance(event, LocalFailure):
        return f"LocalFailure({event.reason.value})"
    return type(event).__name__


def room_of(event: object) -> Optional[int]:
    room = getattr(event, "room", None)
    if room is None and isinstance(event, FromPeer):
        room = getattr(event.msg, "room", None)
    return room if isinstance(room, int) else None


class RoomTimelines(TimelineBook):
    """A :class:`~splitserve.timeline.TimelineBook` fed from a room table's actions. The
    ``observer`` (the worker's metrics) is also told ``write_done(seconds)``,
    ``transfer_done(seconds, nbytes)`` and ``transfer_failed(reason)``."""

    def __init__(self, role: str, clock: Callable[[], float], page_nbytes: int = 0, **kw):
        super().__init__(role, clock, **kw)
        self.page_nbytes = page_nbytes
        self._writes: dict[tuple[int, int], float] = {}  # (room, write id) -> started; each is reported once
        self._transfers: dict[int, list] = {}  # room -> [first write started, bytes], until the room ends

    def note(self, actions: list, focus: Optional[int], now: float, cause: str,
             state_of: Callable[[int], object]) -> None:
        pending: list[ObserveStateTime] = []
        moved: dict[int, str] = {}  # rooms a fallback or a computed prompt moved -> the step's event
        for a in actions:
            if isinstance(a, ObserveStateTime):
                pending.append(a)
            elif isinstance(a, NotifyClient):
                last = pending.pop() if pending else None
                self._moved(focus, pending, now, cause)
                pending = []
                self._end(a, last, now, cause)
            elif isinstance(a, QuarantinePages):
                self.released(a.room, "quarantined", now)
            elif isinstance(a, KVFallback):
                moved[a.room] = f"{cause}: kv_fallback({a.reason.value})"
            elif isinstance(a, ComputePrompt):
                moved.setdefault(a.room, cause)
            elif isinstance(a, StartWrite):
                self._writes[(a.room, a.write_id)] = now
                t = self._transfers.setdefault(a.room, [now, 0])
                t[1] += len(a.src_pages) * self.page_nbytes
        self._moved(focus, pending, now, moved.get(focus, cause))
        for room in ([focus] if focus is not None and focus not in moved else []) + list(moved):
            tl = self.by_room.get(room)
            if tl is not None and tl.live:
                name = getattr(state_of(room), "value", None)
                if isinstance(name, str) and tl.enter(name, now, moved.get(room, cause)) \
                        and name not in QUEUE_STATES.get(self.role, ()):
                    self.started_work(tl, now)

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

    def _moved(self, focus: Optional[int], left: list[ObserveStateTime], now: float, cause: str) -> None:
        """The focus room left the states in ``left`` (in order): fill in any it passed through
        within this one event (entered and left at once)."""
        tl = self.by_room.get(focus) if focus is not None else None
        if tl is None or not tl.live:
            return
        for obs in left:
            tl.enter(obs.state.value, now - obs.seconds, cause)

    def _end(self, a: NotifyClient, last: Optional[ObserveStateTime], now: float, cause: str) -> None:
        tl = self.by_room.get(a.room)
        if tl is None or not tl.live or tl.rid != a.rid:
            return
        if last is not None:
            tl.enter(last.state.value, now - last.seconds, cause)
        tl.end(str(a.ending.outcome.value) + f"({a.ending.reason.value})", now, cause)
        self.ended(tl)
        self._count_transfer(tl, a, now)

    def _count_transfer(self, tl: Timeline, a: NotifyClient, now: float) -> None:
        transfer = self._transfers.pop(a.room, None)
        obs = self.observer
        if obs is None:
            return
        failed = a.ending.outcome is Outcome.FAILED
        if transfer is not None and a.ending.outcome is Outcome.FINISHED:
            obs.transfer_done(now - transfer[0], transfer[1])
        elif failed and (transfer is not None or any(s.state == TRANSFER_WAIT.get(self.role) for s in tl.steps)):
            obs.transfer_failed(a.ending.reason.value)
