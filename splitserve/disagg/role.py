"""What the prefill and the decode role share: the room table driven from the engine loop, one
record per room, and carrying out the table's actions so that nothing stops half way.

The engine loop (``engine/async_engine.py``) calls a role at fixed points; a disaggregated role
turns each call into lifecycle events for its table (``lifecycle/``) and carries out the actions
the table returns. **The table decides**; the role only translates between the table and the
engine, the transfer thread and the control thread.

One record per room (:class:`RoomRecord`): the request, the engine's sequence once there is one,
and the room's pages; every other structure (the rid index, decode's page queue, the quarantined
page count, the gauges) is derived from the records. A record lives until its request is
answered, holds no page *and* has no sequence in the engine; a page has one owner at a time.

Carrying out actions (:meth:`DisaggRole._execute`) never stops half way: an action that raises is
logged and counted, its room is failed *through the table* (``LocalFailure(internal_error)``),
and the rest of the list still runs. A hand-over a session's end leaves for the threads is owed
until it succeeds (``handovers.py``). Fields a peer sends are checked against what this worker
knows before they reach the engine, so a bad peer fails its room, never the worker.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Optional

from splitserve.config import ServerConfig
from splitserve.disagg.lifecycle import (
    Cancel, ClientAbort, CountOutcome, Deadlines, DisconnectPeer, FreePages, KVLost, LocalFailure, LogTerminal,
    Moved, Notice, NotifyClient, Outcome, Peer, PeerHeard, PeerLost, RequestArrived, SendToPeer,
)
from splitserve.disagg.faults import Faults
from splitserve.disagg.handovers import HandOvers
from splitserve.disagg.room_timelines import RoomTimelines
from splitserve.disagg.seams import Seams
from splitserve.engine.engine import StepReport
from splitserve.engine.io import GenerateRequest, InvalidRequest, RequestOutput
from splitserve.engine.sequence import Sequence
from splitserve.engine.worker_stats import DecodeStats, PrefillStats, RoleStats
from splitserve.log_sparsely import worth_logging
from splitserve.outcomes import Ending, Reason

log = logging.getLogger(__name__)


@dataclass(eq=False)
class RoomRecord:
    """Everything this worker holds for one room."""

    room: int
    req: GenerateRequest
    seq: Optional[Sequence] = None
    """The engine's sequence (prefill: from ``Enqueue``; decode: from ``StartDecode``)."""
    pages: list[int] = field(default_factory=list)
    """Pages the room holds itself: decode's reserved pages before ``StartDecode``, and quarantined
    ones. A sequence's pages are its own (``seq.pages``)."""
    want_pages: int = 0
    """Decode: pages asked for while the room waits in the page queue; 0 when it does not."""
    cached_pages: int = 0
    """Decode: how many of ``pages`` (the first) came from the prefix cache: shared, read-only."""
    quarantined: bool = False
    answered: bool = False
    timeline: Optional[object] = None
    """Every state the room passed here (``timeline.Timeline``), for ``/debug/requests/{rid}``."""

    def take_pages(self, named: Optional[tuple[int, ...]] = None) -> list[int]:
        """Pages the room holds no more: ``named`` ones of its own (before it decodes: e.g. its
        cached prefix, given back while the rest is quarantined), else — and always once it has a
        sequence, whose pages may have grown past what the table saw — every page it holds."""
        if not self.gives_back_all(named):
            self.pages = [p for p in self.pages if p not in set(named)]
            return list(named)
        pages, self.pages = self.pages, []
        if self.seq is not None:
            pages, self.seq.pages = pages + self.seq.pages, []
        return pages

    def gives_back_all(self, named: Optional[tuple[int, ...]]) -> bool:
        """Whether :meth:`take_pages` with ``named`` takes every page the room holds."""
        return named is None or self.seq is not None or not set(named) < set(self.pages)

    @property
    def holds_pages(self) -> bool:
        return bool(self.pages) or (self.seq is not None and bool(self.seq.pages))


class DisaggRole:
    name = "disagg"
    prompt_only = False  # prefill holds the prompt's KV only

    def __init__(self, server: ServerConfig, deadlines: Deadlines, faults: Faults = Faults(), seams: Seams = Seams()):
        self.server = server
        self.seams = seams
        self.deadlines = deadlines
        self.faults = faults
        self.table = None
        self.control = None
        self.transfer = None
        self.rooms: dict[int, RoomRecord] = {}
        self.room_of: dict[str, int] = {}  # rid -> room: an index of ``rooms``
        self.outcomes: Counter = Counter()  # (outcome, reason) -> count, from CountOutcome
        self.notices: Counter = Counter()
        self.action_failures = 0
        self.handovers = HandOvers(self.name)
        self._unwedge = threading.Event()
        self._wedge_loop = faults.wedge_loop
        self._block_zmq_io = faults.block_zmq_io
        self.clock = time.monotonic  # the only clock the role reads (a simulator swaps it)
        self.timelines = RoomTimelines(self.name, lambda: self.clock())
        self._hung_reported = False
        # set by the worker's metrics (called on the engine loop; the metric objects are thread-safe)
        self.on_outcome = None
        self.on_state_time = None

    @property
    def advertise_host(self) -> str:
        return self.server.advertise_host or self.server.host

    # -- the Role interface ---------------------------------------------------------------------

    def start(self, loop) -> None:
        from splitserve.disagg.bootstrap import local_info, new_incarnation

        self.loop = loop
        self.engine = loop.engine
        self.post = loop.poster()  # what the threads post with: dropped once this role is replaced
        self.incarnation = (self.seams.incarnation or new_incarnation)()
        self.secret = self._cluster_secret()
        override = getattr(self.engine.config, "chat_template", None)  # --chat-template counts in the identity
        self.info = local_info(self.engine.spec, self.engine.layout, self.server.transfer_backend, self.incarnation,
                               self.engine.tokenizer.chat_template if override else None)
        self.timelines.page_nbytes = self.engine.layout.page_nbytes
        self._start()
        for thread in (self.transfer, self.control):
            thread.clock = self.clock
            thread.beat()
        if self.seams.threads:
            self.transfer.start()
            self.control.start()

    def _io_probe(self):
        from splitserve.disagg.control.io_probe import IoProbe

        return (self.seams.io_probe or IoProbe)()

    def _transfer_opts(self) -> dict:
        from splitserve.disagg.transfer.base import get_backend

        opts = get_backend(self.server.transfer_backend).options(self.advertise_host, self.secret)
        return {**opts, **self.seams.transfer_opts}

    def _cluster_secret(self):
        """``--cluster-secret-file`` loaded (``disagg/control/curve.py``), or None, said once in a warning."""
        from splitserve.disagg.control.curve import ClusterSecret

        if self.server.cluster_secret_file:
            log.info("control plane: CURVE with keys from --cluster-secret-file; only its holders can connect")
            return ClusterSecret.load(self.server.cluster_secret_file)
        log.warning("control plane UNAUTHENTICATED: anyone who can reach this worker's control sockets can speak "
                    "its protocol; give prefill and decode workers --cluster-secret-file (docs/security.md)")
        return None

    def check(self, req: GenerateRequest) -> None:
        if req.bootstrap is None:
            raise InvalidRequest(f"this is a {self.name} worker: a request needs bootstrap_host, bootstrap_port "
                                 "and bootstrap_room (send it through the router)", param="bootstrap_room")
        self.engine.check_fits(req, prompt_only=self.prompt_only)

    def admit(self, req: GenerateRequest) -> list[RequestOutput]:
        return self._admit_room(req, req.bootstrap.room)

    def _admit_room(self, req: GenerateRequest, room: int, alone: bool = False) -> list[RequestOutput]:
        if room in self.rooms:
            if self.on_outcome is not None:  # never reached the lifecycle, which counts the rest
                self.on_outcome("failed", Reason.BAD_REQUEST.value)
            return [RequestOutput.ended(req.rid, Ending(Reason.BAD_REQUEST,
                                                       f"bootstrap_room {room} is already in use on this worker"))]
        self.rooms[room] = RoomRecord(room, req, timeline=self.timelines.start(req.rid, room, None, self.clock()))
        self.room_of[req.rid] = room
        out = self._handle_event(RequestArrived(room, req.rid, len(req.prompt_ids), alone=alone,
                                                deadline_s=req.deadline_s))
        self._arrived(self.rooms.get(room), out)
        return out

    def abort(self, rid: str, ending: Ending) -> list[RequestOutput]:
        room = self.room_of.get(rid)
        return self._handle_event(ClientAbort(room, ending.detail)) if room is not None else []

    def abort_request(self, rid: Optional[str], room: Optional[int], kv_lost: bool,
                      detail: str) -> tuple[bool, list[RequestOutput]]:
        """``POST /abort_request``: the room of ``rid`` (or ``room``), if it is here and not
        answered yet, ends as its client's abort, or (``kv_lost``) learns that its KV will not
        come (decode: ``KVLost``). Whether it was here."""
        room = self.room_of.get(rid) if room is None else room
        rec = self.rooms.get(room) if room is not None else None
        if rec is None or rec.answered or (rid is not None and rec.req.rid != rid):
            return False, []
        return True, self._handle_event(KVLost(room, detail) if kv_lost else ClientAbort(room, detail))

    def on_event(self, event: object) -> list[RequestOutput]:
        return self._handle_event(event)

    def tick(self, now: float) -> list[RequestOutput]:
        """Liveness first (taken from the control thread, never queued behind a burst of events),
        then what is due by the clock."""
        if self._wedge_loop and self.table.live_rooms():
            self._wedge()
        if self._block_zmq_io and self.table.live_rooms():
            from splitserve.disagg.control.io_probe import block_io_thread

            self._block_zmq_io = False
            block_io_thread()
        out: list[RequestOutput] = []
        self.handovers.retry_owed()
        self._check_threads(out)
        for peer, fresh in self.control.take_heard().items():
            self._execute(self._seen_by_timelines(self.table.handle(PeerHeard(peer, fresh), now), now), out)
        self._execute(self._seen_by_timelines(self.table.expire(now), now), out)
        return out

    def after_step(self, report: StepReport) -> list[RequestOutput]:
        raise NotImplementedError

    def fail_all(self, ending: Ending) -> list[RequestOutput]:
        """Every live room fails through the table (shutdown, or a bug that escaped): answers,
        counts and frees by the rules; a request the table never took is answered here."""
        out: list[RequestOutput] = []
        for room in self.table.live_rooms():
            out += self._handle_event(LocalFailure(room, ending.reason, ending.detail))
        for rec in list(self.rooms.values()):
            if not rec.answered:
                out.append(self._answer_untaken(rec, ending, "fail_all"))
        return out

    def fail_request(self, rid: str, ending: Ending) -> list[RequestOutput]:
        """``rid``'s admission raised: its room fails through the table if the table took it;
        else (it raised before) it is answered here, and its record forgotten."""
        room = self.room_of.get(rid)
        if room is None:  # no record was made
            return [RequestOutput.ended(rid, ending)]
        live = room in self.table.live_rooms()
        out = self._handle_event(LocalFailure(room, ending.reason, ending.detail)) if live else []
        rec = self.rooms.get(room)
        if rec is not None and not rec.answered:
            out.append(self._answer_untaken(rec, ending, "fail_request"))
        return out

    def _answer_untaken(self, rec: RoomRecord, ending: Ending, cause: str) -> RequestOutput:
        """Answer a request the table never took (its admission raised first): its timeline ends,
        and its record goes once nothing of it is left here."""
        rec.answered = True
        self.room_of.pop(rec.req.rid, None)
        now = self.clock()
        if rec.timeline is not None and rec.timeline.live:
            rec.timeline.end(f"{ending.outcome.value}({ending.reason.value})", now, cause)
            self.timelines.ended(rec.timeline)
        self._forget_if_done(rec)
        return RequestOutput.ended(rec.req.rid, ending)

    def health_problem(self) -> Optional[str]:
        """Why this worker cannot serve although its engine loop runs (any thread may ask): a
        transfer or control thread that stopped beating (hung in a call that never returns), or a
        ZMQ I/O thread that moves no probe (blocked: no control socket moves a frame)."""
        stall = self.loop.loop_stall_s
        for thread in (self.transfer, self.control):
            if thread is not None and thread.alive() and thread.age() > stall:
                return f"the {thread.name} thread has made no iteration for {thread.age():.0f}s (--loop-stall-s {stall:g})"
        io_age = self.control.io_age() if self.control is not None else None
        if io_age is not None and io_age > stall:
            return (f"the ZMQ I/O thread has moved no probe for {io_age:.0f}s (--loop-stall-s {stall:g}): "
                    "no control socket of this worker moves")
        return None

    def _check_threads(self, out: list[RequestOutput]) -> None:
        """A hung thread cannot be restarted, and nothing of this worker's peers can go on without
        it: the first time, every peer a room depends on is declared lost (its rooms fail, decode
        fences), and the worker reports itself unhealthy until it is restarted."""
        problem = self.health_problem()
        if problem is None or self._hung_reported:
            return
        self._hung_reported = True
        log.error("%s: this worker must be restarted; its peers are declared lost", problem)
        for peer in self.table.peers.live_peers():
            out += self._handle_event(PeerLost(peer, problem))

    def wait_s(self, now: float) -> float:
        due = self.table.next_due()
        return max(0.001, min(0.05, due - now)) if due is not None else 0.05

    def stats(self) -> RoleStats:
        counts = self.table.counts_by_state()
        live = {state.value for state in self.table.transitions.live_states()}
        now = self.clock()
        sizes = self.control.sizes()
        threads = (self.control, self.transfer)
        return RoleStats(
            queues={name: n for name, n in counts.items() if name in live},
            lifecycle={name: n for name, n in counts.items() if name not in live},
            outcomes=dict(self.outcomes), notices=dict(self.notices),
            peers=self.table.peers.counts(),
            peer_silence={row["peer"]: round(row["silent_s"], 3) for row in self.table.peers.snapshot(now)},
            action_failures=self.action_failures,
            control_sessions=sizes["sessions"], control_ended=sizes.get("ended"),
            bad_frames=self.control.dropped(),
            transfer_peers=self.transfer.peer_count(),
            thread_restarts={t.name: t.restarts for t in threads},
            thread_age={t.name: round(t.age(), 3) for t in threads},
            zmq_io_age=None if (io_age := self.control.io_age()) is None else round(io_age, 3),
            own=self._own_stats(),
        )

    def _own_stats(self) -> PrefillStats | DecodeStats | None:
        """What only this kind of role counts (a prefill's or a decode's)."""
        return None

    def debug_rows(self, now: float) -> list[dict]:
        return self.table.snapshot(now)

    def close(self, goodbye: Optional[str] = "the worker shuts down") -> None:
        """Stop the threads and close the sockets and the transfer agent. The control plane tells
        every peer that this incarnation ended (``goodbye``, why; None: it does not), so that they
        end its sessions at once instead of at the peer-silence bound."""
        self._unwedge.set()
        if self.control is not None:
            self.control.close(goodbye)
        if self.transfer is not None:
            self.transfer.stop()
        self._close()

    def holds_nothing(self) -> bool:
        """No room is left here, none holds pages, and no hand-over is owed (any thread may ask: a
        worker that switches its role waits for this)."""
        return not self.rooms and not self.handovers.owed()

    def release_all(self) -> int:
        """After :meth:`close` (every link fenced, every thread stopped): every page a room still
        holds goes back to the allocator, and the engine forgets the rooms' sequences; the number
        of pages. Nothing can write into them any more, and nothing of this role runs again."""
        pages = 0
        for rec in list(self.rooms.values()):
            if rec.seq is not None and self.engine.runs(rec.seq):
                self.engine.cancel(rec.seq.rid)
            held = rec.take_pages()
            pages += len(held)
            self.engine.allocator.free(held)
        for seq in self.engine.live_sequences():  # one no room knew of (a bug): never leak its pages
            self.engine.cancel(seq.rid)
            pages += len(seq.pages)
            self.engine.allocator.free(seq.pages)
            seq.pages = []
        self.rooms.clear()
        self.room_of.clear()
        self.handovers.forget()
        return pages

    # -- carrying out the table's actions -----------------------------------------------------------

    def _handle_event(self, event: object) -> list[RequestOutput]:
        """``event`` through the table: the rooms' timelines see it, the table decides, and its
        actions are carried out; what they answer."""
        out: list[RequestOutput] = []
        now = self.clock()
        self.timelines.event(event, now)
        self._execute(self._seen_by_timelines(self.table.handle(event, now), now), out)
        return out

    def _seen_by_timelines(self, actions: list, now: float) -> list:
        """``actions``, once the rooms' timelines have read them."""
        self.timelines.note(actions, now)
        return actions

    def _execute(self, actions: list, out: list[RequestOutput]) -> None:
        """Carry out ``actions`` in order; one that raises fails its room through the table (its
        follow-up actions run next) and the rest still run."""
        todo = deque(actions)
        while todo:
            a = todo.popleft()
            try:
                self._do(a, out)
            except Exception as exc:
                self.action_failures += 1
                log.exception("%s: %s failed", self.name, type(a).__name__)
                detail = f"{type(a).__name__} failed: {type(exc).__name__}: {exc}"
                if isinstance(a, NotifyClient):  # the answer itself failed: answer plainly
                    out.append(RequestOutput.ended(a.rid, Ending(Reason.INTERNAL_ERROR, detail)))
                room = getattr(a, "room", None)
                if room is not None:
                    now = self.clock()
                    failure = LocalFailure(room, Reason.INTERNAL_ERROR, detail)
                    todo.extend(self._seen_by_timelines(self.table.handle(failure, now), now))

    def _do(self, a, out: list[RequestOutput]) -> None:
        match a:
            case SendToPeer():
                self._send(a.peer, a.msg)
            case Cancel():
                self._cancel(a.room)
            case FreePages():
                self._free_room(a.room, a.pages)
            case NotifyClient():
                self._answer(a, out)
            case LogTerminal():
                log.info("%s timeline: %s", a.line(), self.timelines.short_room(a.room))
            case CountOutcome():
                outcome = a.outcome.value.lower()
                self.outcomes[(outcome, a.reason.value)] += 1
                if self.on_outcome is not None:
                    self.on_outcome(outcome, a.reason.value)
            case Moved():
                if self.on_state_time is not None and a.before is not None:
                    self.on_state_time(a.before.value, a.seconds)
            case Notice():
                self._notice(a)
            case DisconnectPeer():
                log.warning("peer %s lost: %s", a.peer, a.detail)
                self._disconnect(a)
            case _:
                self._do_role(a, out)

    def _notice(self, a: Notice) -> None:
        n = self.notices[a.kind.value] = self.notices[a.kind.value] + 1
        if worth_logging(n):
            log.info("%s notice %s room=%s %s%s", a.role.value, a.kind.value, a.room, a.detail,
                     f" ({n} of this kind so far)" if n > 20 else "")

    def _answer(self, a: NotifyClient, out: list[RequestOutput]) -> None:
        rec = self.rooms.get(a.room)
        if rec is None or rec.answered:
            return
        rec.answered = True
        self.room_of.pop(rec.req.rid, None)
        if a.ending.outcome is Outcome.FINISHED:
            out += self._success(rec)
        else:
            out.append(RequestOutput.ended(a.rid, a.ending))
        self._forget_if_done(rec)

    def _cancel(self, room: int) -> None:
        rec = self.rooms.get(room)
        if rec is None:
            return
        rec.want_pages = 0  # out of decode's page queue
        if rec.seq is not None:
            self.engine.cancel(rec.seq.rid)  # out of every engine queue; its pages stay the room's
        self._forget_if_done(rec)  # answered while it waited for pages, and holding none: nothing will come back for it

    def _free_room(self, room: int, named: Optional[tuple[int, ...]] = None) -> None:
        rec = self.rooms.get(room)
        if rec is None:
            return
        self.engine.allocator.free(rec.take_pages(named))
        if not rec.holds_pages:  # a quarantined room gives its cached prefix back first: not released yet
            self.timelines.released(room, "released", self.clock())
        self._forget_if_done(rec)

    def _forget_if_done(self, rec: RoomRecord) -> None:
        """Forget ``rec`` once nothing of its room is left here: answered, no pages held or wanted,
        and no sequence of it in the engine (a preempted one holds no pages but takes some again
        when it resumes: only the room's ``Cancel`` takes it out, and that may come after the answer)."""
        if rec.answered and not rec.holds_pages and not rec.want_pages and self.rooms.get(rec.room) is rec \
                and not (rec.seq is not None and self.engine.runs(rec.seq)):
            del self.rooms[rec.room]

    def _free_unowned(self, seq: Sequence) -> None:
        """A sequence the engine reports whose room is gone (a bug): never leak its pages."""
        log.error("%s: the engine reported sequence %s of a room this worker no longer holds", self.name, seq.rid)
        self.engine.cancel(seq.rid)
        self.engine.allocator.free(seq.pages)
        seq.pages = []

    def _record_of(self, seq: Sequence) -> Optional[RoomRecord]:
        """The record of ``seq``'s room: its own, or — a choice > 0 of a request with n > 1, forked
        by the engine from the room's sequence, with pages of its own — its request's room."""
        if seq.request_rid is not None:
            room = self.room_of.get(seq.request_rid)
            rec = self.rooms.get(room) if room is not None else None
            if rec is not None and rec.seq is not None and rec.seq.rid == seq.request_rid:
                return rec
            self._free_unowned(seq)
            return None
        rec = self.rooms.get(seq.room) if seq.room is not None else None
        if rec is None or rec.seq is not seq:
            self._free_unowned(seq)
            return None
        return rec

    def _wedge(self) -> None:
        """Fault injection (``wedge_loop``): the loop blocks until shutdown, as if a forward pass
        never returned, while the control and transfer threads live on."""
        log.error("injected fault: the engine loop wedges now (until shutdown)")
        self._wedge_loop = False
        self._unwedge.wait()

    # -- what each side fills in --------------------------------------------------------------------

    def _start(self) -> None:
        """Build the table, the transfer thread and the control thread (``start`` starts them)."""
        raise NotImplementedError

    def _arrived(self, rec: Optional[RoomRecord], out: list[RequestOutput]) -> None:
        """After the table took the request (``rec`` is None if it was answered already)."""

    def _send(self, peer: Peer, msg) -> None:
        self.control.send(peer, msg)

    def _success(self, rec: RoomRecord) -> list[RequestOutput]:
        return []

    def _disconnect(self, a: DisconnectPeer) -> None:
        self.handovers.hand_over(f"forgetting session {a.peer}", functools.partial(self.control.forget, a.peer))

    def _do_role(self, a, out: list[RequestOutput]) -> None:
        raise TypeError(f"{self.name} worker got an unexpected action {a!r}")

    def _close(self) -> None:
        pass
