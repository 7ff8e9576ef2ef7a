"""The control plane: ZMQ sockets between prefill and decode workers, one thread on each side.

Prefill binds one ROUTER socket on its bootstrap port. Decode connects one DEALER per prefill
address and *session*, with the identity ``name#incarnation#session`` (its stable name, this
start's incarnation, the session number), so prefill can tell a restarted decode worker, or a new
session of the same one, from the old, and answer on the same connection. Decode ends a session
when the engine declares that prefill lost (``DecodeControl.forget``): the socket closes, and the
next room for that address opens session n+1 (new socket, fresh bootstrap info, a new receiving
link). That is how a pair serves again after a healed partition while nothing of the lost session
is ever acted on: the lost peer is ``(name, incarnation, n)``; ``n+1`` is another peer.

These threads own their sockets and nothing else. They answer ``GetInfo`` and heartbeats
themselves (so a long forward pass never makes a live peer look dead), send heartbeats every
``heartbeat_interval_s``, and stop doing both while the engine loop has not begun an iteration
for longer than its stall deadline (``loop_alive``): a wedged loop would otherwise hold the peer's
rooms, and its quarantined pages, forever behind heartbeats that say all is well. The peer then
declares us lost, fences us and frees what it held. They post everything else to the engine
loop's inbox as lifecycle events: ``FromPeer``, ``PeerHeard``, ``PeerInfo``. The engine loop sends through ``send``, a
queue the thread drains. Frames that fail to decode are logged and counted, never fatal
(control-plane input is untrusted).

Fault injection (off unless configured): drop, delay or duplicate any outgoing control message,
answers and heartbeats included. Whatever may be lost is sent again: ``GetInfo`` and
``RegisterPeer`` until answered, ``RegisterRoom`` and ``AbortRoom`` by the lifecycle.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import zmq

from splitserve.disagg import protocol as p
from splitserve.disagg.bootstrap import first_mismatch
from splitserve.disagg.lifecycle import FromPeer, Peer, PeerHeard, PeerInfo
from splitserve.disagg.supervised import SupervisedThread
from splitserve.disagg.transfer.links import ReceiveLinks
from splitserve.disagg.transfer_worker import AddPeer, ResetPeer, TransferWorker

log = logging.getLogger(__name__)

POLL_MS = 5  # the longest a control thread sleeps: heartbeats, retries and delayed frames are due on it


@dataclass(frozen=True)
class ControlFaults:
    """Probabilities applied to each outgoing control message (heartbeats included)."""

    drop: float = 0.0
    duplicate: float = 0.0
    delay: float = 0.0
    delay_s: float = 0.5
    seed: int = 0


def identity(peer: Peer) -> bytes:
    return f"{peer.name}#{peer.incarnation}#{peer.session}".encode()


def peer_of(ident: bytes) -> Optional[Peer]:
    parts = ident.decode(errors="replace").rsplit("#", 2)
    if len(parts) != 3 or not all(parts) or not parts[2].isdigit():
        return None
    return Peer(parts[0], parts[1], int(parts[2]))


class _ControlThread(SupervisedThread):
    """What both sides share: the outbox, fault injection, counters of bad frames."""

    def __init__(self, name: str, incarnation: str, post: Callable[[object], None], heartbeat_s: float,
                 faults: Optional[ControlFaults], loop_alive: Optional[Callable[[], bool]] = None):
        super().__init__(name=name)
        self.incarnation = incarnation
        self._loop_alive = loop_alive or (lambda: True)
        self._wedged = False
        self._post = post
        self._heartbeat_s = heartbeat_s
        self._faults = faults or ControlFaults()
        self._rng = random.Random(self._faults.seed)
        self._outbox: "queue.Queue[tuple[Peer, object]]" = queue.Queue()
        self._delayed: list[tuple[float, Callable[[bytes], None], bytes]] = []
        self._hb_seq = 0
        self._next_hb = 0.0
        self.bad_frames = 0
        self.ctx = zmq.Context.instance()
        # Another thread that hands us work writes a byte here, so the poll wakes at once
        # instead of at its next timeout (it is on the path of every request).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._wake_lock = threading.Lock()  # no write to the pipe once it is closed (its fd may be reused)
        self._wake_closed = False

    def send(self, peer: Peer, msg) -> None:
        """Thread-safe: queue a control message for ``peer``."""
        self._outbox.put((peer, msg))
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_closed:
                return
            try:
                os.write(self._wake_w, b"!")
            except BlockingIOError:  # full: a wake-up is pending anyway
                pass

    def _poll(self, sockets) -> list:
        """Wait up to ``POLL_MS`` for any of ``sockets`` to be readable or for a wake-up; the
        readable sockets."""
        poller = zmq.Poller()
        for sock in sockets:
            poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        ready = [sock for sock, _ in poller.poll(POLL_MS)]
        if self._wake_r in ready:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        return [sock for sock in ready if sock is not self._wake_r]

    def _close_wake(self) -> None:
        """After the thread has stopped."""
        with self._wake_lock:
            if not self._wake_closed:
                self._wake_closed = True
                os.close(self._wake_r)
                os.close(self._wake_w)

    def _decode(self, frame: bytes, origin: str):
        try:
            return p.decode(frame)
        except p.ProtocolError as exc:
            self.bad_frames += 1
            log.warning("bad control frame from %s: %s", origin, exc)
            return None

    def _flush_outbox(self) -> None:
        now = time.monotonic()
        while True:
            try:
                peer, msg = self._outbox.get_nowait()
            except queue.Empty:
                break
            if msg is None:  # a ``forget`` marker, kept in order with the sends around it
                self._forget(peer)
            else:
                self._send_faulty(self._to(peer), p.encode(msg))
        due = [d for d in self._delayed if d[0] <= now]
        self._delayed = [d for d in self._delayed if d[0] > now]
        for _, send, frame in due:
            send(frame)

    def forget(self, peer: Peer) -> None:
        """Thread-safe: ``peer`` was declared lost; see ``_forget`` of each side."""
        self._outbox.put((peer, None))
        self._wake()

    def _forget(self, peer: Peer) -> None:
        raise NotImplementedError

    def _to(self, peer: Peer) -> Callable[[bytes], None]:
        return lambda frame: self._send_frame(peer, frame)

    def _send_faulty(self, send: Callable[[bytes], None], frame: bytes) -> None:
        """Every outgoing frame goes through here: ``send`` it, or (fault injection) drop, delay or
        duplicate it."""
        f = self._faults
        if f.drop and self._rng.random() < f.drop:
            return
        if f.delay and self._rng.random() < f.delay:
            self._delayed.append((time.monotonic() + f.delay_s, send, frame))
            return
        send(frame)
        if f.duplicate and self._rng.random() < f.duplicate:
            send(frame)

    def _heartbeat_due(self) -> bool:
        now = time.monotonic()
        if now < self._next_hb:
            return False
        self._next_hb = now + self._heartbeat_s
        self._hb_seq += 1
        return self._loop_ok()

    def _loop_ok(self) -> bool:
        """False while the engine loop is wedged: then we neither send nor answer heartbeats."""
        alive = self._loop_alive()
        if alive == self._wedged:
            self._wedged = not alive
            if self._wedged:
                log.error("the engine loop has made no iteration within its stall deadline: heartbeats withheld, "
                          "so that peers declare this worker lost and free what they hold for it")
            else:
                log.warning("the engine loop is iterating again: heartbeats resume")
        return alive

    def _send_frame(self, peer: Peer, frame: bytes) -> None:
        raise NotImplementedError


class PrefillControl(_ControlThread):
    """Prefill side: the ROUTER on the bootstrap port."""

    def __init__(self, host: str, port: int, info: p.Info, transfer: TransferWorker,
                 post: Callable[[object], None], heartbeat_s: float, faults: Optional[ControlFaults] = None,
                 loop_alive: Optional[Callable[[], bool]] = None):
        super().__init__("control-prefill", info.incarnation, post, heartbeat_s, faults, loop_alive)
        self.info = info
        self._transfer = transfer
        self._decoders: set[Peer] = set()  # decode sessions that registered with us
        self._ended: set[Peer] = set()  # decode sessions declared lost: never answered again
        self.early_registrations = 0
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_FRAME_BYTES)
        self.sock.bind(f"tcp://{host}:{port}")

    def serve(self) -> None:
        while not self.stopping.is_set():
            if self._poll([self.sock]):
                self._receive()
            self._flush_outbox()
            if self._heartbeat_due():
                for peer in list(self._decoders):
                    self._send_faulty(self._to(peer), p.encode(p.Heartbeat(self.incarnation, self._hb_seq)))

    def _forget(self, peer: Peer) -> None:
        """A decode session declared lost: stop heartbeating it and answering its heartbeats, so
        that decode, if alive, declares us lost too and fences the session."""
        self._decoders.discard(peer)
        self._ended.add(peer)

    def _receive(self) -> None:
        while True:
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) != 2:
                self.bad_frames += 1
                continue
            ident, frame = parts
            peer_name = peer_of(ident)
            msg = self._decode(frame, repr(ident[:64]))
            if msg is None or peer_name is None:
                continue
            self._dispatch(ident, peer_name, msg)

    def _dispatch(self, ident: bytes, sender: Peer, msg) -> None:
        if isinstance(msg, p.GetInfo):
            self._send_faulty(self._to(sender), p.encode(self.info))
        elif isinstance(msg, p.Heartbeat):
            if sender not in self._ended and self._loop_ok():
                self._send_faulty(self._to(sender), p.encode(p.HeartbeatAck(self.incarnation, msg.seq)))
            self._post(PeerHeard(sender, fresh=False))
        elif isinstance(msg, p.HeartbeatAck):
            self._post(PeerHeard(sender, fresh=True))
        elif isinstance(msg, p.RegisterRoom) and sender not in self._decoders and sender not in self._ended:
            # its link is not here yet (a delayed RegisterPeer): writing would fail, so wait for
            # decode to send the registration again (every register_resend_s) once it is
            self.early_registrations += 1
            log.info("registration of room %s from %s came before its transfer link; dropped until it is "
                     "sent again", msg.room, sender)
        elif isinstance(msg, p.RegisterPeer):
            if msg.prefill_incarnation != self.incarnation or msg.incarnation != sender.incarnation:
                log.warning("registration from %s for incarnation %s ignored (we are %s)", sender,
                            msg.prefill_incarnation, self.incarnation)
                return
            self._register(sender, msg)
        elif getattr(msg, "incarnation", None) != sender.incarnation:
            self.bad_frames += 1
            log.warning("%s from %s names incarnation %r; dropped", type(msg).__name__, sender,
                        getattr(msg, "incarnation", None))
        else:
            self._post(FromPeer(sender, msg))

    def _register(self, sender: Peer, msg: p.RegisterPeer) -> None:
        """A decode session registered its receiving link (answered, also when it is a duplicate:
        decode re-sends until answered). Decode opens session n+1 only after it ended n, so older
        sessions of that name are over: stop heartbeating them and drop their transfer connections
        (the engine fails any room still bound to them)."""
        if sender in self._ended:
            return  # a late one from a session that is over
        if sender not in self._decoders:
            for old in [d for d in self._decoders if d.name == sender.name]:
                self._decoders.discard(old)
                self._transfer.submit(ResetPeer(old, forget=True))
            self._decoders.add(sender)
            self._transfer.submit(AddPeer(sender, msg.agent_name, msg.agent_metadata))
            self._post(PeerHeard(sender, fresh=True))
        self._send_faulty(self._to(sender), p.encode(p.PeerRegistered(self.incarnation, msg.agent_name)))

    def _send_frame(self, peer: Peer, frame: bytes) -> None:
        self.sock.send_multipart([identity(peer), frame])

    def close(self) -> None:
        self.stop()
        self.sock.close(0)
        self._close_wake()


@dataclass
class _Prefill:
    """What decode knows of one prefill address."""

    sock: zmq.Socket
    name: str  # host:port
    session: int
    info: Optional[p.Info] = None
    asked_at: float = 0.0
    waiting_rooms: list = None  # (room, since): rooms waiting for its info
    link: Optional[p.RegisterPeer] = None  # our receiving link for this session, until prefill answers
    link_since: float = 0.0
    link_sent_at: float = 0.0

    @property
    def peer(self) -> Optional[Peer]:
        return Peer(self.name, self.info.incarnation, self.session) if self.info else None


class DecodeControl(_ControlThread):
    """Decode side: one DEALER per prefill address; fetches and checks bootstrap info, and opens a
    receiving link (``transfer/links.py``) for each compatible prefill incarnation it meets."""

    INFO_RETRY_S = 1.0

    def __init__(self, name: str, ours: p.Info, links: ReceiveLinks,
                 post: Callable[[object], None], heartbeat_s: float, info_wait_s: float,
                 faults: Optional[ControlFaults] = None, loop_alive: Optional[Callable[[], bool]] = None):
        super().__init__("control-decode", ours.incarnation, post, heartbeat_s, faults, loop_alive)
        self._info_wait_s = info_wait_s  # a room waits this long for an address's info (its PREALLOC limit)
        self.name = name
        self.ours = ours
        self._links = links
        self._prefills: dict[str, _Prefill] = {}
        self._sessions: dict[str, int] = {}  # address -> its last session number
        self._requests: "queue.Queue[tuple[int, str]]" = queue.Queue()

    def want_info(self, room: int, host: str, port: int) -> None:
        """Thread-safe: post ``PeerInfo`` for ``room`` once the prefill at host:port is known."""
        self._requests.put((room, f"{host}:{port}"))
        self._wake()

    def serve(self) -> None:
        while not self.stopping.is_set():
            ready = self._poll([pf.sock for pf in self._prefills.values()])
            self._take_requests()
            for sock in ready:
                self._receive(sock)
            self._retry_info()
            self._flush_outbox()
            self._retry_link()
            if self._heartbeat_due():
                for pf in self._prefills.values():
                    if pf.info is not None:
                        self._send_faulty(self._to(pf.peer), p.encode(p.Heartbeat(self.incarnation, self._hb_seq)))

    def _take_requests(self) -> None:
        while True:
            try:
                room, name = self._requests.get_nowait()
            except queue.Empty:
                return
            pf = self._prefills.get(name) or self._connect(name)
            if pf.info is not None:
                self._post(PeerInfo(room, pf.peer, first_mismatch(self.ours, pf.info)))
            else:
                pf.waiting_rooms.append((room, time.monotonic()))

    def _connect(self, name: str, waiting_rooms: Optional[list] = None) -> _Prefill:
        session = self._sessions[name] = self._sessions.get(name, 0) + 1
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_FRAME_BYTES)
        sock.setsockopt(zmq.IDENTITY, identity(Peer(self.name, self.incarnation, session)))
        sock.connect(f"tcp://{name}")
        pf = self._prefills[name] = _Prefill(sock=sock, name=name, session=session, waiting_rooms=waiting_rooms or [])
        self._ask_info(pf)
        return pf

    def _forget(self, peer: Peer) -> None:
        """End the session with a prefill declared lost (the engine has closed its receiving link
        already). Rooms still waiting for that address's info move to a new session."""
        pf = self._prefills.get(peer.name)
        if pf is None or pf.session != peer.session:
            return
        pf.sock.close(0)
        del self._prefills[peer.name]
        self._links.close(peer)  # idempotent: the engine closed it before any page was freed
        if pf.waiting_rooms:
            self._connect(peer.name, pf.waiting_rooms)

    def _ask_info(self, pf: _Prefill) -> None:
        pf.asked_at = time.monotonic()
        self._send_faulty(self._on_socket(pf), p.encode(p.GetInfo(self.incarnation)))

    def _on_socket(self, pf: _Prefill) -> Callable[[bytes], None]:
        return lambda frame: self._try_send(pf, frame)

    def _try_send(self, pf: _Prefill, frame: bytes) -> None:
        if pf.sock.closed:  # the session ended while this frame was delayed
            return
        try:
            pf.sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:  # nobody there and the queue is full: the rooms' deadlines handle it
            log.debug("control message to %s dropped: its queue is full", pf.name)

    def _retry_info(self) -> None:
        """Ask again for info that has not come; give up on an address whose rooms have all
        waited their limit (the room table has failed them by then) and close its socket."""
        now = time.monotonic()
        for name, pf in list(self._prefills.items()):
            pf.waiting_rooms = [(room, since) for room, since in pf.waiting_rooms
                                if now - since <= self._info_wait_s]
            if pf.info is None and not pf.waiting_rooms:
                pf.sock.close(0)
                del self._prefills[name]
            elif pf.waiting_rooms and now - pf.asked_at > self.INFO_RETRY_S:
                self._ask_info(pf)

    def _retry_link(self) -> None:
        """Send ``RegisterPeer`` again until prefill answers, for at most the info wait (then the
        session's rooms have failed, and prefill declares a session it never registered lost the
        first time it has to write to it)."""
        now = time.monotonic()
        for pf in self._prefills.values():
            if pf.link is None or now - pf.link_sent_at <= self.INFO_RETRY_S:
                continue
            if now - pf.link_since > self._info_wait_s:
                log.warning("prefill %s never answered the registration of link %s", pf.name, pf.link.agent_name)
                pf.link = None
            else:
                self._send_link(pf, now)

    def _send_link(self, pf: _Prefill, now: float) -> None:
        pf.link_sent_at = now
        self._send_faulty(self._on_socket(pf), p.encode(pf.link))

    def _receive(self, sock: zmq.Socket) -> None:
        pf = next(pf for pf in self._prefills.values() if pf.sock is sock)
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self._decode(frame, pf.name)
            if msg is not None:
                self._dispatch(pf, msg)

    def _dispatch(self, pf: _Prefill, msg) -> None:
        if isinstance(msg, p.Info):
            self._learn(pf, msg)
        elif isinstance(msg, p.Heartbeat):
            if self._loop_ok():
                self._send_faulty(self._on_socket(pf), p.encode(p.HeartbeatAck(self.incarnation, msg.seq)))
            if pf.info is not None and msg.incarnation == pf.info.incarnation:
                self._post(PeerHeard(pf.peer, fresh=False))
        elif isinstance(msg, p.HeartbeatAck):
            if pf.info is not None and msg.incarnation != pf.info.incarnation:
                self._ask_info(pf)  # restarted: a new incarnation answers on this address
            elif pf.info is not None:
                self._post(PeerHeard(pf.peer, fresh=True))
        elif isinstance(msg, p.PeerRegistered):
            if pf.link is not None and pf.info is not None and (msg.incarnation, msg.agent_name) == (
                    pf.info.incarnation, pf.link.agent_name):
                pf.link = None  # answered
        elif hasattr(msg, "incarnation"):
            self._post(FromPeer(Peer(pf.name, msg.incarnation, pf.session), msg))

    def _learn(self, pf: _Prefill, info: p.Info) -> None:
        old = pf.peer
        new = old is None or old.incarnation != info.incarnation
        pf.info = info
        mismatch = first_mismatch(self.ours, info)
        if new:
            if old is not None:  # that process is gone: fence whatever it still had on the wire
                self._links.close(old)
            self._post(PeerHeard(pf.peer, fresh=True))  # older incarnations of this name are lost
            if mismatch is None:
                agent, metadata = self._links.open(pf.peer)
                pf.link = p.RegisterPeer(self.incarnation, info.incarnation, agent, metadata)
                pf.link_since = time.monotonic()
                self._send_link(pf, pf.link_since)
        for room, _ in pf.waiting_rooms:
            self._post(PeerInfo(room, pf.peer, mismatch))
        pf.waiting_rooms.clear()

    def _send_frame(self, peer: Peer, frame: bytes) -> None:
        pf = self._prefills.get(peer.name)
        # never hand a message meant for one incarnation or session to another
        if pf is not None and pf.peer == peer:
            self._try_send(pf, frame)

    def close(self) -> None:
        self.stop()
        for pf in self._prefills.values():
            pf.sock.close(0)
        self._close_wake()
