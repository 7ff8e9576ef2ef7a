"""Decode's control thread: one DEALER socket per prefill address and session.

A **session** is one socket (identity ``name#incarnation#session``, the session number unique in
this process), one bootstrap-info fetch, one incarnation of the prefill and one receiving link
(``transfer/links.py``). In order: ``connect`` (a new socket; ``GetInfo`` every ``INFO_RETRY_S``
until ``Info`` comes); the info (incompatible: the waiting rooms fail naming the field;
compatible: a receiving link is opened and ``RegisterPeer`` sent until answered; a link that
cannot be opened fails the waiting rooms at once and ends the session); ``PeerRegistered`` (the
session is **ready**: waiting rooms get ``PeerInfo`` and register; a room is never handed a
session whose link prefill does not hold).

A session ends — its socket and link closed, and the next room for that address opens a new one —
when the engine loop declares it lost (``forget``: only that exact session), when its link
registration goes unanswered or its prefill is silent for the peer-silence bound (``PeerLost``),
and when a heartbeat answer shows another incarnation on its address (the prefill restarted).
Every per-peer structure is bounded: sessions by silence (and at most ``MAX_PREFILLS`` addresses
at a time), waiting rooms by their deadline.
"""

from __future__ import annotations

import itertools
import logging
import queue
from dataclasses import dataclass, field
from typing import Callable, Optional

import zmq
from zmq.utils.monitor import recv_monitor_message

from splitserve.disagg import protocol as p
from splitserve.disagg.bootstrap import first_mismatch
from splitserve.disagg.control.base import (GOODBYE_LINGER_MS, MAX_FRAMES_PER_POLL, ControlFaults,
                                           ControlThread, identity)
from splitserve.disagg.control.curve import FAILED, PROTOCOL_ERRORS
from splitserve.disagg.lifecycle import Deadlines, FromPeer, LocalFailure, Peer, PeerInfo, PeerLost, Reason
from splitserve.disagg.transfer.links import ReceiveLinks
from splitserve.disagg.zmq_frames import max_msg_size
from splitserve.hosts import host_port

log = logging.getLogger(__name__)

MAX_PREFILLS = 1024


@dataclass(eq=False)
class _Session:
    """What decode knows of one prefill address now."""

    conn: "ZmqDealer"
    name: str  # host:port
    session: int
    info: Optional[p.Info] = None
    mismatch: Optional[str] = None
    ready: bool = False  # info compatible and link registered (or incompatible: rooms fail at once)
    link: Optional[p.RegisterPeer] = None  # our receiving link's registration, until answered
    link_since: float = 0.0
    link_sent_at: float = 0.0
    asked_at: float = 0.0
    last_heard: float = 0.0
    waiting: list = field(default_factory=list)  # (room, since): rooms waiting until the session is ready

    @property
    def peer(self) -> Optional[Peer]:
        return Peer(self.name, self.info.incarnation, self.session) if self.info else None


class DecodeControl(ControlThread):
    """Decode side: one DEALER per prefill address; fetches and checks bootstrap info, and opens a
    receiving link (``transfer/links.py``) for each session it registers."""

    INFO_RETRY_S = 1.0

    def __init__(self, name: str, ours: p.Info, links: ReceiveLinks, post: Callable[[object], None],
                 deadlines: Deadlines, faults: Optional[ControlFaults] = None,
                 loop_alive: Optional[Callable[[], bool]] = None,
                 dial: Optional[Callable[[str, bytes], "ZmqDealer"]] = None, io_probe=None,
                 wake: Optional[Callable[[], None]] = None):
        """``deadlines``: heartbeats every ``heartbeat_interval_s``, a session silent for
        ``peer_silence_s`` ends, a room waits ``prealloc_s`` for its session."""
        super().__init__("control-decode", ours.incarnation, post, deadlines.heartbeat_interval_s, faults,
                         loop_alive, io_probe, wake)
        self._info_wait_s = deadlines.prealloc_s  # a room waits this long for its session (its PREALLOC limit)
        self._silence_s = deadlines.peer_silence_s
        self.name = name
        self.ours = ours
        self._links = links
        self._prefills: dict[str, _Session] = {}
        self._session_ids = itertools.count(1)  # unique in this process: identities never repeat
        self._requests: "queue.SimpleQueue[tuple[int, str]]" = queue.SimpleQueue()
        self._dial = dial or ZmqDealer  # a simulator dials its own

    def want_info(self, room: int, host: str, port: int) -> None:
        """Thread-safe: post ``PeerInfo`` for ``room`` once a session with the prefill at
        host:port is ready (or ``LocalFailure`` if none can be). The address is named in
        ``hosts.host_port``'s form (``[::1]:8998``): one prefill, one name."""
        self._requests.put((room, host_port(host, port)))
        self._wake()

    def sizes(self) -> dict[str, int]:
        """Per-peer structures, for the metrics (read from any thread)."""
        return {"sessions": len(self._prefills)}

    def connections(self) -> tuple["ZmqDealer", ...]:
        """The connection of each prefill session now, for fault injection (control thread only)."""
        return tuple(pf.conn for pf in self._prefills.values())

    # -- the thread ---------------------------------------------------------------------------------

    def serve(self) -> None:
        while not self.stopping.is_set():
            self.beat()
            poller = zmq.Poller()
            for pf in self._prefills.values():
                poller.register(pf.conn.sock, zmq.POLLIN)
            poller.register(self._wake_r, zmq.POLLIN)
            ready = dict(poller.poll(self.poll_ms()))
            if self._wake_r in ready:
                self._drain_wake()
            self.step({pf.conn for pf in self._prefills.values() if pf.conn.sock in ready})

    def step(self, readable: Optional[set] = None) -> None:
        """One iteration: rooms asking for a session, the frames waiting on the connections in
        ``readable`` (None: on every one), the outbox, each session's timers, heartbeats."""
        self.beat()
        self._step_probe()
        self._take_requests()
        for pf in list(self._prefills.values()):
            if (readable is None or pf.conn in readable) and self._prefills.get(pf.name) is pf:
                self._receive(pf)
        self._flush_outbox()
        now = self.clock()
        for pf in list(self._prefills.values()):
            if self._prefills.get(pf.name) is pf:  # not ended by the one before
                self._tick(pf, now)
        if self._heartbeat_due():
            for pf in self._prefills.values():
                if pf.info is not None:
                    self._send_faulty(self._on_socket(pf), p.encode(p.Heartbeat(self.incarnation, self._hb_seq)))

    def _take_requests(self) -> None:
        while True:
            try:
                room, name = self._requests.get_nowait()
            except queue.Empty:
                return
            pf = self._prefills.get(name)
            if pf is None:
                if len(self._prefills) >= MAX_PREFILLS:
                    self._post(LocalFailure(room, Reason.OVERLOADED, f"this decode worker talks to {MAX_PREFILLS} "
                                                                     "prefill addresses already"))
                    continue
                pf = self._connect(name)
                if pf is None:
                    self._post(LocalFailure(room, Reason.BAD_REQUEST, "cannot connect to the prefill its "
                                                                       "bootstrap_host and bootstrap_port name"))
                    continue
            if pf.ready:
                self._post(PeerInfo(room, pf.peer, pf.mismatch))
            else:
                pf.waiting.append((room, self.clock()))

    def _connect(self, name: str, waiting: Optional[list] = None) -> Optional[_Session]:
        session = next(self._session_ids)
        try:
            conn = self._dial(name, identity(Peer(self.name, self.incarnation, session)))
        except zmq.ZMQError as exc:
            log.warning("cannot connect to the prefill at %s: %s", name, exc)
            return None
        now = self.clock()
        pf = self._prefills[name] = _Session(conn, name, session, last_heard=now, waiting=waiting or [])
        self._ask_info(pf, now)
        return pf

    def _end(self, pf: _Session, why: str, lost: bool = True) -> None:
        """End a session: its socket and link closed; with ``lost`` (it had a prefill), ``PeerLost``
        posted so the engine fails what is bound to it. Rooms still waiting move to a new session."""
        if self._prefills.get(pf.name) is pf:
            del self._prefills[pf.name]
        pf.conn.close()
        if pf.peer is not None:
            self._close_link(pf.peer)  # idempotent: the engine may have fenced it already
            if lost:
                log.warning("session %s ended: %s", pf.peer, why)
                self._post(PeerLost(pf.peer, why))
        waiting, pf.waiting = pf.waiting, []
        if waiting:
            self._connect(pf.name, waiting)

    def _forget(self, peer: Peer) -> None:
        """The engine loop declared ``peer`` lost (it closed the receiving link first, the fence):
        end that session — that exact one, never another session of the same address."""
        pf = self._prefills.get(peer.name)
        if pf is not None and pf.peer == peer:
            self._end(pf, "declared lost", lost=False)
        self._close_link(peer)

    def _close_link(self, peer: Peer) -> None:
        """Close ``peer``'s receiving link here too; if that raises, the session still ends (and its
        ``PeerLost`` is posted): the engine loop's fence is the one its pages wait for, and it keeps
        them quarantined while it fails (``disagg/decode_role.py``)."""
        try:
            self._links.close(peer)
        except Exception:
            log.exception("closing the receiving link of %s failed (the engine loop's fence keeps its pages)", peer)

    def _tick(self, pf: _Session, now: float) -> None:
        pf.waiting = [(room, since) for room, since in pf.waiting if now - since <= self._info_wait_s]
        if pf.info is None:
            refused = getattr(pf.conn, "auth_failure", lambda: None)()
            if refused is not None:  # the waiting rooms fail now, naming it, rather than at their deadline
                self._drop("authentication", refused)
                for room, _ in pf.waiting:
                    self._post(LocalFailure(room, Reason.INCOMPATIBLE_PEER, refused))
                pf.waiting = []
                self._end(pf, refused, lost=False)
            elif not pf.waiting:  # nobody waits for this address any more (the rooms' deadlines failed them)
                self._end(pf, "no room waits for it", lost=False)
            elif now - pf.asked_at > self.INFO_RETRY_S:
                self._ask_info(pf, now)
            return
        if pf.link is not None:
            if now - pf.link_since > self._silence_s:
                self._end(pf, f"its link registration was not answered in {now - pf.link_since:.1f}s")
            elif now - pf.link_sent_at > self.INFO_RETRY_S:
                self._send_link(pf, now)
        elif now - pf.last_heard > self._silence_s:
            self._end(pf, f"silent for {now - pf.last_heard:.1f}s")

    def _ask_info(self, pf: _Session, now: float) -> None:
        pf.asked_at = now
        self._send_faulty(self._on_socket(pf), p.encode(p.GetInfo(self.incarnation)))

    def _send_link(self, pf: _Session, now: float) -> None:
        pf.link_sent_at = now
        self._send_faulty(self._on_socket(pf), p.encode(pf.link))

    def _on_socket(self, pf: _Session) -> Callable[[bytes], None]:
        return lambda frame: self._try_send(pf, frame)

    def _try_send(self, pf: _Session, frame: bytes) -> None:
        if pf.conn.closed:  # the session ended while this frame was delayed
            return
        pf.conn.send(frame)

    def _receive(self, pf: _Session) -> None:
        for _ in range(MAX_FRAMES_PER_POLL):
            frame = pf.conn.recv()
            if frame is None:
                return
            try:
                msg = self._decode(frame, pf.name)
                if msg is not None:
                    self._dispatch(pf, msg, self.clock())
            except Exception as exc:  # a frame can only be dropped, whatever it holds
                self._drop("error", f"from {pf.name}: {type(exc).__name__}: {exc}")
            if self._prefills.get(pf.name) is not pf:
                return  # the session ended on that frame

    def _dispatch(self, pf: _Session, msg, now: float) -> None:
        if isinstance(msg, p.Info):
            self._learn(pf, msg, now)
            return
        incarnation = getattr(msg, "incarnation", None)
        if pf.info is None or incarnation != pf.info.incarnation:
            if isinstance(msg, p.HeartbeatAck) and pf.info is not None:
                self._end(pf, f"{pf.name} restarted as incarnation {incarnation}")  # a new session meets it
            elif not isinstance(msg, p.Heartbeat):
                self._drop("incarnation", f"{type(msg).__name__} from {pf.name} of incarnation {incarnation!r}")
            return
        pf.last_heard = now
        self._note_heard(pf.peer, fresh=isinstance(msg, p.HeartbeatAck))
        if isinstance(msg, p.Heartbeat):
            if self._loop_ok():
                self._send_faulty(self._on_socket(pf), p.encode(p.HeartbeatAck(self.incarnation, msg.seq)))
        elif isinstance(msg, p.HeartbeatAck):
            pass  # liveness, noted above
        elif isinstance(msg, p.PeerRegistered):
            if pf.link is not None and msg.agent_name == pf.link.agent_name:
                pf.link = None
                self._make_ready(pf)
        elif isinstance(msg, (p.RoomFailed, p.WritesSettled)):
            self._post(FromPeer(pf.peer, msg))
        elif isinstance(msg, p.Goodbye):
            self._end(pf, f"its incarnation ended: {msg.reason}")
        else:
            self._drop("unexpected", f"{type(msg).__name__} from {pf.name}")

    def _learn(self, pf: _Session, info: p.Info, now: float) -> None:
        if pf.info is not None:
            if info.incarnation != pf.info.incarnation:
                self._end(pf, f"{pf.name} restarted as incarnation {info.incarnation}")
            return  # a duplicate answer
        pf.info, pf.last_heard = info, now
        pf.mismatch = first_mismatch(self.ours, info)
        if pf.mismatch is not None:
            self._make_ready(pf)  # its rooms fail naming the field; no link for an incompatible peer
            return
        try:
            agent, metadata = self._links.open(pf.peer)
        except Exception as exc:
            detail = f"cannot open a receiving link for {pf.peer}: {type(exc).__name__}: {exc}"
            log.error("%s", detail)
            for room, _ in pf.waiting:
                self._post(LocalFailure(room, Reason.INTERNAL_ERROR, detail))
            pf.waiting = []
            self._end(pf, detail, lost=False)
            return
        now = self.clock()  # after the open (a NIXL agent, slow on a busy machine): the prefill's bound starts here
        pf.link, pf.link_since = p.RegisterPeer(self.incarnation, info.incarnation, agent, metadata), now
        self._send_link(pf, now)

    def _make_ready(self, pf: _Session) -> None:
        pf.ready = True
        for room, _ in pf.waiting:
            self._post(PeerInfo(room, pf.peer, pf.mismatch))
        pf.waiting = []

    def _send_frame(self, peer: Peer, frame: bytes) -> None:
        pf = self._prefills.get(peer.name)
        # never hand a message meant for one incarnation or session to another
        if pf is not None and pf.peer == peer:
            self._try_send(pf, frame)

    def close(self, goodbye: Optional[str] = None) -> None:
        """Stop the thread and close every session's socket; with ``goodbye`` (why this incarnation
        ends), each prefill it met is told first, so that it ends the session at once."""
        said = self._stopped_for_goodbye() and goodbye is not None
        frame = p.encode(p.Goodbye(self.incarnation, (goodbye or "")[:p.MAX_STR]))
        for pf in self._prefills.values():
            if said and pf.info is not None and not pf.conn.closed:
                self._try_send(pf, frame)
                pf.conn.close(linger_ms=GOODBYE_LINGER_MS)
            else:
                pf.conn.close()
        self._close_wake()


class ZmqDealer:
    """Decode's connection of one session: a ZMQ DEALER with the session's identity, connected to
    a prefill's bootstrap port. ``recv`` gives one frame or None; ``send`` never blocks (with nobody
    there and the queue full, the frame is dropped: the rooms' deadlines handle it). With a
    ``secret`` (``control/curve.py``) it speaks CURVE as a holder; :meth:`auth_failure` says why
    the prefill would not complete the handshake (its socket monitor's events)."""

    def __init__(self, name: str, ident: bytes, secret=None):
        self.name = name
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self._monitor = None
        self._handshakes = self._disconnects = 0
        self._curve = secret is not None
        try:
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.IPV6, 1)  # else libzmq resolves and dials IPv4 only
            self.sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size(p.MAX_FRAME_BYTES, secret))  # CURVE's bytes too
            self.sock.setsockopt(zmq.IDENTITY, ident)
            if secret is not None:
                secret.connect(self.sock)
            self._monitor = self.sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_DISCONNECTED)
            self.sock.connect(f"tcp://{name}")  # ``name``: HOST:PORT as hosts.host_port writes it
        except zmq.ZMQError:
            self.close()
            raise

    def auth_failure(self) -> Optional[str]:
        """Why the prefill refused our control handshake (naming authentication), or None so far:
        its ZAP handler refused us, or the mechanisms or the keys did not match. A connection it
        closes twice before any handshake succeeded counts as refused too: a CURVE server drops a
        client that does not hold its secret without a word, and one that meets a client without
        a secret closes at once, often before its greeting (which names the mismatch) is read: a
        close with our greeting unread resets the connection, and the reset discards it."""
        while self._monitor is not None:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshakes += 1
            elif kind == zmq.EVENT_DISCONNECTED:
                self._disconnects += 1
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH or event.get("value") in PROTOCOL_ERRORS:
                why = PROTOCOL_ERRORS.get(event.get("value"), FAILED[kind])
                return f"authentication failed with the prefill at {self.name}: {why}"
            # any other failure (a port that does not speak ZMTP...) is left to the rooms' deadlines
        if not self._handshakes and self._disconnects >= 2:
            why = ("its --cluster-secret-file differs from ours, or only one of us has one" if self._curve
                   else "it may require a --cluster-secret-file, and we have none")
            return f"authentication failed with the prefill at {self.name}: it closed our connection in the handshake ({why})"
        return None

    @property
    def closed(self) -> bool:
        return self.sock.closed

    def send(self, frame: bytes) -> None:
        try:
            self.sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            log.debug("control message to %s dropped: its queue is full", self.name)

    def recv(self) -> Optional[bytes]:
        try:
            frame = self.sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None
        self._stop_monitor()  # a frame came: the handshake succeeded, nothing left to watch for
        return frame

    def close(self, linger_ms: int = 0) -> None:
        """``linger_ms``: how long frames already sent may still go out (0: dropped)."""
        self._stop_monitor()
        self.sock.close(linger_ms)

    def _stop_monitor(self) -> None:
        """Stop the socket's monitor, then close our end of it — in that order, and as soon as
        there is nothing to watch for. libzmq's I/O thread *blocks* sending a monitor event that
        nobody takes: once our end is closed, or once events pile up unread (a session that
        reconnects again and again). Blocked, it serves no socket of the context — the
        process's, every session of this worker — until the process ends (libzmq #3575)."""
        if self._monitor is None:
            return
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)
        self._monitor = None
