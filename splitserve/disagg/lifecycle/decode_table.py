"""The decode side: one :class:`DecodeTable` per decode worker.

States, in order::

    PREALLOC      the request is here; waiting for KV pages and the prefill's info   (prealloc_s)
    AWAITING_KV   RegisterRoom sent, and again every register_resend_s               (kv_wait_s)
    RECLAIMING    the KV will not come, and a write may still land: AbortRoom sent
                  until prefill settles its writes or is declared lost and fenced    (reclaim_s)
    PREFILLING    the prompt runs here, into the room's own pages                    (prefill_stall_s per chunk)
    DECODING      every write landed (KVDone, checked), or the prompt ran here       (decode_stall_s per step)
    FINISHED(stop|length) | ABORTED | FAILED(reason)

Two ways lead to ``PREFILLING`` (alone, or a fallback): ``recompute.py``. In ``PREFILLING`` and
``DECODING`` the progress bound runs from the scheduler's admission (``Admitted``); ``queue_s``
bounds the wait for it. Once registered, prefill may write into the room's pages, so a room that
ends before ``KVDone`` keeps them *quarantined* until prefill says ``WritesSettled`` (or fails the
room with nothing in flight) or is declared lost — and fenced before anything is freed — re-sending
its abort every ``quarantine_resend_s``. No timeout frees quarantined pages (``docs/design.md``,
rule 6); a prefill that answers ``peer_lost`` gets its session declared lost here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from splitserve.disagg import protocol
from splitserve.disagg.lifecycle.actions import (
    Action, ComputePrompt, FreePages, KVFallback, Notice, NoticeKind, QuarantinePages, ReleaseQuarantine,
    ReservePages, SendToPeer, StartDecode,
)
from splitserve.disagg.lifecycle.events import (
    Admitted, DecodeStep, Finished, KVLost, PagesReserved, PeerInfo, Preempted, PromptChunk, RequestArrived,
)
from splitserve.disagg.lifecycle.deadlines import Deadlines
from splitserve.disagg.lifecycle.peers import Peer
from splitserve.disagg.lifecycle.states import (
    DecodeState, Ending, Outcome, Reason, Role, State, ending_from_peer, is_terminal,
)
from splitserve.disagg.lifecycle.recompute import Plan, Recompute
from splitserve.disagg.lifecycle.table import Room, RoomTable
from splitserve.disagg.lifecycle.transitions import DECODE


@dataclass
class DecodeRoom(Room):
    pages: tuple[int, ...] = ()
    """Every KV page the room holds: the prompt pages (its cached prefix first), then those decode
    steps added."""
    cached_pages: int = 0
    """How many of ``pages`` are shared prefix-cache pages (read-only, never a write target)."""
    registered: bool = False
    """RegisterRoom was sent: from now on prefill may write into the prompt pages."""
    kv_done: bool = False
    """KVDone came: every write landed."""
    settled: bool = False
    """Prefill said no write can still land."""
    quarantined: bool = False
    first_token: Optional[int] = None
    alone: bool = False
    """It came with no prefill: decode computes its prompt."""
    fallback: Optional[Ending] = None
    """Why its KV will not come, once it fell back to computing its prompt here."""
    reclaimed: bool = False
    """It computes its prompt here: no write of a prefill can reach its pages."""
    waits_turn: bool = False  # its sequence waits for the scheduler's admission (``Admitted``): ``queue_s``


class DecodeTable(RoomTable):
    role = Role.DECODE
    transitions = DECODE
    _held_label = "quarantined"

    def __init__(self, deadlines: Deadlines, incarnation: str, page_size: int, vocab_size: Optional[int] = None,
                 kv_failure_policy: str = "fail"):
        """``vocab_size``: the model's, to check the first token a prefill sends (None: unchecked).
        ``kv_failure_policy``: ``recompute`` (a room whose KV will not come computes its prompt
        here) or ``fail`` (it fails with its reason)."""
        super().__init__(deadlines, incarnation, page_size)
        self.recompute = Recompute(kv_failure_policy)
        self.vocab_size = vocab_size
        self._quarantined_pages = 0

    def _extra_counts(self) -> dict[str, int]:
        return {"quarantined_pages": self._quarantined_pages}

    # == arrival, pages, peer info, registration ================================================

    def _admit(self, ev: RequestArrived, now: float, out: list[Action]) -> None:
        r = self._new_room(DecodeRoom, ev, now, out)
        r.alone = ev.alone
        out.append(ReservePages(r.id, r.n_pages))

    def _on_event(self, event, now: float, out: list[Action]) -> None:
        match event:
            case PagesReserved(room=room, pages=pages, cached_tokens=cached):
                self._on_pages(room, tuple(pages), cached, now, out)
            case PeerInfo(room=room, peer=peer, mismatch=mismatch):
                self._on_peer_info(room, peer, mismatch, now, out)
            case DecodeStep(room=room, new_pages=new_pages):
                self._first_token_here(room, now, out)
                r = self._live_room_in(room, (DecodeState.DECODING,), event, out, tuple(new_pages))
                if r is not None:
                    r.pages, r.waits_turn = r.pages + tuple(new_pages), False
                    self._rearm(r, now)
            case Finished(room=room, reason=reason):
                self._first_token_here(room, now, out)
                r = self._live_room_in(room, (DecodeState.DECODING,), event, out)
                if r is not None:
                    self._end(r, Ending(reason), now, out)
            case PromptChunk(room=room) | Admitted(room=room) | Preempted(room=room):
                # A DECODING room the engine preempted for pages recomputes its tokens in chunks:
                # that is progress too, or a long recompute would read as a stalled decode.
                r = self._live_room_in(room, (DecodeState.PREFILLING, DecodeState.DECODING), event, out)
                if r is not None and isinstance(event, Preempted):
                    self._wait_turn(r, now)
                elif r is not None:
                    r.waits_turn = False
                    self._rearm(r, now)
            case KVLost(room=room, detail=detail):
                r = self._rooms.get(room)
                before_kv = r is not None and r.state in (DecodeState.PREALLOC, DecodeState.AWAITING_KV)
                if before_kv and not r.alone and r.fallback is None:
                    self._kv_lost(r, Ending(Reason.PEER_FAILED, detail or "its KV will not come"), now, out)
                else:
                    self._out_of_order(room, event, out)
            case _:
                super()._on_event(event, now, out)

    def _live_room_in(self, room: int, states: tuple[DecodeState, ...], event, out: list[Action],
                      pages: tuple[int, ...] = ()) -> Optional[DecodeRoom]:
        """The room, if it is in one of ``states``; else an out-of-order notice (and ``pages``,
        which the engine just allocated for it, freed) and None."""
        r = self._rooms.get(room)
        if r is not None and r.state in states:
            return r
        self._out_of_order(room, event, out, pages)
        return None

    def _out_of_order(self, room: int, event, out: list[Action], pages: tuple[int, ...] = ()) -> None:
        out.append(Notice(self.role, NoticeKind.OUT_OF_ORDER, room, f"{type(event).__name__} in {self.state_of(room)}"))
        if pages:
            out.append(FreePages(room, pages))  # never leak what the engine just allocated

    def _on_pages(self, room: int, pages: tuple[int, ...], cached_tokens: int, now: float,
                  out: list[Action]) -> None:
        r = self._rooms.get(room)
        if r is None or r.state is not DecodeState.PREALLOC or r.pages:
            self._out_of_order(room, PagesReserved(room, pages, cached_tokens), out, pages)
            return
        r.pages, r.cached_pages = pages, cached_tokens // self.page_size
        if len(pages) < r.n_pages:
            self._end(r, Ending(Reason.INTERNAL_ERROR, f"reserved {len(pages)} pages, needs {r.n_pages}"), now, out)
            return
        if cached_tokens % self.page_size or r.cached_pages >= r.n_pages:
            self._end(r, Ending(Reason.INTERNAL_ERROR, f"a cached prefix of {cached_tokens} tokens for a prompt of "
                                f"{r.prompt_len} (pages of {self.page_size})"), now, out)
            return
        self._register_if_ready(r, now, out)

    def _on_peer_info(self, room: int, peer: Peer, mismatch: Optional[str], now: float, out: list[Action]) -> None:
        r = self._rooms.get(room)
        if r is None or r.state is not DecodeState.PREALLOC or r.peer is not None:
            self._out_of_order(room, PeerInfo(room, peer, mismatch), out)
            return
        if r.alone or r.fallback is not None:
            self._out_of_order(room, PeerInfo(room, peer, mismatch), out)
            return
        if self.peers.is_lost(peer):
            self._kv_lost(r, Ending(Reason.PEER_LOST, f"bootstrap info names {peer}, declared lost"), now, out)
            return
        # Fetched info is fresh: it proves ``peer`` is what runs under its name now.
        for lost in self.peers.heard(peer, now, fresh=True):
            self._peer_lost(lost, f"{lost[0]} restarted as {peer}", now, out)
        r.peer = peer
        self.peers.bind(peer, room, now)
        if mismatch:
            self._kv_lost(r, Ending(Reason.INCOMPATIBLE_PEER, f"{mismatch} differs from {peer}"), now, out)
            return
        self._register_if_ready(r, now, out)

    def _register_if_ready(self, r: DecodeRoom, now: float, out: list[Action]) -> None:
        if (r.alone or r.fallback is not None) and r.pages:
            self._compute_here(r, now, out)
            return
        if not r.pages or r.peer is None:
            return
        self._send_registration(r, now, out)
        r.registered = True
        self._enter(r, DecodeState.AWAITING_KV, now, out)

    def _send_registration(self, r: DecodeRoom, now: float, out: list[Action]) -> None:
        """Send RegisterRoom, and again after ``register_resend_s`` unless the KV or the end comes."""
        out.append(SendToPeer(r.peer, protocol.RegisterRoom(
            r.id, self.incarnation, r.peer.incarnation, r.rid, r.prompt_len,
            list(r.pages[r.cached_pages: r.n_pages]), r.cached_pages * self.page_size)))
        self._timers.set(("resend", r.id), now + self.cfg.register_resend_s)

    def _on_other_timer(self, kind: str, room: int, now: float, out: list[Action]) -> None:
        """AWAITING_KV: send the registration again (a lost one would cost the request; prefill
        takes a duplicate from the same peer as a no-op), until the KV or the end comes."""
        if kind != "resend":
            return super()._on_other_timer(kind, room, now, out)
        r = self._rooms.get(room)
        if r is not None and r.state is DecodeState.AWAITING_KV and self._reachable(r.peer):
            self._send_registration(r, now, out)
        elif r is not None and r.state is DecodeState.RECLAIMING and self._reachable(r.peer):
            self._send_abort(r, now, out)

    # == messages from prefill ==================================================================

    def _on_peer_message(self, peer: Peer, msg, now: float, out: list[Action]) -> None:
        room = getattr(msg, "room", None)
        if self.peers.is_lost(peer):
            out.append(Notice(self.role, NoticeKind.FROM_LOST_PEER, room, f"{type(msg).__name__} from {peer}"))
            return
        self.peers.heard(peer, now)
        if not isinstance(msg, (protocol.KVDone, protocol.RoomFailed, protocol.WritesSettled)):
            out.append(Notice(self.role, NoticeKind.UNEXPECTED_MESSAGE, room, f"{type(msg).__name__} from {peer}"))
            return
        r = self._rooms.get(room)
        if r is None:
            self._on_message_for_absent_room(peer, msg, now, out)
        elif r.peer is not None and r.peer != peer:
            out.append(Notice(self.role, NoticeKind.WRONG_PEER, room,
                              f"{type(msg).__name__} from {peer}, owner {r.peer}"))
        elif isinstance(msg, protocol.KVDone):
            self._on_kv_done(r, msg, now, out)
        elif isinstance(msg, protocol.RoomFailed):
            self._on_room_failed(r, msg, now, out)
        else:
            self._on_writes_settled(r, now, out)
        if isinstance(msg, protocol.RoomFailed) and msg.reason == Reason.PEER_LOST.value:
            # Prefill declared this session lost and will refuse all of it: end it here too, so
            # that the next room opens a new session (a healed asymmetric partition serves again).
            lost = self.peers.declare_lost(peer, now)
            if lost is not None:
                self._peer_lost(lost, "it declared this session lost", now, out)

    def _on_message_for_absent_room(self, peer: Peer, msg, now: float, out: list[Action]) -> None:
        if isinstance(msg, protocol.RoomFailed) and msg.room not in self._tombstones:
            if self._peer_may_tombstone(peer, msg.room, "RoomFailed", out):
                self._abort_unseen(msg.room, ending_from_peer(msg.reason), now, out)
        else:
            out.append(Notice(self.role, NoticeKind.LATE_MESSAGE, msg.room, f"{type(msg).__name__} from {peer}"))

    def _on_kv_done(self, r: DecodeRoom, msg: protocol.KVDone, now: float, out: list[Action]) -> None:
        if is_terminal(r.state):  # quarantined: every write has landed after all
            r.kv_done = True
            self._release(r, now, out)
        elif r.state is DecodeState.RECLAIMING:  # every write has landed: the pages are the room's alone again
            r.kv_done = True
            self._compute_here(r, now, out)
        elif r.state is not DecodeState.AWAITING_KV:
            out.append(Notice(self.role, NoticeKind.LATE_MESSAGE, r.id, f"KVDone in {r.state.value}"))
        elif msg.num_tokens != r.prompt_len:
            r.kv_done = True
            self._kv_lost(r, Ending(Reason.TRANSFER_ERROR,
                                    f"KV of {msg.num_tokens} tokens arrived for a prompt of {r.prompt_len}"), now, out)
        elif self.vocab_size is not None and not 0 <= msg.first_token < self.vocab_size:
            r.kv_done = True  # every write has landed; only the token is wrong
            self._kv_lost(r, Ending(Reason.TRANSFER_ERROR, f"the first token {msg.first_token} from {r.peer} is not "
                                    f"a token of this model (vocabulary of {self.vocab_size})"), now, out)
        else:
            r.kv_done, r.first_token = True, msg.first_token
            self._timers.cancel(("resend", r.id))
            self.peers.unbind(r.peer, r.id)  # prefill's part is over: losing it now costs nothing
            self._enter(r, DecodeState.DECODING, now, out)
            self._wait_turn(r, now)
            out.append(StartDecode(r.id, r.rid, msg.first_token, msg.first_logprobs))

    def _on_room_failed(self, r: DecodeRoom, msg: protocol.RoomFailed, now: float, out: list[Action]) -> None:
        if is_terminal(r.state):
            out.append(Notice(self.role, NoticeKind.LATE_MESSAGE, r.id, f"RoomFailed({msg.reason}) after {r.ending}"))
        elif r.state in (DecodeState.RECLAIMING, DecodeState.PREFILLING):  # it no longer waits for that prefill's KV
            out.append(Notice(self.role, NoticeKind.LATE_MESSAGE, r.id, f"RoomFailed({msg.reason}) in {r.state.value}"))
        else:
            self._kv_lost(r, ending_from_peer(msg.reason), now, out)

    def _on_writes_settled(self, r: DecodeRoom, now: float, out: list[Action]) -> None:
        r.settled = True
        if is_terminal(r.state):
            self._release(r, now, out)
        elif r.state is DecodeState.RECLAIMING:
            self._compute_here(r, now, out)
        elif r.state is DecodeState.AWAITING_KV:  # its RoomFailed was lost or overtaken
            self._kv_lost(r, Ending(Reason.PEER_FAILED, "prefill settled its writes without sending the KV"), now, out)
        else:
            out.append(Notice(self.role, NoticeKind.LATE_MESSAGE, r.id, f"WritesSettled in {r.state.value}"))

    # == the prompt computed here (recompute.py decides when) ===================================

    def _kv_lost(self, r: DecodeRoom, ending: Ending, now: float, out: list[Action],
                 wait_for_pages: bool = True) -> None:
        """The room's KV will not come (``ending`` says why): end it, or fall back as the policy's
        :class:`~splitserve.disagg.lifecycle.recompute.Plan` says."""
        plan = self.recompute.plan(r, ending, wait_for_pages, self._writes_may_land(r))
        if plan is Plan.END:
            self._end(r, ending, now, out)
            return
        r.fallback = ending
        out.append(KVFallback(r.id, r.rid, ending.reason, ending.detail))
        self._timers.cancel(("resend", r.id))
        if plan is Plan.AWAIT_PAGES:
            if not ending.from_peer and self._reachable(r.peer):
                out.append(SendToPeer(r.peer, protocol.AbortRoom(r.id, self.incarnation, ending.reason.value)))
            self.peers.unbind(r.peer, r.id)
        elif plan is Plan.RECLAIM:
            self._enter(r, DecodeState.RECLAIMING, now, out)
            self._send_abort(r, now, out)  # prefill answers WritesSettled once none of its writes can land
        else:
            if not ending.from_peer and not r.kv_done and self._reachable(r.peer):
                out.append(SendToPeer(r.peer, protocol.AbortRoom(r.id, self.incarnation, ending.reason.value)))
            self._compute_here(r, now, out)

    def _send_abort(self, r: DecodeRoom, now: float, out: list[Action]) -> None:
        """RECLAIMING: tell prefill the room is over for it, and again every ``quarantine_resend_s``."""
        out.append(SendToPeer(r.peer, protocol.AbortRoom(r.id, self.incarnation, r.fallback.reason.value)))
        self._timers.set(("resend", r.id), now + self.cfg.quarantine_resend_s)

    def _compute_here(self, r: DecodeRoom, now: float, out: list[Action]) -> None:
        """No write of a prefill can reach the room's pages: its prompt runs here, into them."""
        self._timers.cancel(("resend", r.id))
        self.peers.unbind(r.peer, r.id)  # it no longer depends on that prefill
        r.reclaimed = True
        self._enter(r, DecodeState.PREFILLING, now, out)
        self._wait_turn(r, now)
        out.append(ComputePrompt(r.id, r.rid, r.fallback.reason if r.fallback is not None else None))

    def _wait_turn(self, r: DecodeRoom, now: float) -> None:
        """Waiting behind work the engine does is no stall: ``queue_s`` bounds it until ``Admitted``."""
        r.waits_turn = True
        self._arm(r, self.cfg.queue_s, now)

    def _first_token_here(self, room: int, now: float, out: list[Action]) -> None:  # it decodes from now on
        r = self._rooms.get(room)
        if r is not None and r.state is DecodeState.PREFILLING:
            self._enter(r, DecodeState.DECODING, now, out)

    # == the end of a room ======================================================================

    def _kv_timed_out(self, r: DecodeRoom, ending: Ending, now: float, out: list[Action]) -> None:
        self._kv_lost(r, ending, now, out, wait_for_pages=False)  # its pages' deadline: no room for a recompute

    def _writes_may_land(self, r: DecodeRoom) -> bool:
        return r.registered and not r.reclaimed and not r.kv_done and not r.settled and self._reachable(r.peer)

    def _after_end(self, r: DecodeRoom, last: State, now: float, out: list[Action]) -> None:
        self._timers.cancel(("resend", r.id))
        # Tell prefill, unless it told us, is lost, already finished its part (KVDone), or was
        # told when the room fell back.
        if (r.ending.outcome is not Outcome.FINISHED and not r.ending.from_peer and not r.kv_done
                and r.fallback is None and self._reachable(r.peer)):
            out.append(SendToPeer(r.peer, protocol.AbortRoom(r.id, self.incarnation, r.ending.reason.value)))
        if self._writes_may_land(r):
            if r.cached_pages:  # shared, never a write target: given back at once
                out.append(FreePages(r.id, r.pages[: r.cached_pages]))
                r.pages, r.cached_pages = r.pages[r.cached_pages:], 0
            r.quarantined = True
            self._quarantined_pages += len(r.pages)
            out.append(QuarantinePages(r.id, r.pages))
            self._hold(r, self.cfg.quarantine_resend_s, now)
        else:
            self._release(r, now, out)

    def _release_memory(self, r: DecodeRoom, now: float, out: list[Action]) -> None:
        if r.quarantined:
            self._quarantined_pages -= len(r.pages)
        if r.pages:
            out.append(ReleaseQuarantine(r.id, r.pages) if r.quarantined else FreePages(r.id, r.pages))

    def _on_held_timer(self, r: DecodeRoom, now: float, out: list[Action]) -> None:
        """Quarantined: ask again (prefill answers WritesSettled for a room it has released)."""
        if self._reachable(r.peer):
            out.append(SendToPeer(r.peer, protocol.AbortRoom(r.id, self.incarnation, r.ending.reason.value)))
        self._hold(r, self.cfg.quarantine_resend_s, now)

    def _on_peer_lost(self, room: int, peer: Peer, detail: str, now: float, out: list[Action]) -> None:
        r = self._rooms.get(room)
        if r is None:
            return
        if r.state is DecodeState.RECLAIMING:  # the disconnect (emitted just before) fenced the peer's writes
            self._compute_here(r, now, out)
        elif r.state in (DecodeState.PREALLOC, DecodeState.AWAITING_KV):
            self._kv_lost(r, Ending(Reason.PEER_LOST, detail), now, out)
        elif not is_terminal(r.state):
            self._end(r, Ending(Reason.PEER_LOST, detail), now, out)
        else:  # quarantined: the disconnect (emitted just before) fences the peer's writes
            self._release(r, now, out)
