"""What both sides share: the room table, its timers, tombstones, the end of a room, the gauges.

A :class:`RoomTable` holds every room of one worker and one role. The engine loop owns it: it is
the only caller, feeding ``handle(event, now)`` and ``expire(now)`` and executing the actions they
return. Nothing here reads a clock, sleeps, locks or does I/O.

A room is *live* while its state is a live state; *held* while it is terminal but still holds
memory a write may touch (prefill: writes in flight; decode: quarantined pages); *released* once
its memory is returned, when it becomes a tombstone. Every live room has a deadline; every held
room has a timer; every tombstone expires.

Every move goes through :meth:`RoomTable._move`, checked against the side's declared
``transitions`` (``transitions.py``) and emitted as ``Moved``. Ending a room (:meth:`RoomTable._end`)
is the only way into a terminal state, and no move leaves one; it emits the single log line, count
and client answer, and hands over to the side's ``_after_end``. The order of hooks one event takes
is the comment below.
"""

# The order of hooks one event takes (``side.`` marks the prefill or decode table's own):
#
#   handle(event)  RequestArrived -> _on_arrival -> _refuse | side._admit -> _new_room
#                  ClientAbort, LocalFailure -> _abort -> _end | _abort_unseen
#                  FromPeer -> side._on_peer_message     PeerHeard, PeerLost -> _peer_lost
#                  anything else -> side._on_event
#   expire(now)    a silent peer -> _peer_lost -> DisconnectPeer, side._on_peer_lost (per room)
#                  a live room's deadline -> _on_deadline -> request timeout: _end
#                      else the state's declared timeout (transitions.py) -> _end | side._kv_timed_out
#                  a held room's timer -> side._on_held_timer;  a tombstone's -> forgotten
#                  any other timer -> side._on_other_timer
#   a move         _move (checked, Moved) ; _enter = _move + the new state's deadline ; _rearm
#   an end         _end -> _move to terminal, NotifyClient, LogTerminal, CountOutcome, [Cancel]
#                      -> side._after_end -> _hold (held) | _release -> side._release_memory, tombstone

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Optional

from splitserve.disagg.lifecycle.actions import (
    Action, Cancel, CountOutcome, DisconnectPeer, LogTerminal, Moved, Notice, NoticeKind, NotifyClient,
)
from splitserve.disagg.lifecycle.deadlines import DeadlineHeap, Deadlines
from splitserve.disagg.lifecycle.events import (
    ClientAbort, FromPeer, LocalFailure, PeerHeard, PeerLost, RequestArrived, describe,
)
from splitserve.disagg.lifecycle.frozen import frozen_fields
from splitserve.disagg.lifecycle.peers import Lost, Peer, PeerTable
from splitserve.disagg.lifecycle.quota import PeerQuota
from splitserve.disagg.lifecycle.room import Room, Tombstone
from splitserve.disagg.lifecycle.states import Ending, LifecycleError, Outcome, Reason, Role, State, is_terminal
from splitserve.disagg.lifecycle.transitions import Transitions
from splitserve.engine.deadline_heap import request_timeout


class RoomTable:
    role: Role
    transitions: Transitions
    """The side's states and every move it may make (``transitions.py``)."""

    def __init__(self, deadlines: Deadlines, incarnation: str, page_size: int):
        self.cfg = deadlines.validate()
        self.incarnation = incarnation
        self.page_size = page_size
        self.peers = PeerTable(deadlines)
        self._rooms: dict[int, Room] = {}
        self._tombstones: dict[int, Tombstone] = {}
        # tombstones a peer's message made for a room never seen here (capped; our own never are)
        self._peer_tombstones = PeerQuota(deadlines.max_peer_tombstones_per_peer, deadlines.max_peer_tombstones)
        self._timers: DeadlineHeap[tuple[str, int]] = DeadlineHeap()
        self._counts: Counter = Counter()  # rooms by state label (live states, and held), kept per transition
        self._cause: object = None  # what is being handled (an event, "deadline"): a Moved's cause

    # == the engine loop's API ==================================================================

    def handle(self, event, now: float) -> list[Action]:
        """Apply one event at time ``now``; return the actions to execute, in order."""
        out: list[Action] = []
        self._cause = event
        match event:
            case RequestArrived():
                self._on_arrival(event, now, out)
            case ClientAbort(room=room, detail=detail):
                self._abort(room, Ending(Reason.CLIENT_ABORT, detail), now, out)
            case LocalFailure(room=room, reason=reason, detail=detail):
                self._abort(room, Ending(reason, detail), now, out)
            case FromPeer(peer=peer, msg=msg):
                self._on_peer_message(peer, msg, now, out)
            case PeerHeard(peer=peer, fresh=fresh):
                for lost in self.peers.heard(peer, now, fresh):
                    self._peer_lost(lost, f"{lost[0]} restarted as {peer}", now, out)
            case PeerLost(peer=peer, detail=detail):
                lost = self.peers.declare_lost(peer, now)
                if lost is not None:
                    self._peer_lost(lost, detail or "connection lost", now, out)
            case _:
                self._on_event(event, now, out)
        return out

    def expire(self, now: float) -> list[Action]:
        """Act on every deadline ``<= now``: silent peers, live rooms out of time, held rooms'
        timers, tombstones and pending registrations that ran out. Call every loop iteration,
        after draining the inbox (so a heartbeat that is waiting there counts)."""
        out: list[Action] = []
        self._cause = "deadline"
        for lost in self.peers.expire(now):
            self._peer_lost(lost, f"silent for {self.cfg.peer_silence_s:g}s", now, out)
        while (key := self._timers.pop_next(now)) is not None:
            kind, room = key
            if kind == "room":
                r = self._rooms[room]
                if is_terminal(r.state):
                    self._on_held_timer(r, now, out)
                else:
                    self._on_deadline(r, now, out)
            elif kind == "tomb":
                del self._tombstones[room]
                self._peer_tombstones.drop(room)
            else:
                self._on_other_timer(kind, room, now, out)
        return out

    def next_due(self) -> Optional[float]:
        """The earliest pending deadline (rooms, tombstones, peers), or None: the engine loop may
        sleep until then when it has nothing else to do."""
        due = [d for d in (self._timers.next_due(), self.peers.next_due()) if d is not None]
        return min(due) if due else None

    # == queries and gauges =====================================================================

    def state_of(self, room: int) -> Optional[State]:
        """The room's state; its outcome once it ended (while remembered); None if unknown."""
        r = self._rooms.get(room)
        if r is not None:
            return r.state
        tomb = self._tombstones.get(room)
        return tomb.ending.outcome if tomb is not None else None

    def ending_of(self, room: int) -> Optional[Ending]:
        r = self._rooms.get(room)
        if r is not None:
            return r.ending
        tomb = self._tombstones.get(room)
        return tomb.ending if tomb is not None else None

    def rooms(self) -> dict[int, Room]:
        """Every room known, live or held, by id, for checks that read them (a copy; engine loop only)."""
        return dict(self._rooms)

    def live_rooms(self) -> list[int]:
        return sorted(room for room, r in self._rooms.items() if not is_terminal(r.state))

    def is_idle(self) -> bool:
        """Nothing live, held, pending or remembered (rooms, tombstones, peers, lost peers)."""
        return (not self._rooms and not self._tombstones and not len(self._timers) and not len(self.peers)
                and self.peers.next_due() is None)

    def counts_by_state(self) -> dict[str, int]:
        """Gauges: live rooms by state (every state, zeros included), held rooms, tombstones. Kept
        as each room moves, so asking costs nothing however many rooms there are; any thread may
        ask (it reads counters the engine loop keeps)."""
        counts = {s.value: self._counts[s.value] for s in self.transitions.live_states()}
        counts[self._held_label] = self._counts[self._held_label]
        counts["tombstones"] = len(self._tombstones)
        counts.update(self._extra_counts())
        return counts

    def _label(self, state: State) -> str:
        return self._held_label if is_terminal(state) else state.value

    def _count(self, before: Optional[State], after: Optional[State]) -> None:
        """Keep ``_counts`` with a room that moved from ``before`` to ``after`` (None: absent)."""
        if before is not None:
            self._counts[self._label(before)] -= 1
        if after is not None:
            self._counts[self._label(after)] += 1

    def snapshot(self, now: float) -> list[dict]:
        """The ``/debug/requests`` payload: every live or held room, oldest first. Any thread may
        ask, without stopping the engine loop: the rooms are copied in one step (atomic in
        CPython), then each row is read from its room as it is at that moment."""
        rows = []
        for r in sorted(list(self._rooms.values()), key=lambda r: (r.born, r.id)):
            given = (r.deadline - r.entered) if r.deadline is not None else math.inf
            rows.append({
                "rid": r.rid,
                "room": r.id,
                "role": self.role.value,
                "state": r.state.value,
                "age_s": now - r.born,
                "state_age_s": now - r.entered,
                "deadline_s": (r.deadline - now) if r.deadline is not None else None,
                "late": (now - r.entered) > given / 2,
                "peer": str(r.peer) if r.peer is not None else None,
                "holding": self._held_label if is_terminal(r.state) else None,
                "ending": str(r.ending) if r.ending is not None else None,
            })
        return rows

    def canonical(self, now: float = 0.0) -> tuple:
        """Everything that decides this table's future, as a hashable value independent of the
        order things were stored in, with times relative to ``now`` (nothing here depends on the
        clock's origin). The interleaving explorer merges equal states with it."""
        return (
            tuple(sorted((room, frozen_fields(r, now)) for room, r in self._rooms.items())),
            tuple(sorted((room, t.ending.reason, t.ending.detail, t.arrived, t.peer, t.answer)
                         for room, t in self._tombstones.items())),
            tuple(sorted((key, when - now) for key, when in self._timers.items())),
            self.peers.canonical(now),
            tuple(sorted(self._peer_tombstones.owner.items())),
            self._extra_canonical(now),
        )

    # == the shared rules =======================================================================

    def _on_arrival(self, ev: RequestArrived, now: float, out: list[Action]) -> None:
        if ev.room in self._rooms:
            self._refuse(ev, Ending(Reason.BAD_REQUEST, f"room {ev.room} is in use by another request"), now, out)
            return
        tomb = self._tombstones.get(ev.room)
        if tomb is not None:
            ending = tomb.ending if not tomb.arrived else Ending(Reason.BAD_REQUEST, f"room {ev.room} was already used")
            self._refuse(ev, ending, now, out)
            self._tombstone(ev.room, tomb.ending, arrived=True, now=now, peer=tomb.peer, answer=tomb.answer)
            return
        self._admit(ev, now, out)

    def _refuse(self, ev: RequestArrived, ending: Ending, now: float, out: list[Action]) -> None:
        """End a request that never got a room: its one answer, log line and count."""
        out.append(NotifyClient(ev.rid, ev.room, ending))
        out.append(LogTerminal(self.role, ev.rid, ev.room, None, 0.0, ending))
        out.append(CountOutcome(self.role, ending.outcome, ending.reason))

    def _abort(self, room: int, ending: Ending, now: float, out: list[Action]) -> None:
        """A client abort or a local failure: works in every state and every order (rule 4)."""
        r = self._rooms.get(room)
        if r is not None and not is_terminal(r.state):
            self._end(r, ending, now, out)
        elif r is not None or room in self._tombstones:
            out.append(Notice(self.role, NoticeKind.ABORT_AFTER_END, room, str(ending)))
        else:
            self._abort_unseen(room, ending, now, out)

    def _abort_unseen(self, room: int, ending: Ending, now: float, out: list[Action]) -> None:
        self._tombstone(room, ending, arrived=False, now=now)
        out.append(Notice(self.role, NoticeKind.TOMBSTONE, room, str(ending)))

    def _peer_may_tombstone(self, peer: Peer, room: int, what: str, out: list[Action]) -> bool:
        """Whether ``peer`` may make us remember ``room``, never seen here; at a cap its message is
        dropped and counted instead (docs/security.md: why that keeps every rule)."""
        why = self._peer_tombstones.take(room, peer)
        if why is not None:
            out.append(Notice(self.role, NoticeKind.CAPPED, room, f"{what} from {peer} dropped: {why}"))
        return why is None

    def _new_room(self, cls, ev: RequestArrived, now: float, out: list[Action]):
        """A room for an arriving request, in the side's first state, its deadline armed."""
        state = self.transitions.first
        self.transitions.check(ev.room, None, state)
        n_pages = -(-ev.prompt_len // self.page_size)
        r = cls(id=ev.room, rid=ev.rid, prompt_len=ev.prompt_len, n_pages=n_pages, born=now, state=state, entered=now)
        ends = [now + s for s in (self.cfg.request_timeout_s, ev.deadline_s) if s is not None]
        r.expires = min(ends) if ends else None  # the sender's deadline only ever shortens the worker's own
        self._rooms[ev.room] = r
        out.append(Moved(ev.room, None, state, describe(self._cause)))
        self._count(None, state)
        self._rearm(r, now)
        return r

    def _move(self, r: Room, after: State, now: float, out: list[Action], ending: Optional[Ending] = None) -> None:
        """The one way a room changes state: checked against the transitions, then emitted."""
        self.transitions.check(r.id, r.state, after)
        out.append(Moved(r.id, r.state, after, describe(self._cause), now - r.entered, ending))
        self._count(r.state, after)
        r.state, r.entered = after, now

    def _enter(self, r: Room, state: State, now: float, out: list[Action], *deadline_args) -> None:
        """Move a live room to live ``state``, armed with the deadline the transitions give it
        (``deadline_args``: that deadline's, e.g. the bytes still to write)."""
        self._move(r, state, now, out)
        self._arm(r, self.transitions.limit_s(state, self.cfg, *deadline_args), now)

    def _rearm(self, r: Room, now: float) -> None:
        """Progress in a live state: its deadline starts again (a stall deadline per chunk, per step)."""
        self._arm(r, self.transitions.limit_s(r.state, self.cfg), now)

    def _arm(self, r: Room, limit_s: float, now: float) -> None:
        """(Re)set a live room's deadline: ``limit_s`` from now, or the end-to-end limit if sooner."""
        r.deadline = now + limit_s if r.expires is None else min(now + limit_s, r.expires)
        self._timers.set(("room", r.id), r.deadline)

    def _hold(self, r: Room, seconds: float, now: float) -> None:
        """Set a held room's timer."""
        r.deadline = now + seconds
        self._timers.set(("room", r.id), r.deadline)

    def _on_deadline(self, r: Room, now: float, out: list[Action]) -> None:
        """A live room's deadline ran out: the request's own timeout, else what its state's
        declaration (``transitions.py``) says the timeout becomes."""
        if r.expires is not None and now >= r.expires:
            self._end(r, request_timeout(r.expires - r.born), now, out)
            return
        live = self.transitions.states[r.state]
        ending = live.timeout(r, f"{now - r.entered:g}s")
        if live.loses_kv:
            self._kv_timed_out(r, ending, now, out)
        else:
            self._end(r, ending, now, out)

    def _end(self, r: Room, ending: Ending, now: float, out: list[Action]) -> None:
        """The one way into a terminal state."""
        last = r.state
        self._move(r, ending.outcome, now, out, ending)
        r.ending, r.deadline = ending, None
        self._timers.cancel(("room", r.id))
        out.append(NotifyClient(r.rid, r.id, ending))
        out.append(LogTerminal(self.role, r.rid, r.id, last, now - r.born, ending))
        out.append(CountOutcome(self.role, ending.outcome, ending.reason))
        if ending.outcome is not Outcome.FINISHED:
            out.append(Cancel(r.id, r.rid))
        self._after_end(r, last, now, out)

    def _release(self, r: Room, now: float, out: list[Action]) -> None:
        """Return a terminal room's memory (once) and keep its id as a tombstone."""
        if not is_terminal(r.state):
            raise LifecycleError(f"room {r.id} released while {r.state.value}: only an ended room gives memory back")
        self._release_memory(r, now, out)
        del self._rooms[r.id]
        self._count(r.state, None)
        self._timers.cancel(("room", r.id))
        self.peers.unbind(r.peer, r.id)
        self._tombstone(r.id, r.ending, arrived=True, now=now, peer=r.peer, answer=self._answer_again(r))

    def _tombstone(self, room: int, ending: Ending, arrived: bool, now: float, peer: Optional[Peer] = None,
                   answer: Any = None) -> None:
        self._tombstones[room] = Tombstone(ending, arrived, peer, answer)
        self._timers.set(("tomb", room), now + self.cfg.tombstone_s)

    def _answer_again(self, r: Room) -> Any:
        """What a released room's peer is told again if it asks again (see :class:`Tombstone`)."""
        return None

    def _reachable(self, peer: Optional[Peer]) -> bool:
        return peer is not None and not self.peers.is_lost(peer)

    def _peer_lost(self, lost: Lost, detail: str, now: float, out: list[Action]) -> None:
        """Rule 5: a lost peer fails all its rooms. The disconnect comes first: it is what makes
        sure none of the peer's writes can still land when their pages are freed."""
        peer, rooms = lost
        out.append(DisconnectPeer(peer, detail, tuple(sorted(rooms))))
        out.append(Notice(self.role, NoticeKind.PEER_LOST, None, f"{peer}: {detail}; {len(rooms)} rooms"))
        for room in sorted(rooms):
            self._on_peer_lost(room, peer, f"{peer}: {detail}", now, out)

    # == what each side fills in ================================================================

    _held_label = "held"

    def _admit(self, ev: RequestArrived, now: float, out: list[Action]) -> None:
        raise NotImplementedError

    def _on_event(self, event, now: float, out: list[Action]) -> None:
        raise TypeError(f"{type(self).__name__} does not take {type(event).__name__}")

    def _on_peer_message(self, peer: Peer, msg, now: float, out: list[Action]) -> None:
        raise NotImplementedError

    def _kv_timed_out(self, r: Room, ending: Ending, now: float, out: list[Action]) -> None:
        """A state whose timeout loses the room's KV (``Live.loses_kv``) ran out."""
        self._end(r, ending, now, out)

    def _after_end(self, r: Room, last: State, now: float, out: list[Action]) -> None:
        raise NotImplementedError

    def _release_memory(self, r: Room, now: float, out: list[Action]) -> None:
        raise NotImplementedError

    def _on_held_timer(self, r: Room, now: float, out: list[Action]) -> None:
        raise NotImplementedError

    def _on_other_timer(self, kind: str, room: int, now: float, out: list[Action]) -> None:
        raise KeyError(kind)

    def _on_peer_lost(self, room: int, peer: Peer, detail: str, now: float, out: list[Action]) -> None:
        raise NotImplementedError

    def _extra_counts(self) -> dict[str, int]:
        return {}

    def _extra_canonical(self, now: float) -> tuple:
        return ()

