"""Prefill's control thread: one ROUTER socket on the bootstrap port, every decode session's
frames through it.

Sessions, by their full identity (``docs/protocol.md``): a decode *session* registers its
receiving link (``RegisterPeer``) and is then **registered** here: heartbeated, its room
messages posted to the engine loop as ``FromPeer``. Nothing here is keyed by name alone (two
decodes that advertise one address are two peers); a decode's session n+1 replaces only its own
earlier sessions. A session ends when the engine loop declares it lost (``forget``) or when it
has been silent for ``peer_silence_s`` (its transfer connection dropped, ``PeerLost`` posted). An
ended session is remembered (``tombstone_s``, at most ``MAX_ENDED``) and answered only with
``room_failed(peer_lost)``. A room message from an unregistered session is dropped and counted; a
``RegisterRoom`` that keeps coming from one is answered ``room_failed(peer_lost)`` once it has
waited ``peer_silence_s``, so the pair never stays broken. Every per-peer structure is bounded.

**Session limits** (:class:`SessionLimits`; ``docs/security.md``): a link registration that would
open a new session is dropped unanswered and counted in ``refused`` by why — ``limit``
(``max_sessions`` registered), ``per_address`` (``max_per_address`` from its source IP address,
never the name a sender gives) or ``rate`` (more than ``rate`` new sessions a second lately,
bursts of ``2 x rate``); decode re-sends it and ends the session at the silence bound.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

import zmq

from splitserve.disagg import protocol as p
from splitserve.disagg.control.base import (GOODBYE_LINGER_MS, MAX_FRAMES_PER_POLL, ControlFaults,
                                           ControlThread, identity, peer_of)
from splitserve.disagg.zmq_frames import max_msg_size
from splitserve.disagg.lifecycle import Deadlines, FromPeer, Peer, PeerLost, Reason
from splitserve.disagg.transfer.thread import AddPeer, ResetPeer
from splitserve.hosts import allow_host, zmq_endpoint
from splitserve.log_sparsely import worth_logging

log = logging.getLogger(__name__)

MAX_ENDED = 4096
MAX_UNREGISTERED = 4096
ROOM_MESSAGES = (p.RegisterRoom, p.AbortRoom)


@dataclass(frozen=True)
class SessionLimits:
    """How many decode sessions a prefill takes (the options ``--max-control-sessions``,
    ``--max-control-sessions-per-address``, ``--control-session-rate``)."""

    max_sessions: int = 256
    max_per_address: int = 32
    rate: float = 20.0  # new sessions a second; a burst of 2 x rate

    def __post_init__(self):
        if self.max_sessions < 1 or self.max_per_address < 1 or not self.rate > 0:
            raise ValueError("the control session limits must be positive")


@dataclass
class _Session:
    agent_name: str
    last_heard: float
    source: Optional[str] = None  # the IP address its link registration came from


class PrefillControl(ControlThread):
    """Prefill side: the ROUTER on the bootstrap port."""

    def __init__(self, host: str, port: int, info: p.Info, transfer, post: Callable[[object], None],
                 deadlines: Deadlines, faults: Optional[ControlFaults] = None,
                 loop_alive: Optional[Callable[[], bool]] = None,
                 bind: Optional[Callable[[str, int], "ZmqRouterEndpoint"]] = None,
                 io_probe=None, limits: SessionLimits = SessionLimits(), wake: Optional[Callable[[], None]] = None):
        """``deadlines``: heartbeats every ``heartbeat_interval_s``, a session silent for
        ``peer_silence_s`` ends, an ended one is remembered ``tombstone_s``."""
        super().__init__("control-prefill", info.incarnation, post, deadlines.heartbeat_interval_s, faults,
                         loop_alive, io_probe, wake)
        self.limits = limits
        self.refused: Counter = Counter()
        """New sessions refused by the limits, by why (``limit``, ``per_address``, ``rate``)."""
        self._tokens, self._tokens_at = 2 * limits.rate, None  # the rate's bucket, filled at ``rate`` a second
        self._source: Optional[str] = None  # where the message being handled came from
        self.info = info
        self._transfer = transfer
        self._silence_s = deadlines.peer_silence_s
        self._ended_s = deadlines.tombstone_s
        self._sessions: dict[Peer, _Session] = {}  # registered decode sessions
        self._ended: OrderedDict[Peer, float] = OrderedDict()  # session -> when it ended (oldest first)
        self._unregistered: OrderedDict[Peer, float] = OrderedDict()  # sender of RegisterRooms -> first seen
        self.early_registrations = 0
        self.endpoint = (bind or ZmqRouterEndpoint)(host, port)  # a simulator binds its own

    def dropped(self) -> dict[str, int]:
        return {**self.bad_frames, **getattr(self.endpoint, "failures", {})}

    def sizes(self) -> dict[str, int]:
        """Per-peer structures, for the metrics (read from any thread)."""
        return {"sessions": len(self._sessions), "ended": len(self._ended), "unregistered": len(self._unregistered)}

    def sessions(self) -> frozenset[Peer]:
        """The decode sessions registered now, for checks of what the server keeps (control thread only)."""
        return frozenset(self._sessions)

    def sessions_refused(self) -> dict[str, int]:
        """New sessions refused by the limits so far, by why, each why shown (read from any thread)."""
        return {why: self.refused[why] for why in ("limit", "per_address", "rate")}

    # -- the thread ---------------------------------------------------------------------------------

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.endpoint.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self.stopping.is_set():
            self.beat()
            ready = dict(poller.poll(self.poll_ms()))
            if self._wake_r in ready:
                self._drain_wake()
            self.step(self.endpoint.sock in ready)

    def step(self, readable: bool = True) -> None:
        """One iteration: the frames waiting (if ``readable``), the outbox, sessions' expiry and
        heartbeats."""
        self.beat()
        self._step_probe()
        if readable:
            self._receive()
        self._flush_outbox()
        now = self.clock()
        self._expire(now)
        if self._heartbeat_due():
            for peer in list(self._sessions):
                self._send_faulty(self._to(peer), p.encode(p.Heartbeat(self.incarnation, self._hb_seq)))

    def _receive(self) -> None:
        for _ in range(MAX_FRAMES_PER_POLL):
            parts = self.endpoint.recv()
            if parts is None:
                return
            try:
                self._on_parts(parts)
            except Exception as exc:  # a frame can only be dropped, whatever it holds
                self._drop("error", f"{type(exc).__name__}: {exc}")

    def _on_parts(self, parts: list[bytes]) -> None:
        if len(parts) != 2:
            self._drop("frames", f"{len(parts)} frames in one message")
            return
        ident, frame = parts
        sender = peer_of(ident)
        if sender is None:
            self._drop("identity", f"identity {ident[:64]!r}")
            return
        msg = self._decode(frame, str(sender))
        if msg is not None:
            self._source = getattr(self.endpoint, "last_source", None)  # where this message came from
            self._dispatch(sender, msg, self.clock())

    def _dispatch(self, sender: Peer, msg, now: float) -> None:
        if getattr(msg, "incarnation", sender.incarnation) != sender.incarnation:
            self._drop("incarnation", f"{type(msg).__name__} from {sender} names incarnation {msg.incarnation!r}")
            return
        registered = self._sessions.get(sender)
        if registered is not None:
            registered.last_heard = now
            self._note_heard(sender, fresh=False)  # prefill never judges a decode by its name
        if isinstance(msg, p.GetInfo):
            self._send_faulty(self._to(sender), p.encode(self.info))
        elif isinstance(msg, p.Heartbeat):
            if sender not in self._ended and self._loop_ok():
                self._send_faulty(self._to(sender), p.encode(p.HeartbeatAck(self.incarnation, msg.seq)))
        elif isinstance(msg, p.HeartbeatAck):
            pass  # liveness, noted above
        elif isinstance(msg, p.RegisterPeer):
            self._register(sender, msg, now)
        elif isinstance(msg, p.Goodbye):
            if registered is not None:
                self._end(sender, f"its incarnation ended: {msg.reason}")
            self._unregistered.pop(sender, None)
        elif isinstance(msg, ROOM_MESSAGES):
            self._on_room_message(sender, registered is not None, msg, now)
        else:
            self._drop("unexpected", f"{type(msg).__name__} from {sender}")

    def _on_room_message(self, sender: Peer, registered: bool, msg, now: float) -> None:
        if sender in self._ended:  # never acted on; tell it, so that a live decode ends the session too
            self._send_faulty(self._to(sender), p.encode(p.RoomFailed(msg.room, self.incarnation,
                                                                      Reason.PEER_LOST.value)))
        elif registered:
            self._post(FromPeer(sender, msg))
        elif isinstance(msg, p.RegisterRoom):
            self._early_registration(sender, msg, now)
        else:
            self._drop("unregistered", f"{type(msg).__name__} from {sender}, which registered no link")

    def _early_registration(self, sender: Peer, msg: p.RegisterRoom, now: float) -> None:
        """A registration before its session's link (a delayed or lost ``RegisterPeer``): writing
        would fail, so it is dropped and decode sends it again — for ``silence_s``; after that the
        session is declared lost to decode (``room_failed(peer_lost)``), which opens the next."""
        self.early_registrations += 1
        first = self._unregistered.setdefault(sender, now)
        if len(self._unregistered) > MAX_UNREGISTERED:
            self._unregistered.popitem(last=False)
        if now - first >= self._silence_s:
            log.warning("%s registered rooms for %.1fs but never its transfer link: told peer_lost", sender,
                        now - first)
            self._send_faulty(self._to(sender), p.encode(p.RoomFailed(msg.room, self.incarnation,
                                                                      Reason.PEER_LOST.value)))
        else:
            log.info("registration of room %s from %s came before its transfer link; dropped until it is sent "
                     "again", msg.room, sender)

    def _register(self, sender: Peer, msg: p.RegisterPeer, now: float) -> None:
        """A decode session registered its receiving link (answered, also when it is a duplicate:
        decode re-sends until answered). Decode opens session n+1 only after it ended n, so its own
        earlier sessions — same name *and* incarnation — are over."""
        if msg.prefill_incarnation != self.incarnation:
            self._drop("stale", f"link registration from {sender} for incarnation {msg.prefill_incarnation!r}")
            return
        if sender in self._ended:
            return  # a late one from a session that is over
        if sender not in self._sessions:
            replaced = [s for s in self._sessions if (s.name, s.incarnation) == (sender.name, sender.incarnation)]
            why = self._over_limits(len(replaced), now)
            if why is not None:
                self.refused[why] += 1
                n = sum(self.refused.values())
                if worth_logging(n):
                    log.warning("decode session %s from %s refused (%s; %d refused so far)", sender, self._source,
                                why, n)
                return
            for old in replaced:
                self._end(old, f"replaced by its session {sender.session}")
            self._sessions[sender] = _Session(msg.agent_name, now, self._source)
            self._unregistered.pop(sender, None)
            self._transfer.submit(AddPeer(sender, msg.agent_name, msg.agent_metadata))
            self._note_heard(sender, fresh=False)
        self._send_faulty(self._to(sender), p.encode(p.PeerRegistered(self.incarnation, msg.agent_name)))

    def _over_limits(self, replacing: int, now: float) -> Optional[str]:
        """Why a new session may not be registered now (None: it may; it takes a token of the rate).
        ``replacing``: sessions of the same decode that it would end."""
        lim = self.limits
        if len(self._sessions) - replacing >= lim.max_sessions:
            return "limit"
        if self._source is not None and \
                sum(1 for s in self._sessions.values() if s.source == self._source) - replacing >= lim.max_per_address:
            return "per_address"
        if self._tokens_at is not None:
            self._tokens = min(2 * lim.rate, self._tokens + (now - self._tokens_at) * lim.rate)
        self._tokens_at = now
        if self._tokens < 1:
            return "rate"
        self._tokens -= 1
        return None

    def _expire(self, now: float) -> None:
        """End sessions silent past the bound; forget ended and unregistered ones past theirs."""
        for peer in [peer for peer, s in self._sessions.items() if now - s.last_heard > self._silence_s]:
            self._end(peer, f"silent for {now - self._sessions[peer].last_heard:.1f}s")
        while self._ended and (len(self._ended) > MAX_ENDED or now - next(iter(self._ended.values())) > self._ended_s):
            self._ended.popitem(last=False)
        while self._unregistered and now - next(iter(self._unregistered.values())) > 2 * self._silence_s:
            self._unregistered.popitem(last=False)

    def _end(self, peer: Peer, why: str) -> None:
        """Stop heartbeating ``peer``, drop its transfer connection, remember it as over, and tell
        the engine loop (which fails any room still bound to it)."""
        log.warning("decode session %s ended: %s", peer, why)
        self._sessions.pop(peer, None)
        self._ended[peer] = self.clock()
        self._transfer.submit(ResetPeer(peer, forget=True))
        self._post(PeerLost(peer, why))

    def _forget(self, peer: Peer) -> None:
        """The engine loop declared the session lost (it reset the transfer already): stop
        heartbeating it and answering its heartbeats, so that a live decode declares us lost
        too and fences the session."""
        self._sessions.pop(peer, None)
        self._ended[peer] = self.clock()
        self._ended.move_to_end(peer)

    def _send_frame(self, peer: Peer, frame: bytes) -> None:
        self.endpoint.send(identity(peer), frame)

    def close(self, goodbye: Optional[str] = None) -> None:
        """Stop the thread and unbind; with ``goodbye`` (why this incarnation ends), every
        registered session is told first, so that its decode ends it at once."""
        linger = 0
        if self._stopped_for_goodbye() and goodbye is not None:
            frame = p.encode(p.Goodbye(self.incarnation, goodbye[:p.MAX_STR]))
            for peer in list(self._sessions):
                self._send_frame(peer, frame)
            linger = GOODBYE_LINGER_MS if self._sessions else 0
        self.endpoint.close(linger_ms=linger)
        self._close_wake()


class ZmqRouterEndpoint:
    """The prefill side's socket: a ZMQ ROUTER bound on the bootstrap port (``host`` an IPv4 or
    IPv6 address, or a name: ``zmq.IPV6`` set). ``recv`` gives one message's frames (identity
    first) or None; ``send`` never blocks (a peer whose queue is full
    is not reading: the frame is dropped, its deadlines handle it). With a ``secret``
    (``control/curve.py``) only holders of the cluster secret can connect; ``failures`` counts the
    connections refused."""

    def __init__(self, host: str, port: int, secret=None):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IPV6, 1)  # else libzmq binds IPv4 only
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size(p.MAX_FRAME_BYTES, secret))  # CURVE's bytes too
        self._secret = secret
        try:
            self._guard = secret.bind(self.sock, f"bootstrap port {port}") if secret is not None else None
        except BaseException:
            self.sock.close(0)  # left open, it would block the context's termination for ever
            raise
        try:
            self.sock.bind(zmq_endpoint(host, port))
        except zmq.ZMQError:
            self.close()
            raise

    @property
    def failures(self) -> dict[str, int]:
        """Connections refused for authentication, by why (``zap``, ``handshake``)."""
        return {f"authentication_{k}": n for k, n in self._guard.failures.items()} if self._guard else {}

    last_source: Optional[str] = None
    """The IP address the message :meth:`recv` last returned came from (its connection's peer), as
    ``hosts.allow_host`` writes it: an IPv4 peer of a dual-stack socket as its IPv4 address."""

    def recv(self) -> Optional[list[bytes]]:
        try:
            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        try:
            address = frames[-1].get("Peer-Address")
        except zmq.ZMQError:
            address = None
        self.last_source = allow_host(address) if isinstance(address, str) else None
        return [f.bytes for f in frames]

    def send(self, ident: bytes, frame: bytes) -> None:
        try:
            self.sock.send_multipart([ident, frame], zmq.NOBLOCK)
        except zmq.Again:
            log.debug("control message to %r dropped: its queue is full", ident[:64])

    def close(self, linger_ms: int = 0) -> None:
        """Unbind; ``linger_ms``: how long frames already sent may still go out (0: dropped)."""
        if self.sock.closed:
            return
        if self._guard is not None:
            self._secret.unbind(self.sock)  # its monitor, and its ZAP handler when no other socket needs it
        self.sock.close(linger_ms)
