"""The engine loop of a prefill or decode worker: the lifecycle tables wired to the engine.

``DisaggEngine`` is an :class:`AsyncEngine` (same HTTP interface) whose loop also owns a room
table (``lifecycle/``). Each iteration it feeds the table the events other threads posted (HTTP
arrivals and aborts, control messages, heartbeats, finished writes, arrived KV), then the passage
of time (``expire``), then what the engine's step did (a room scheduled, a chunk done, the first
token, a decode step, the end); and it carries out every action the table returns. The table
decides; this file only translates between the table and the engine, the transfer thread and the
control thread.

Pages of a room belong to the room, not to the engine: the engine never frees them; the table's
``FreePages`` / ``QuarantinePages`` / ``ReleaseQuarantine`` do, here, exactly once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Callable, Optional

from splitserve.config import EngineConfig, ServerConfig
from splitserve.disagg import protocol as p
from splitserve.disagg.bootstrap import local_info, new_incarnation
from splitserve.disagg.control import ControlFaults, DecodeControl, PrefillControl
from splitserve.disagg.lifecycle import (
    Cancel, CancelWrites, ChunkDone, ClientAbort, CountOutcome, DecodeStep, DecodeTable, Deadlines,
    DisconnectPeer, Enqueue, Finished, ForwardDone, FreePages, FromPeer, LocalFailure, LogTerminal, Notice,
    NotifyClient, ObserveStateTime, Outcome, PagesReserved, Peer, PrefillTable, QuarantinePages,
    Reason, ReleaseQuarantine, RequestArrived, ReservePages, ResetTransfer, Scheduled, SendToPeer,
    StartDecode, StartWrite,
)
from splitserve.disagg.transfer.base import create_backend, page_spans
from splitserve.disagg.transfer.links import ReceiveLinks
from splitserve.disagg.transfer_worker import (
    Cancel as CancelTransfer, FaultConfig, KVNotification, Notify, ResetPeer, TransferWorker, Write,
)
from splitserve.engine.async_engine import AbortRequest, AddRequest, AsyncEngine
from splitserve.engine.io import GenerateRequest, InvalidRequest, RequestOutput
from splitserve.engine.sequence import Sequence, SeqStatus

log = logging.getLogger(__name__)

HTTP_STATUS = {
    Reason.CLIENT_ABORT: 499, Reason.PEER_ABORT: 499, Reason.BAD_REQUEST: 400, Reason.OVERLOADED: 503,
    Reason.BOOTSTRAP_TIMEOUT: 504, Reason.TRANSFER_TIMEOUT: 504, Reason.REQUEST_TIMEOUT: 504,
    Reason.STALLED: 504, Reason.PEER_LOST: 502, Reason.PEER_FAILED: 502, Reason.TRANSFER_ERROR: 502,
    Reason.INCOMPATIBLE_PEER: 502, Reason.INTERNAL_ERROR: 500,
}


class DisaggEngine(AsyncEngine):
    role = "disagg"
    MAX_WAIT_S = 0.05  # the loop wakes at least this often while anything is pending

    def __init__(self, config: EngineConfig, server: ServerConfig, deadlines: Deadlines,
                 transfer_faults: Optional[FaultConfig] = None, control_faults: Optional[ControlFaults] = None,
                 wedge_loop: bool = False):
        super().__init__(config)
        self.server = server
        self.deadlines = deadlines
        self.incarnation = new_incarnation()
        self._transfer_faults = transfer_faults
        self._control_faults = control_faults
        self._wedge_loop = wedge_loop
        self._unwedge = threading.Event()
        self.table = None
        self.transfer: Optional[TransferWorker] = None
        self.control = None
        self._requests: dict[int, GenerateRequest] = {}  # room -> request, until the room's answer
        self._rooms_of: dict[str, int] = {}  # rid -> room
        self._seqs: dict[int, Sequence] = {}  # room -> its engine sequence (holds the pages)
        self.outcomes: Counter = Counter()  # (outcome, reason) -> count, from CountOutcome
        self.notices: Counter = Counter()
        # set by the worker's metrics (called on the engine loop; the metric objects are thread-safe)
        self.on_outcome: Optional[Callable[[str, str], None]] = None
        self.on_state_time: Optional[Callable[[str, float], None]] = None

    @property
    def advertise_host(self) -> str:
        return self.server.advertise_host or self.server.host

    # -- start and stop -----------------------------------------------------------------------

    def start(self, loop=None) -> None:
        from splitserve.engine.engine import LLMEngine

        self.engine = LLMEngine(self.config)
        self._open_transfer(f"{self.role}-{self.incarnation}", self.engine.kv.buffer)
        self.info = local_info(self.engine.spec, self.engine.layout, self.server.transfer_backend, self.incarnation)
        self._setup()
        self.transfer.start()
        super().start_loop(loop)

    def _backend_opts(self) -> dict:
        return {"host": self.advertise_host} if self.server.transfer_backend == "tcp" else {}

    def _open_transfer(self, agent_name: str, pool) -> None:
        """Set ``self.transfer``: the writer's backend (prefill) or the receiving links (decode)."""
        raise NotImplementedError

    def shutdown(self, reason: str = "the server is shutting down") -> None:
        self._unwedge.set()
        super().shutdown(reason)
        for thread in (self.control, self.transfer):
            if thread is not None:
                thread.stop()
        self._close_transfer()

    def submit(self, req: GenerateRequest):
        if req.bootstrap is None:
            raise InvalidRequest(f"this is a {self.role} worker: a request needs bootstrap_host, bootstrap_port "
                                 "and bootstrap_room (send it through the router)", param="bootstrap_room")
        return super().submit(req)

    # -- the loop -----------------------------------------------------------------------------

    def _wait_s(self) -> Optional[float]:
        if self.engine.has_work():
            return 0.0
        due = self.table.next_due()
        wait = self.MAX_WAIT_S if due is None else max(0.0, min(self.MAX_WAIT_S, due - time.monotonic()))
        return wait or 0.001

    def _handle(self, ev: object) -> list[RequestOutput]:
        out: list[RequestOutput] = []
        if isinstance(ev, AddRequest):
            self._arrive(ev.req, out)
        elif isinstance(ev, AbortRequest):
            room = self._rooms_of.get(ev.rid)
            if room is not None:
                self._feed(ClientAbort(room, ev.reason), out)
        elif isinstance(ev, KVNotification):
            self._on_notification(ev, out)
        else:
            self._feed(ev, out)
        return out

    def _arrive(self, req: GenerateRequest, out: list[RequestOutput]) -> None:
        room = req.bootstrap.room
        if room in self._requests:
            out.append(RequestOutput(rid=req.rid, finished=True, error_code=400,
                                     error=f"bootstrap_room {room} is already in use on this worker"))
            if self.on_outcome is not None:  # never reached the lifecycle, which counts the rest
                self.on_outcome("failed", Reason.BAD_REQUEST.value)
            return
        self._requests[room] = req
        self._rooms_of[req.rid] = room
        self._feed(RequestArrived(room, req.rid, len(req.prompt_ids)), out)

    def _tick(self) -> list[RequestOutput]:
        if self._wedge_loop and self.table.live_rooms():
            self._wedge()
        out: list[RequestOutput] = []
        self._execute(self.table.expire(time.monotonic()), out)
        return out

    def _wedge(self) -> None:
        """Fault injection (``wedge_loop``): the loop blocks until shutdown, as if a forward pass
        never returned, while the control and transfer threads live on."""
        log.error("injected fault: the engine loop wedges now (until shutdown)")
        self._wedge_loop = False
        self._unwedge.wait()

    def _feed(self, event: object, out: list[RequestOutput]) -> None:
        self._execute(self.table.handle(event, time.monotonic()), out)

    def _stop_all(self, reason: str, code: int = 503) -> list[RequestOutput]:
        outs = [RequestOutput(rid=req.rid, finished=True, error=reason, error_code=code)
                for req in self._requests.values()]
        outs += self.engine.abort_all(reason, code)
        return outs

    def _collect_stats(self) -> dict:
        stats = super()._collect_stats()
        counts = self.table.counts_by_state()
        live = {state.value for state in self.table._live_states()}
        stats["queues"] = {name: n for name, n in counts.items() if name in live}
        stats["lifecycle"] = {name: n for name, n in counts.items() if name not in live}
        stats["outcomes"] = dict(self.outcomes)
        stats["notices"] = dict(self.notices)
        now = time.monotonic()
        stats["peers"] = self.table.peers.counts()
        stats["peer_silence"] = {row["peer"]: round(row["silent_s"], 3) for row in self.table.peers.snapshot(now)}
        return stats

    def debug_requests(self) -> list[dict]:
        """Thread-safe: a snapshot of every live room, taken on the engine loop."""
        return self.ask_loop(lambda: self.table.snapshot(time.monotonic()))

    # -- actions ------------------------------------------------------------------------------

    def _execute(self, actions: list, out: list[RequestOutput]) -> None:
        for action in actions:
            self._do(action, out)

    def _do(self, a, out: list[RequestOutput]) -> None:
        if isinstance(a, SendToPeer):
            self._send(a.peer, a.msg)
        elif isinstance(a, Cancel):
            seq = self.engine.cancel(a.rid)
            if seq is not None and seq.pages:  # its room frees them (FreePages)
                self._seqs.setdefault(a.room, seq)
        elif isinstance(a, FreePages):
            self._free(a.room, a.pages)
        elif isinstance(a, NotifyClient):
            self._answer(a, out)
        elif isinstance(a, LogTerminal):
            log.info(a.line())
        elif isinstance(a, CountOutcome):
            outcome = a.outcome.value.lower()
            self.outcomes[(outcome, a.reason.value)] += 1
            if self.on_outcome is not None:
                self.on_outcome(outcome, a.reason.value)
        elif isinstance(a, ObserveStateTime):
            if self.on_state_time is not None:
                self.on_state_time(a.state.value, a.seconds)
        elif isinstance(a, Notice):
            self.notices[a.kind.value] += 1
            log.info("%s notice %s room=%s %s", a.role.value, a.kind.value, a.room, a.detail)
        elif isinstance(a, DisconnectPeer):
            log.warning("peer %s lost: %s", a.peer, a.detail)
            self._forget_peer(a.peer)
        else:
            self._do_role(a, out)

    def _do_role(self, a, out: list[RequestOutput]) -> None:
        raise TypeError(f"{self.role} worker got an unexpected action {a!r}")

    def _send(self, peer: Peer, msg) -> None:
        self.control.send(peer, msg)

    def _free(self, room: int, pages: tuple[int, ...]) -> None:
        seq = self._seqs.pop(room, None)
        if seq is not None:
            self.engine.release(seq)

    def _answer(self, a: NotifyClient, out: list[RequestOutput]) -> None:
        req = self._requests.pop(a.room, None)
        self._rooms_of.pop(a.rid, None)
        if a.ending.outcome is Outcome.FINISHED:
            out += self._success(a, req)
            return
        detail = f": {a.ending.detail}" if a.ending.detail else ""
        out.append(RequestOutput(rid=a.rid, finished=True, error=f"{a.ending.reason.value}{detail}",
                                 error_code=HTTP_STATUS.get(a.ending.reason, 500), error_kind=a.ending.reason.value))

    def _success(self, a: NotifyClient, req: Optional[GenerateRequest]) -> list[RequestOutput]:
        return []

    def _forget_peer(self, peer: Peer) -> None:
        self.control.forget(peer)

    def _loop_alive(self, stall_s: float) -> Callable[[], bool]:
        """For the control thread: has the engine loop begun an iteration within ``stall_s``? (A
        forward pass may take up to the stall deadline; a loop stuck longer is wedged.)"""
        return lambda: time.monotonic() - self.last_iteration < stall_s

    def _close_transfer(self) -> None:
        pass

    def _setup(self) -> None:
        raise NotImplementedError

    def _on_notification(self, ev: KVNotification, out: list[RequestOutput]) -> None:
        log.warning("unexpected transfer notification from %s", ev.agent_name)


class PrefillEngine(DisaggEngine):
    """Runs prompts and writes their KV into the decode worker's pages, chunk by chunk."""

    role = "prefill"
    backend = None

    def _open_transfer(self, agent_name: str, pool) -> None:
        self.backend = create_backend(self.server.transfer_backend, agent_name, pool, **self._backend_opts())
        self.transfer = TransferWorker(self.backend, self.post_event, self._transfer_faults)

    def _close_transfer(self) -> None:
        if self.backend is not None:
            self.backend.close()

    def _setup(self) -> None:
        layout = self.engine.layout
        self.table = PrefillTable(self.deadlines, self.incarnation, layout.page_size, layout.page_nbytes)
        self.control = PrefillControl(self.server.host, self.server.bootstrap_port, self.info, self.transfer,
                                      self.post_event, self.deadlines.heartbeat_interval_s, self._control_faults,
                                      self._loop_alive(self.deadlines.prefill_stall_s))
        self.control.start()

    def _step(self) -> list[RequestOutput]:
        outputs = self.engine.step()
        out: list[RequestOutput] = []
        page_size = self.engine.layout.page_size
        admitted = set(map(id, self.engine.scheduler.admitted))
        for item in self.engine.last_batch:
            seq = item.seq
            if seq.room is None or seq.room not in self._requests:
                continue
            if id(seq) in admitted:
                self._seqs[seq.room] = seq
                self._feed(Scheduled(seq.room, tuple(seq.pages)), out)
            if seq.status is SeqStatus.HELD and len(seq) > seq.num_prompt_tokens:  # sampled its first token
                self._feed(ForwardDone(seq.room, seq.token_ids[-1]), out)
            elif seq.status is SeqStatus.RUNNING:
                self._feed(ChunkDone(seq.room, seq.num_computed // page_size), out)
        for o in outputs:  # only errors come out for prefill-only sequences: a failed forward pass
            room = self._rooms_of.get(o.rid)
            if room is not None and o.error:
                self._feed(LocalFailure(room, Reason.INTERNAL_ERROR, o.error), out)
            elif room is None:
                out.append(o)
        return out

    def _check_fits(self, req: GenerateRequest) -> None:
        self.engine.check_fits(req, prompt_only=True)  # the generated tokens live on decode

    def _do_role(self, a, out: list[RequestOutput]) -> None:
        if isinstance(a, Enqueue):
            req = self._requests[a.room]
            try:
                self.engine.add_request(req, prefill_only=True)
            except InvalidRequest as exc:
                self._feed(LocalFailure(a.room, Reason.BAD_REQUEST, str(exc)), out)
        elif isinstance(a, StartWrite):
            pool = self.engine.layout.page_nbytes
            spans = tuple(page_spans(a.src_pages, a.dst_pages, pool))
            self.transfer.submit(Write(a.room, a.write_id, a.peer, spans))
        elif isinstance(a, CancelWrites):
            self.transfer.submit(CancelTransfer(a.write_ids))
        elif isinstance(a, ResetTransfer):
            self.transfer.submit(ResetPeer(a.peer))
        else:
            super()._do_role(a, out)

    def _send(self, peer: Peer, msg) -> None:
        if isinstance(msg, p.KVDone):  # rides behind the data, as the transfer's notification
            self.transfer.submit(Notify(peer, p.encode(msg)))
        else:
            self.control.send(peer, msg)

    def _success(self, a: NotifyClient, req: Optional[GenerateRequest]) -> list[RequestOutput]:
        seq = self._seqs.get(a.room)
        first = seq.token_ids[-1] if seq is not None else None
        n = len(req.prompt_ids) if req is not None else 0
        return [RequestOutput(rid=a.rid, token_ids=(first,) if first is not None else (), finished=True,
                              finish_reason="prefill_done", prompt_tokens=n, completion_tokens=0)]

    def _forget_peer(self, peer: Peer) -> None:
        # our side of its transfer: its writes are reported failed (not a fence: decode's is)
        self.transfer.submit(ResetPeer(peer, forget=True))
        super()._forget_peer(peer)


class DecodeEngine(DisaggEngine):
    """Reserves pages, registers them with the prefill worker, and decodes once the KV landed."""

    role = "decode"
    links = None

    def _open_transfer(self, agent_name: str, pool) -> None:
        self.links = ReceiveLinks(self.server.transfer_backend, agent_name, pool, **self._backend_opts())
        self.transfer = TransferWorker(None, self.post_event, self._transfer_faults, links=self.links)

    def _close_transfer(self) -> None:
        if self.links is not None:
            self.links.close_all()

    def _setup(self) -> None:
        self.table = DecodeTable(self.deadlines, self.incarnation, self.engine.layout.page_size)
        self._reserved: dict[int, list[int]] = {}  # room -> pages, until StartDecode
        self._quarantine: dict[int, list[int]] = {}
        self._want_pages: dict[int, int] = {}  # room -> pages asked for, waiting for free pages
        name = f"{self.advertise_host}:{self.server.port}"
        self.control = DecodeControl(name, self.info, self.links, self.post_event, self.deadlines.heartbeat_interval_s,
                                     self.deadlines.prealloc_s, self._control_faults,
                                     self._loop_alive(self.deadlines.decode_stall_s))
        self.control.start()

    def _collect_stats(self) -> dict:
        stats = super()._collect_stats()
        stats["pages_quarantined"] = sum(len(v) for v in self._quarantine.values())
        stats["links_open"] = len(self.links.writers())
        stats["links_fenced"] = self.links.fenced
        return stats

    def _arrive(self, req: GenerateRequest, out: list[RequestOutput]) -> None:
        super()._arrive(req, out)
        room = req.bootstrap.room
        if self.table.state_of(room) is not None and not self._ended(room):
            self.control.want_info(room, req.bootstrap.host, req.bootstrap.port)

    def _ended(self, room: int) -> bool:
        return room not in self._requests

    def _tick(self) -> list[RequestOutput]:
        out = super()._tick()
        for room, n in list(self._want_pages.items()):
            if not self.engine.allocator.can_allocate(n):
                break  # first come, first served
            del self._want_pages[room]
            self._reserve(room, n, out)
        return out

    def _on_notification(self, ev: KVNotification, out: list[RequestOutput]) -> None:
        try:
            msg = p.decode(ev.payload)
        except p.ProtocolError as exc:
            self.notices["bad_notification"] += 1
            log.warning("bad transfer notification from %s: %s", ev.agent_name, exc)
            return
        if getattr(msg, "incarnation", None) != ev.peer.incarnation:
            self.notices["notification_from_unknown_peer"] += 1
            log.warning("notification %s from %s arrived on the link of %s", type(msg).__name__, ev.agent_name,
                        ev.peer)
            return
        self._feed(FromPeer(ev.peer, msg), out)

    def _step(self) -> list[RequestOutput]:
        outputs = self.engine.step()
        out: list[RequestOutput] = []
        for o in outputs:
            room = self._rooms_of.get(o.rid)
            if room is None:
                out.append(o)
            elif o.error:
                self._feed(LocalFailure(room, Reason.INTERNAL_ERROR, o.error), out)
            else:
                out.append(o)
                self._after_token(room, o, out)
        return out

    def _after_token(self, room: int, o: RequestOutput, out: list[RequestOutput]) -> None:
        if o.finished:
            self._feed(Finished(room, Reason.STOP if o.finish_reason == "stop" else Reason.LENGTH), out)
        else:
            self._feed(DecodeStep(room), out)

    def _do_role(self, a, out: list[RequestOutput]) -> None:
        if isinstance(a, ReservePages):
            if self._want_pages or not self.engine.allocator.can_allocate(a.n_pages):
                self._want_pages[a.room] = a.n_pages  # waits; the PREALLOC deadline bounds it
            else:
                self._reserve(a.room, a.n_pages, out)
        elif isinstance(a, StartDecode):
            pages = self._reserved.pop(a.room)
            req = self._requests[a.room]
            seq, outputs = self.engine.start_decoding(req, pages, a.first_token)
            self._seqs[a.room] = seq
            for o in outputs:
                out.append(o)
                if o.finished:
                    self._after_token(a.room, o, out)
        elif isinstance(a, QuarantinePages):
            self._quarantine[a.room] = self._take_pages(a.room)
        elif isinstance(a, ReleaseQuarantine):
            self.engine.allocator.free(self._quarantine.pop(a.room, []))
        else:
            super()._do_role(a, out)

    def _reserve(self, room: int, n: int, out: list[RequestOutput]) -> None:
        pages = self.engine.allocator.allocate(n)
        if self.table.state_of(room) is None or self._ended(room):
            self.engine.allocator.free(pages)  # the room ended while it waited
            return
        self._reserved[room] = pages
        self._feed(PagesReserved(room, tuple(pages)), out)

    def _forget_peer(self, peer: Peer) -> None:
        # The fence, before any page of the peer's rooms is freed by the actions that follow;
        # then the control thread ends the session (the next room for that address opens a new one).
        self.links.close(peer)
        super()._forget_peer(peer)

    def _take_pages(self, room: int) -> list[int]:
        """Every page the room holds now (reserved, or its sequence's), no longer held by it."""
        self._want_pages.pop(room, None)
        seq = self._seqs.pop(room, None)
        if seq is not None:
            pages, seq.pages = seq.pages, []
            return pages
        return self._reserved.pop(room, [])

    def _free(self, room: int, pages: tuple[int, ...]) -> None:
        self.engine.allocator.free(self._take_pages(room))


def parse_faults(spec: str) -> tuple[FaultConfig, ControlFaults, bool]:
    """``--inject-faults`` (off when empty; read once at start), comma-separated:
    ``stall_writes``, ``fail_writes``, ``notify_drop=P``, ``control_drop=P``, ``control_delay=P``,
    ``control_delay_s=S``, ``control_duplicate=P``, ``seed=N``, ``wedge_loop``. Returns the transfer faults, the control
    faults, and whether the engine loop wedges (as soon as it holds a room, until shutdown)."""
    transfer, control, wedge = {}, {}, False
    for item in filter(None, (x.strip() for x in spec.split(","))):
        key, _, value = item.partition("=")
        if key in ("stall_writes", "fail_writes") and not value:
            transfer[key] = True
        elif key == "wedge_loop" and not value:
            wedge = True
        elif key in ("control_drop", "control_delay", "control_duplicate", "control_delay_s"):
            control[key.removeprefix("control_")] = float(value)
        elif key == "notify_drop":
            transfer["notify_drop"] = float(value)
        elif key == "seed":
            control["seed"] = transfer["seed"] = int(value)
        else:
            raise ValueError(f"unknown fault {item!r}; see `splitserve serve --help`")
    return FaultConfig(**transfer), ControlFaults(**control), wedge


def engine_for_role(config: EngineConfig, server: ServerConfig, deadlines: Deadlines) -> DisaggEngine:
    if server.transfer_backend not in ("nixl", "tcp"):
        raise ValueError(f"--transfer-backend must be nixl or tcp, got {server.transfer_backend!r}")
    cls = {"prefill": PrefillEngine, "decode": DecodeEngine}.get(server.role)
    if cls is None:
        raise ValueError(f"--role must be colocated, prefill or decode, got {server.role!r}")
    transfer_faults, control_faults, wedge_loop = parse_faults(server.inject_faults)
    if server.inject_faults:
        log.warning("fault injection is ON: %s", server.inject_faults)
    return cls(config, server, deadlines.validate(), transfer_faults, control_faults, wedge_loop)
