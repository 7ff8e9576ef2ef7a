"""The prefill side: one :class:`PrefillTable` per prefill worker.

States, in order::

    BOOTSTRAPPING  the request is here, waiting for decode's RegisterRoom    (bootstrap_s)
    QUEUED         registered, waiting for the forward pass                  (queue_s)
    PREFILLING     chunks run; each chunk's full pages start a write         (prefill_stall_s per chunk)
    TRANSFERRING   forward done, waiting for the last write                  (transfer_s(bytes))
    FINISHED(transferred) | ABORTED | FAILED(reason)

A registration may come before the request: it waits as a *pending registration* for
``pending_registration_s``, then decode is told and the room id tombstoned. The room finishes when
every write has completed (``KVDone``, then its pages freed). A room that ends any other way tells
decode (``RoomFailed``), asks for its writes to be cancelled, and stays *held* until every write
has settled (then ``WritesSettled``); one whose writes do not settle within ``write_drain_s`` gets
its decode session declared lost, so that decode fences it. Why each rule: ``docs/lifecycle.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from splitserve.disagg import protocol
from splitserve.disagg.lifecycle.actions import (
    Action, CancelWrites, Enqueue, FreePages, Notice, NoticeKind, ResetTransfer, SendToPeer, StartWrite,
)
from splitserve.disagg.lifecycle.deadlines import Deadlines
from splitserve.disagg.lifecycle.events import (
    ChunkDone, ForwardDone, RequestArrived, Scheduled, WriteDone, WriteFailed,
)
from splitserve.disagg.lifecycle.peers import Peer
from splitserve.disagg.lifecycle.states import (
    Ending, LifecycleError, Outcome, PrefillState, Reason, Role, State, ending_from_peer, is_terminal,
)
from splitserve.disagg.lifecycle.quota import PeerQuota
from splitserve.disagg.lifecycle.registration import registration_problem
from splitserve.disagg.lifecycle.table import Room, RoomTable
from splitserve.disagg.lifecycle.transitions import PREFILL


@dataclass
class PrefillRoom(Room):
    dst_pages: tuple[int, ...] = ()
    """Decode's page ids for the prompt's pages after its cached prefix (from its registration)."""
    skip_pages: int = 0
    """Prompt pages decode holds already (its cached prefix): never written."""
    src_pages: tuple[int, ...] = ()
    """Our pages holding the prompt's KV (from Scheduled)."""
    pages_started: int = 0
    """Pages [0, pages_started) have had their write started."""
    writes: dict[int, int] = field(default_factory=dict)
    """Writes not yet settled: write_id -> pages."""
    first_token: Optional[int] = None
    first_logprobs: bytes = b""  # the first token's logprobs (TokenLogprob.to_bytes), if asked for
    told_settled: bool = False
    """Decode has been told that no write for this room can still land."""


@dataclass(frozen=True)
class PendingRegistration:
    peer: Peer
    msg: protocol.RegisterRoom
    since: float


class PrefillTable(RoomTable):
    role = Role.PREFILL
    transitions = PREFILL
    _held_label = "held_writes"

    def __init__(self, deadlines: Deadlines, incarnation: str, page_size: int, page_nbytes: int = 0):
        super().__init__(deadlines, incarnation, page_size)
        self.page_nbytes = page_nbytes
        self._pending: dict[int, PendingRegistration] = {}
        self._pending_cap = PeerQuota(deadlines.max_pending_registrations_per_peer, deadlines.max_pending_registrations)
        self._next_write_id = 1

    def _extra_counts(self) -> dict[str, int]:
        return {"pending_registrations": len(self._pending)}

    def _extra_canonical(self, now: float) -> tuple:
        return (tuple(sorted((room, p.peer, p.since - now, p.msg.prompt_len, tuple(p.msg.pages))
                             for room, p in self._pending.items())),
                self._next_write_id)

    # == arrival and registration ===============================================================

    def _admit(self, ev: RequestArrived, now: float, out: list[Action]) -> None:
        r = self._new_room(PrefillRoom, ev, now, out)
        pending = self._unpend(ev.room)
        if pending is None:
            return
        self._timers.cancel(("pending", ev.room))
        self._accept_registration(r, pending.peer, pending.msg, now, out)

    def _on_register(self, peer: Peer, msg: protocol.RegisterRoom, now: float, out: list[Action]) -> None:
        room = msg.room
        if msg.prefill_incarnation != self.incarnation:
            out.append(Notice(self.role, NoticeKind.STALE_INCARNATION, room,
                              f"{peer} registered for incarnation {msg.prefill_incarnation}"))
            return
        r = self._rooms.get(room)
        pending = self._pending.get(room)
        owner = r.peer if r is not None else pending.peer if pending is not None else None
        if r is not None and owner is None:  # BOOTSTRAPPING (a room with no peer is never held)
            self._accept_registration(r, peer, msg, now, out)
        elif owner == peer:
            out.append(Notice(self.role, NoticeKind.DUPLICATE_REGISTRATION, room, str(peer)))
        elif owner is not None:
            out.append(Notice(self.role, NoticeKind.WRONG_PEER, room, f"registered by {owner}, refused {peer}"))
            self._refuse_registration(peer, room, Ending(Reason.BAD_REQUEST, f"room registered by {owner}"), out)
        elif room in self._tombstones:
            self._on_late_registration(peer, room, now, out)
        elif (why := self._pending_cap.take(room, peer)) is not None:  # decode sends it again
            out.append(Notice(self.role, NoticeKind.CAPPED, room, f"registration from {peer} dropped: {why}"))
        else:
            self._pending[room] = PendingRegistration(peer, msg, now)
            self.peers.bind(peer, room, now)
            self._timers.set(("pending", room), now + self.cfg.pending_registration_s)

    def _unpend(self, room: int) -> Optional[PendingRegistration]:
        self._pending_cap.drop(room)
        return self._pending.pop(room, None)

    def _abort_unseen(self, room: int, ending: Ending, now: float, out: list[Action]) -> None:
        """An abort or failure before the request came; if decode already registered, tell it."""
        pending = self._unpend(room)
        if pending is not None:
            self._timers.cancel(("pending", room))
            self.peers.unbind(pending.peer, room)
            if self._reachable(pending.peer):
                self._refuse_registration(pending.peer, room, ending, out)
        super()._abort_unseen(room, ending, now, out)

    def _on_late_registration(self, peer: Peer, room: int, now: float, out: list[Action]) -> None:
        """A registration for a room that already ended here: a failure is told again (the peer
        may not have been known when it happened). A finished room's owner gets its ``KVDone``
        again: decode re-sends its registration while it waits for the KV, so the first
        ``KVDone`` was lost (every write had landed before it was sent, so the KV is there)."""
        tomb = self._tombstones[room]
        out.append(Notice(self.role, NoticeKind.LATE_MESSAGE, room, f"registration from {peer} after {tomb.ending}"))
        if tomb.ending.outcome is not Outcome.FINISHED:
            self._refuse_registration(peer, room, tomb.ending, out)
            self._refresh_tombstone(room, now)
        elif tomb.peer == peer and tomb.answer is not None:
            out.append(SendToPeer(peer, tomb.answer))

    def _refresh_tombstone(self, room: int, now: float) -> None:
        """We just promised a peer that nothing of this room will be written: remember the room
        a full tombstone lifetime from now, so that a registration sent before the promise and
        still on its way is refused, never acted on (it would write into pages decode freed)."""
        tomb = self._tombstones[room]
        self._tombstone(room, tomb.ending, tomb.arrived, now, tomb.peer, tomb.answer)

    def _refuse_registration(self, peer: Peer, room: int, ending: Ending, out: list[Action]) -> None:
        out.append(SendToPeer(peer, protocol.RoomFailed(room, self.incarnation, ending.reason.value)))
        out.append(SendToPeer(peer, protocol.WritesSettled(room, self.incarnation)))

    def _accept_registration(self, r: PrefillRoom, peer: Peer, msg: protocol.RegisterRoom,
                             now: float, out: list[Action]) -> None:
        r.peer = peer
        self.peers.bind(peer, r.id, now)
        problem = registration_problem(r.prompt_len, r.n_pages, self.page_size, msg)
        if problem:
            self._end(r, Ending(Reason.BAD_REQUEST, problem), now, out)
            return
        r.skip_pages = msg.cached_tokens // self.page_size
        r.dst_pages = tuple(msg.pages[: r.n_pages - r.skip_pages])
        r.pages_started = r.skip_pages
        self._enter(r, PrefillState.QUEUED, now, out)
        out.append(Enqueue(r.id, r.rid))

    def _on_other_timer(self, kind: str, room: int, now: float, out: list[Action]) -> None:
        if kind != "pending":
            return super()._on_other_timer(kind, room, now, out)
        pending = self._unpend(room)
        self.peers.unbind(pending.peer, room)
        ending = Ending(Reason.BOOTSTRAP_TIMEOUT,
                        f"registration from {pending.peer} waited {now - pending.since:g}s for the request")
        self._tombstone(room, ending, arrived=False, now=now)
        out.append(Notice(self.role, NoticeKind.PENDING_EXPIRED, room, ending.detail))
        if self._reachable(pending.peer):
            self._refuse_registration(pending.peer, room, ending, out)

    # == messages from decode ===================================================================

    def _on_peer_message(self, peer: Peer, msg, now: float, out: list[Action]) -> None:
        if self.peers.is_lost(peer):
            self._on_message_from_lost_peer(peer, msg, out)
            return
        self.peers.heard(peer, now)
        if isinstance(msg, protocol.RegisterRoom):
            self._on_register(peer, msg, now, out)
        elif isinstance(msg, protocol.AbortRoom):
            self._on_peer_abort(peer, msg.room, ending_from_peer(msg.reason), now, out)
        else:
            out.append(Notice(self.role, NoticeKind.UNEXPECTED_MESSAGE, getattr(msg, "room", None),
                              f"{type(msg).__name__} from {peer}"))

    def _on_message_from_lost_peer(self, peer: Peer, msg, out: list[Action]) -> None:
        """Never act on a lost peer's message; but answer what it may be waiting for, in case it
        is alive after all (an asymmetric partition): ``peer_lost``, which makes decode end the
        session and fence it. Never ``WritesSettled``: our teardown of the session's transfer
        does not stop bytes already on the wire; only decode's fence does."""
        room = getattr(msg, "room", None)
        out.append(Notice(self.role, NoticeKind.FROM_LOST_PEER, room, f"{type(msg).__name__} from {peer}"))
        if isinstance(msg, (protocol.RegisterRoom, protocol.AbortRoom)):
            out.append(SendToPeer(peer, protocol.RoomFailed(room, self.incarnation, Reason.PEER_LOST.value)))

    def _on_peer_abort(self, peer: Peer, room: int, ending: Ending, now: float, out: list[Action]) -> None:
        """Decode aborted or failed the room (or re-sends that while its pages are quarantined)."""
        r = self._rooms.get(room)
        if r is not None:
            if r.peer is not None and r.peer != peer:
                out.append(Notice(self.role, NoticeKind.WRONG_PEER, room, f"abort from {peer}, owner {r.peer}"))
            elif is_terminal(r.state):
                pass  # held: WritesSettled goes out when the last write settles
            elif r.peer is None:  # BOOTSTRAPPING: its registration may still be on the way
                self._end(r, ending, now, out)
                out.append(SendToPeer(peer, protocol.WritesSettled(room, self.incarnation)))
            else:
                self._end(r, ending, now, out)
            return
        pending = self._pending.get(room)
        if pending is not None and pending.peer != peer:
            out.append(Notice(self.role, NoticeKind.WRONG_PEER, room, f"abort from {peer}, owner {pending.peer}"))
            return
        if pending is None and room not in self._tombstones and not self._peer_may_tombstone(peer, room, "abort", out):
            return  # no promise without the tombstone that keeps it; decode re-sends while it needs one
        if pending is not None:
            self._unpend(room)
            self._peer_tombstones.add(room, peer)
            self._timers.cancel(("pending", room))
            self.peers.unbind(peer, room)
        # Not in the table: no write of this room can be in flight.
        out.append(SendToPeer(peer, protocol.WritesSettled(room, self.incarnation)))
        if room in self._tombstones:
            out.append(Notice(self.role, NoticeKind.ABORT_AFTER_END, room, str(ending)))
            self._refresh_tombstone(room, now)
        else:
            self._abort_unseen(room, ending, now, out)

    # == the forward pass and the writes ========================================================

    def _on_event(self, event, now: float, out: list[Action]) -> None:
        match event:
            case Scheduled(room=room, pages=pages):
                self._on_scheduled(room, tuple(pages), now, out)
            case ChunkDone(room=room, pages_ready=ready):
                r = self._live_room_in(room, PrefillState.PREFILLING, event, out)
                if r is not None:
                    self._write_pages(r, min(ready, r.n_pages), out)
                    self._rearm(r, now)
            case ForwardDone(room=room, first_token=token, first_logprobs=logprobs):
                r = self._live_room_in(room, PrefillState.PREFILLING, event, out)
                if r is not None:
                    r.first_logprobs = logprobs
                    self._on_forward_done(r, token, now, out)
            case WriteDone(room=room, write_id=wid):
                r = self._settle(room, wid, event, out)
                if r is not None and r.state is PrefillState.TRANSFERRING and not r.writes:
                    self._finish(r, now, out)
                elif r is not None:
                    self._release_if_settled(r, now, out)
            case WriteFailed(room=room, write_id=wid, error=error):
                r = self._settle(room, wid, event, out)
                if r is not None and not is_terminal(r.state):
                    self._end(r, Ending(Reason.TRANSFER_ERROR, error or f"write {wid} failed"), now, out)
                elif r is not None:
                    self._release_if_settled(r, now, out)
            case _:
                super()._on_event(event, now, out)

    def _live_room_in(self, room: int, state: PrefillState, event, out: list[Action]) -> Optional[PrefillRoom]:
        r = self._rooms.get(room)
        if r is not None and r.state is state:
            return r
        out.append(Notice(self.role, NoticeKind.OUT_OF_ORDER, room, f"{type(event).__name__} in {self.state_of(room)}"))
        return None

    def _on_scheduled(self, room: int, pages: tuple[int, ...], now: float, out: list[Action]) -> None:
        r = self._live_room_in(room, PrefillState.QUEUED, Scheduled(room, pages), out)
        if r is None:
            if pages:
                out.append(FreePages(room, pages))  # never leak what the engine just allocated
            return
        r.src_pages = pages
        if len(pages) != r.n_pages:
            self._end(r, Ending(Reason.INTERNAL_ERROR, f"scheduled with {len(pages)} pages, needs {r.n_pages}"),
                      now, out)
            return
        self._enter(r, PrefillState.PREFILLING, now, out)

    def _on_forward_done(self, r: PrefillRoom, first_token: int, now: float, out: list[Action]) -> None:
        r.first_token = first_token
        self._write_pages(r, r.n_pages, out)
        if not r.writes:
            self._finish(r, now, out)
            return
        nbytes = sum(r.writes.values()) * self.page_nbytes
        self._enter(r, PrefillState.TRANSFERRING, now, out, nbytes)

    def _write_pages(self, r: PrefillRoom, upto: int, out: list[Action]) -> None:
        """Start the write of pages [pages_started, upto)."""
        if upto <= r.pages_started:
            return
        wid = self._next_write_id
        self._next_write_id += 1
        skip = r.skip_pages
        out.append(StartWrite(r.id, wid, r.peer, r.src_pages[r.pages_started:upto],
                              r.dst_pages[r.pages_started - skip:upto - skip]))
        r.writes[wid] = upto - r.pages_started
        r.pages_started = upto

    def _settle(self, room: int, wid: int, event, out: list[Action]) -> Optional[PrefillRoom]:
        r = self._rooms.get(room)
        if r is None or wid not in r.writes:
            out.append(Notice(self.role, NoticeKind.DUPLICATE_WRITE_REPORT, room, f"{type(event).__name__} {wid}"))
            return None
        del r.writes[wid]
        return r

    def _finish(self, r: PrefillRoom, now: float, out: list[Action]) -> None:
        out.append(SendToPeer(r.peer, self._kv_done(r)))
        r.told_settled = True  # KVDone: every write has landed
        self._end(r, Ending(Reason.TRANSFERRED), now, out)

    def _kv_done(self, r: PrefillRoom) -> protocol.KVDone:
        return protocol.KVDone(r.id, self.incarnation, r.first_token, r.prompt_len, r.first_logprobs)

    def _answer_again(self, r: PrefillRoom) -> Optional[protocol.KVDone]:
        return self._kv_done(r) if r.ending.reason is Reason.TRANSFERRED else None

    # == the end of a room ======================================================================

    def _after_end(self, r: PrefillRoom, last: State, now: float, out: list[Action]) -> None:
        if r.ending.outcome is not Outcome.FINISHED and not r.ending.from_peer and self._reachable(r.peer):
            out.append(SendToPeer(r.peer, protocol.RoomFailed(r.id, self.incarnation, r.ending.reason.value)))
        if r.writes:
            out.append(CancelWrites(r.id, tuple(sorted(r.writes))))
            self._hold(r, self.cfg.write_drain_s, now)
        else:
            self._release(r, now, out)

    def _release_if_settled(self, r: PrefillRoom, now: float, out: list[Action]) -> None:
        if is_terminal(r.state) and not r.writes:
            self._release(r, now, out)

    def _release_memory(self, r: PrefillRoom, now: float, out: list[Action]) -> None:
        if r.writes:
            raise LifecycleError(f"room {r.id} frees its source pages under unsettled writes {sorted(r.writes)}")
        if r.src_pages:
            out.append(FreePages(r.id, r.src_pages))
        if not r.told_settled and self._reachable(r.peer):
            out.append(SendToPeer(r.peer, protocol.WritesSettled(r.id, self.incarnation)))
            r.told_settled = True

    def _on_held_timer(self, r: PrefillRoom, now: float, out: list[Action]) -> None:
        """Writes still unsettled ``write_drain_s`` after the end. Tearing our side of the transfer
        down does not stop bytes already on the wire, so we must not tell decode they settled:
        the session is declared lost instead. That fails its rooms here, stops our heartbeats to
        it, and answers its aborts with ``peer_lost``, so decode ends the session too and fences
        it (closes its receiving link) before it frees a page."""
        wids = tuple(sorted(r.writes))
        detail = f"writes {list(wids)} to {r.peer} unsettled {now - r.entered:g}s after {r.ending}"
        out.append(Notice(self.role, NoticeKind.TRANSFER_RESET, r.id, detail))
        lost = self.peers.declare_lost(r.peer, now) if r.peer is not None else None
        if lost is not None:
            self._peer_lost(lost, f"{detail}: session ended so that decode fences it", now, out)
        else:  # lost already: its disconnect is under way; nudge the transport again
            out.append(ResetTransfer(r.peer, r.id, wids))
        self._hold(r, self.cfg.write_drain_s, now)

    def _on_peer_lost(self, room: int, peer: Peer, detail: str, now: float, out: list[Action]) -> None:
        r = self._rooms.get(room)
        if r is not None and not is_terminal(r.state):
            self._end(r, Ending(Reason.PEER_LOST, detail), now, out)
        elif room in self._pending:  # its request is refused when it comes
            self._unpend(room)
            self._timers.cancel(("pending", room))
            self._tombstone(room, Ending(Reason.PEER_LOST, detail), arrived=False, now=now)
        # A held room keeps waiting: the disconnect makes its writes fail and settle.
