"""Request timelines: every state a request passed on this worker, when it entered each, and the
event that moved it there; for live requests and a bounded number of recently ended ones.

The roles build them from what they already see, on the engine loop (the only writer): the
colocated role from the engine's step reports (``engine/async_engine.py``), a prefill or decode
role from the actions its lifecycle table emits (``disagg/room_timelines.py``). The lifecycle
tables keep no history. ``/debug/requests/{rid}`` shows one (:meth:`Timeline.to_dict`), read from
any thread without stopping the loop (a timeline only grows; a step is appended in one operation),
and the one log line at a request's end carries it in short form (:meth:`Timeline.short`)::

    QUEUED 0.004s > PREFILLING 0.120s > TRANSFERRING 0.013s > FINISHED(transferred) total 0.137s
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

RECENT_TIMELINES = 1024  # ended timelines kept per worker (the oldest is forgotten first)


@dataclass(frozen=True)
class Step:
    state: str
    """A state, the ending once terminal (``FINISHED(stop)``), or a later note (``released``)."""
    at: float
    """When (the role's clock: monotonic seconds)."""
    event: str
    """What moved it (an event's name, ``deadline``, ...)."""


class Timeline:
    """One request on one worker."""

    __slots__ = ("rid", "room", "role", "born", "steps", "ending", "ended", "worked")

    def __init__(self, rid: str, room: Optional[int], role: str, born: float):
        self.rid, self.room, self.role, self.born = rid, room, role, born
        self.steps: list[Step] = []
        self.ending: Optional[str] = None
        self.ended: Optional[float] = None
        self.worked = False  # it left its queue states once (queue time observed)

    @property
    def live(self) -> bool:
        return self.ended is None

    @property
    def state(self) -> Optional[str]:
        return self.steps[-1].state if self.steps else None

    def enter(self, state: str, at: float, event: str) -> bool:
        """Record ``state`` entered at ``at``; False (nothing recorded) if it is the state already."""
        if self.ended is not None or self.state == state:
            return False
        self.steps.append(Step(state, at, event))
        return True

    def end(self, ending: str, at: float, event: str) -> None:
        if self.ended is None:
            self.ending, self.ended = ending, at
            self.steps.append(Step(ending, at, event))

    def note(self, what: str, at: float, event: str) -> None:
        """Something after the end (memory released, a quarantine lifted)."""
        self.steps.append(Step(what, at, event))

    def to_dict(self, now: float, wall: Callable[[float], float]) -> dict:
        """What ``/debug/requests/{rid}`` shows: each step with its time since arrival, its wall
        clock time (Unix seconds) and how long the request stayed (until the next step, or now)."""
        steps = list(self.steps)
        rows = []
        for i, s in enumerate(steps):
            until = steps[i + 1].at if i + 1 < len(steps) else (now if self.ended is None else s.at)
            rows.append({"state": s.state, "at_s": round(s.at - self.born, 6), "time": round(wall(s.at), 6),
                         "duration_s": round(until - s.at, 6), "event": s.event})
        return {"rid": self.rid, "room": self.room, "role": self.role, "live": self.ended is None,
                "arrived": round(wall(self.born), 6), "age_s": round(now - self.born, 6),
                "ending": self.ending, "steps": rows}

    def short(self) -> str:
        """The log line's form: each state with the time spent in it, then the ending."""
        steps = list(self.steps)
        parts = []
        for i, s in enumerate(steps):
            if self.ended is not None and s.at >= self.ended and s.state == self.ending:
                parts.append(s.state)
                break
            nxt = steps[i + 1].at if i + 1 < len(steps) else None
            parts.append(f"{s.state} {nxt - s.at:.3f}s" if nxt is not None else s.state)
        total = f" total {self.ended - self.born:.3f}s" if self.ended is not None else ""
        return " > ".join(parts) + total


class TimelineBook:
    """The timelines of one worker: the live ones, and the last ``capacity`` ended ones, found by
    request id or by room. The engine loop writes; any thread reads."""

    def __init__(self, role: str, clock: Callable[[], float] = time.monotonic, capacity: int = RECENT_TIMELINES):
        self.role = role
        self.clock = clock
        self.capacity = capacity
        self.by_rid: dict[str, Timeline] = {}
        self.by_room: dict[int, Timeline] = {}
        self.recent: deque[Timeline] = deque()
        self.observer = None
        """Set by the worker's metrics: ``queue_time(seconds)`` when a request leaves its queue."""

    def wall(self, at: float) -> float:
        return at + (time.time() - self.clock())

    def start(self, rid: str, room: Optional[int], state: str, now: float, event: str = "arrived") -> Timeline:
        tl = Timeline(rid, room, self.role, now)
        tl.enter(state, now, event)
        self.by_rid[rid] = tl
        if room is not None:
            self.by_room[room] = tl
        return tl

    def started_work(self, tl: Timeline, at: float) -> None:
        """``tl`` left its queue (colocated: scheduled; prefill: its forward pass began; decode:
        its pages and its peer's info came): its queue time, once."""
        if not tl.worked:
            tl.worked = True
            if self.observer is not None:
                self.observer.queue_time(at - tl.born)

    def ended(self, tl: Timeline) -> None:
        """``tl`` has ended: it joins the recent ones; the oldest beyond ``capacity`` is forgotten."""
        self.recent.append(tl)
        while len(self.recent) > self.capacity:
            old = self.recent.popleft()
            if self.by_rid.get(old.rid) is old:
                del self.by_rid[old.rid]
            if old.room is not None and self.by_room.get(old.room) is old:
                del self.by_room[old.room]

    def get(self, rid: str) -> Optional[Timeline]:
        return self.by_rid.get(rid)

    def get_room(self, room: int) -> Optional[Timeline]:
        return self.by_room.get(room)

    def short(self, rid: str) -> str:
        tl = self.by_rid.get(rid)
        return tl.short() if tl is not None else "-"

    def short_room(self, room: int) -> str:
        tl = self.by_room.get(room)
        return tl.short() if tl is not None else "-"
