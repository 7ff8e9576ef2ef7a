"""Every move a room may make, declared once per role: which state may follow which, the deadline
that governs each live state, what a room waits for there, and what that deadline running out
becomes (the room's ending, and whether it is a loss of the room's KV that decode may recompute).

A :class:`Transitions` is data, the one place these facts live. The room table checks every move
against it before making it (:meth:`Transitions.check`, a check that raises, so ``python -O``
keeps it) and takes the deadline of the state it enters from it; the gauges' label sets, the
metrics' waiting states, the timelines' queue states and the move tables of ``docs/lifecycle.md``
(a test reads them back) derive from it. An undeclared move is a bug in the table's own code,
never something a peer can cause: an event or message that does not fit a room's state is refused
before anything moves (the ``out_of_order`` and ``late_message`` notices).

Into a terminal state: every live state may end ``ABORTED`` or ``FAILED`` (rule 4: an abort works
in every state; rule 3: every deadline fails its room); ``FINISHED`` only from the states named.
A terminal state is never left (rule 2): no move starts there.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from splitserve.disagg.lifecycle.states import (
    DecodeState, Ending, LifecycleError, Outcome, PrefillState, Reason, Role, State, is_terminal,
)


class Waits(str, enum.Enum):
    """What a room in a live state waits for."""

    QUEUE = "queue"
    """Its turn on this worker (a registration to start, the forward pass, KV pages): counted as
    waiting, and its queue time ends when it leaves the last such state."""
    PEER = "peer"
    """The peer's KV: counted as waiting; a failure here is a failed transfer."""
    WORK = "work"
    """Nothing: its work runs (a forward pass, writes, decode steps). Counted as running."""


@dataclass(frozen=True)
class Live:
    """What the table knows of one live state."""

    deadline: str
    """The :class:`~splitserve.disagg.lifecycle.deadlines.Deadlines` field that bounds the time
    in this state, or its method, called with the state's one argument (``transfer_s(bytes)``)."""
    waits: Waits
    timeout: Callable[[Any, str], Ending]
    """What the deadline running out becomes: the room's ending, given the room and how long it
    waited in this state (``"12.5s"``). A request's own timeout (``request_timeout_s``) is not
    this: it ends a room in any state as ``request_timeout``."""
    loses_kv: bool = False
    """The timeout is a loss of the room's KV, not of the room: under ``--kv-failure-policy
    recompute`` decode computes the prompt itself instead (``recompute.py``)."""


@dataclass(frozen=True)
class Move:
    before: Optional[State]
    """None: the room arrives."""
    after: State
    when: str
    """What makes the move (``docs/lifecycle.md`` says the same)."""


class IllegalMove(LifecycleError):
    """A room table tried a move its :class:`Transitions` does not declare."""


_ENDS = (Outcome.ABORTED, Outcome.FAILED)


class Transitions:
    """One role's states and moves. ``states``: each live state (in the order a room passes
    them) with its deadline and what it waits for; ``moves``: every move between live states and
    each ``FINISHED``; the ``ABORTED`` and ``FAILED`` ends of every live state are added."""

    def __init__(self, role: Role, states: dict, moves: tuple[Move, ...]):
        self.role = role
        self.states: dict[State, Live] = dict(states)
        ends = tuple(Move(s, o, "an abort, a failure, its deadline") for s in self.states for o in _ENDS)
        self.moves: tuple[Move, ...] = tuple(moves) + ends
        self._allowed = frozenset((m.before, m.after) for m in self.moves)
        firsts = [m.after for m in self.moves if m.before is None]
        if len(firsts) != 1:
            raise LifecycleError(f"{role.value}: a room must arrive in one state, not {firsts}")
        self.first: State = firsts[0]
        for m in self.moves:
            for s in (m.before, m.after):
                if s is not None and not is_terminal(s) and s not in self.states:
                    raise LifecycleError(f"{role.value}: a move names {s}, which has no deadline here")
            if m.before is not None and is_terminal(m.before):
                raise LifecycleError(f"{role.value}: a move leaves the terminal {m.before}")

    def allows(self, before: Optional[State], after: State) -> bool:
        return (before, after) in self._allowed

    def check(self, room: int, before: Optional[State], after: State) -> None:
        """Raise :class:`IllegalMove` unless a room may move from ``before`` to ``after``."""
        if (before, after) not in self._allowed:
            was = "arrival" if before is None else getattr(before, "value", before)
            raise IllegalMove(f"{self.role.value} room {room}: {was} -> {getattr(after, 'value', after)} "
                              "is not a move of this role")

    def limit_s(self, state: State, deadlines, *args) -> float:
        """Seconds a room may stay in live ``state`` under ``deadlines`` (``args``: the deadline
        method's, e.g. the bytes still to write)."""
        limit = getattr(deadlines, self.states[state].deadline)
        return limit(*args) if callable(limit) else limit

    def live_states(self) -> list[State]:
        return list(self.states)

    def waiting(self, *kinds: Waits) -> frozenset[State]:
        """The live states that wait for one of ``kinds`` (default: anything but work)."""
        kinds = kinds or (Waits.QUEUE, Waits.PEER)
        return frozenset(s for s, live in self.states.items() if live.waits in kinds)

    def pairs(self) -> Iterator[tuple[Optional[State], State]]:
        """Every allowed (before, after)."""
        return iter(sorted(self._allowed, key=lambda p: (_order(self, p[0]), _order(self, p[1]))))


def _order(t: Transitions, s: Optional[State]) -> tuple:
    if s is None:
        return (0, 0)
    if s in t.states:
        return (1, list(t.states).index(s))
    return (2, list(Outcome).index(s))


P, D, W = PrefillState, DecodeState, Waits


def _decode_prealloc_timeout(r, waited: str) -> Ending:
    """Decode's ``PREALLOC`` ran out: what it still lacked (pages, the prefill's info) says why."""
    if r.fallback is not None:
        return Ending(r.fallback.reason, f"{r.fallback.detail}; no KV pages for its recompute in {waited}")
    if r.alone or r.peer is not None:
        return Ending(Reason.OVERLOADED, f"no KV pages in {waited}")
    missing = "bootstrap info from prefill" + ("" if r.pages else " nor KV pages")
    return Ending(Reason.BOOTSTRAP_TIMEOUT, f"no {missing} in {waited}")


def _decode_prefilling_timeout(r, waited: str) -> Ending:
    if r.waits_turn:
        return _decode_turn_timeout(r, waited)
    if r.fallback is not None:
        return Ending(r.fallback.reason, f"{r.fallback.detail}; recomputing its prompt here made no progress "
                      f"in {waited}")
    return Ending(Reason.STALLED, f"no chunk of its prompt computed here in {waited}")


def _decode_turn_timeout(r, waited: str) -> Ending:
    """A room whose sequence waited ``queue_s`` for the scheduler to admit it (decode's rooms run
    their progress bounds only from their admission: ``Admitted``)."""
    detail = f"waited {waited} for its turn in the engine's queue"
    if r.fallback is not None:
        return Ending(r.fallback.reason, f"{r.fallback.detail}; {detail}")
    return Ending(Reason.OVERLOADED, detail)


def _decode_decoding_timeout(r, waited: str) -> Ending:
    if r.waits_turn:
        return _decode_turn_timeout(r, waited)
    return Ending(Reason.STALLED, f"no decode step in {waited}")


PREFILL = Transitions(Role.PREFILL, {
    P.BOOTSTRAPPING: Live("bootstrap_s", W.QUEUE,
                          lambda r, w: Ending(Reason.BOOTSTRAP_TIMEOUT, f"no registration from decode in {w}")),
    P.QUEUED: Live("queue_s", W.QUEUE, lambda r, w: Ending(Reason.OVERLOADED, f"queued {w} for the forward pass")),
    P.PREFILLING: Live("prefill_stall_s", W.WORK, lambda r, w: Ending(Reason.STALLED, f"no chunk finished in {w}")),
    P.TRANSFERRING: Live("transfer_s", W.WORK, lambda r, w: Ending(
        Reason.TRANSFER_TIMEOUT, f"{len(r.writes)} writes unfinished after {w}")),
}, (
    Move(None, P.BOOTSTRAPPING, "`RequestArrived`"),
    Move(P.BOOTSTRAPPING, P.QUEUED, "decode's registration is accepted (at once if it came first)"),
    Move(P.QUEUED, P.PREFILLING, "`Scheduled`"),
    Move(P.PREFILLING, P.TRANSFERRING, "`ForwardDone` with writes in flight"),
    Move(P.PREFILLING, Outcome.FINISHED, "`ForwardDone` with every write landed"),
    Move(P.TRANSFERRING, Outcome.FINISHED, "the last `WriteDone`"),
))
"""The prefill side's moves (``prefill_table.py``)."""

DECODE = Transitions(Role.DECODE, {
    D.PREALLOC: Live("prealloc_s", W.QUEUE, _decode_prealloc_timeout, loses_kv=True),
    D.AWAITING_KV: Live("kv_wait_s", W.PEER,
                        lambda r, w: Ending(Reason.TRANSFER_TIMEOUT, f"no KV from {r.peer} in {w}"), loses_kv=True),
    D.RECLAIMING: Live("reclaim_s", W.PEER, lambda r, w: Ending(
        r.fallback.reason, f"{r.fallback.detail}; its writes did not settle in {w}")),
    D.PREFILLING: Live("prefill_stall_s", W.WORK, _decode_prefilling_timeout),
    D.DECODING: Live("decode_stall_s", W.WORK, _decode_decoding_timeout),
}, (
    Move(None, D.PREALLOC, "`RequestArrived`"),
    Move(D.PREALLOC, D.AWAITING_KV, "pages and a compatible prefill's info in hand: `RegisterRoom` sent"),
    Move(D.PREALLOC, D.PREFILLING, "a request alone with its pages, or a fallback before it registered"),
    Move(D.AWAITING_KV, D.RECLAIMING, "a fallback while a write may still land"),
    Move(D.AWAITING_KV, D.PREFILLING, "a fallback when no write can land"),
    Move(D.AWAITING_KV, D.DECODING, "`KVDone`, checked"),
    Move(D.RECLAIMING, D.PREFILLING, "no write can land any more: `WritesSettled`, `KVDone`, the peer lost"),
    Move(D.PREFILLING, D.DECODING, "its first token, computed here"),
    Move(D.DECODING, Outcome.FINISHED, "`Finished` (`stop` or `length`)"),
))
"""The decode side's moves (``decode_table.py``; a prompt computed here, ``recompute.py``)."""

BY_ROLE = {Role.PREFILL: PREFILL, Role.DECODE: DECODE}
