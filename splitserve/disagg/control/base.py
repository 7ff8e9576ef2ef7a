"""What both control threads share: who a sender is, the outbox, liveness kept off the engine
loop's inbox, fault injection, and a receive loop that no frame can stop.

**Identity.** A decode worker's control socket (a ZMQ DEALER) has the identity
``name#incarnation#session``: its advertised address (for humans), the id it drew at start (what
makes it unique), and the number of this connection. :func:`peer_of` parses it strictly (ASCII
digits, valid UTF-8, bounded parts); anything else is not a peer, and its frames are dropped and
counted. **Untrusted input.** Every frame is handled inside its own ``try``: it can only be
dropped and counted (``bad_frames``), never end the thread or reach the engine half-parsed; a poll
reads at most ``MAX_FRAMES_PER_POLL`` frames before heartbeats and the outbox get their turn.

**Sockets behind a seam.** Each side reaches its sockets through a small transport (prefill's
``ZmqRouterEndpoint``, decode's ``zmq_dial``), and one iteration of the thread's loop is
``step()``: ``serve()`` polls the real sockets and calls it, the simulator calls it itself. Each
``step()`` also steps an :class:`~splitserve.disagg.control.io_probe.IoProbe` (a loopback round
trip through the ZMQ I/O thread), whose age :meth:`ControlThread.io_age` gives ``/health``.

**Liveness off the inbox.** Any authentic frame from a peer notes it in ``_heard`` (one entry per
peer), which the engine loop takes (:meth:`ControlThread.take_heard`) before it judges silence.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import re
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

from splitserve.disagg import protocol as p
from splitserve.disagg.lifecycle import Peer
from splitserve.disagg.supervised import SupervisedThread
from splitserve.log_sparsely import worth_logging

log = logging.getLogger(__name__)

# The longest a control thread sleeps. Work from other threads wakes it through its wake pipe and
# frames through their sockets; what else is due on it (heartbeats, delayed frames) it sleeps
# until (``poll_ms``), and the rest (resends after ``INFO_RETRY_S``, silence after seconds) is
# coarse enough to be looked at this often. A shorter period only takes the GIL from the engine
# thread more often, on the path of every token (docs/journal.md, the per-token path).
POLL_MS = 50
GOODBYE_LINGER_MS = 500  # how long a closed socket still tries to deliver the goodbyes queued on it
MAX_FRAMES_PER_POLL = 256  # then heartbeats and the outbox get their turn
_IDENTITY = re.compile(r"(?P<name>[^#]{1,200})#(?P<incarnation>[0-9A-Za-z]{1,64})#(?P<session>[0-9]{1,18})")


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
    """The peer a socket identity names, or None: anything but ``name#incarnation#session`` with
    a non-empty name, an alphanumeric incarnation and ASCII digits, in valid UTF-8."""
    try:
        text = ident.decode("utf-8")
    except UnicodeDecodeError:
        return None
    m = _IDENTITY.fullmatch(text)
    if m is None or not m["name"].isprintable():
        return None
    return Peer(m["name"], m["incarnation"], int(m["session"]))


class ControlThread(SupervisedThread):
    """The outbox, fault injection, liveness notes and counters of bad frames."""

    def __init__(self, name: str, incarnation: str, post: Callable[[object], None], heartbeat_s: float,
                 faults: Optional[ControlFaults], loop_alive: Optional[Callable[[], bool]] = None,
                 io_probe=None, wake: Optional[Callable[[], None]] = None):
        """``io_probe``: an ``IoProbe`` of the context this thread's sockets use (None: not watched,
        as in a simulator, which has no ZMQ). ``wake``: how another thread wakes this one (default a
        byte down its wake pipe, which its poll watches); a simulator that steps the thread itself
        passes its own, and the thread opens no pipe (its caller steps it, never ``serve()``)."""
        super().__init__(name=name)
        self._io_probe = io_probe
        self.incarnation = incarnation
        self._loop_alive = loop_alive or (lambda: True)
        self._wedged = False
        self._post = post
        self._heartbeat_s = heartbeat_s
        self._faults = faults or ControlFaults()
        self._rng = random.Random(self._faults.seed)
        self._outbox: "queue.SimpleQueue[tuple[Peer, object]]" = queue.SimpleQueue()
        self._delayed: list[tuple[float, Callable[[bytes], None], bytes]] = []
        self._hb_seq = 0
        self._next_hb = 0.0
        self._heard: dict[Peer, bool] = {}
        self._heard_lock = threading.Lock()
        self.bad_frames: Counter = Counter()
        """Frames dropped, by why (``identity``, ``decode``, ``unexpected``, ...)."""
        # Another thread that hands us work writes a byte here, so the poll wakes at once
        # instead of at its next timeout (it is on the path of every request).
        self._wake_hook = wake
        self._wake_lock = threading.Lock()  # no write to the pipe once it is closed (its fd may be reused)
        self._wake_closed = wake is not None  # a thread woken by its own hook has no pipe
        if wake is None:
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            os.set_blocking(self._wake_w, False)

    # -- called by the engine loop ----------------------------------------------------------------

    def send(self, peer: Peer, msg) -> None:
        """Thread-safe: queue a control message for ``peer``."""
        self._outbox.put((peer, msg))
        self._wake()

    def forget(self, peer: Peer) -> None:
        """Thread-safe: ``peer`` was declared lost; see ``_forget`` of each side."""
        self._outbox.put((peer, None))
        self._wake()

    def dropped(self) -> dict[str, int]:
        """Frames and connections dropped so far, by why (read from any thread)."""
        return dict(self.bad_frames)

    def io_age(self) -> Optional[float]:
        """Seconds since the ZMQ I/O thread last moved a probe (None when not watched); any thread."""
        return self._io_probe.age() if self._io_probe is not None else None

    def take_heard(self) -> dict[Peer, bool]:
        """Thread-safe: the peers heard from since the last call, each with whether it answered our
        own heartbeat (``fresh``: certainly the process running now under its name)."""
        with self._heard_lock:
            heard, self._heard = self._heard, {}
        return heard

    # -- on the thread ----------------------------------------------------------------------------

    def _note_heard(self, peer: Peer, fresh: bool) -> None:
        with self._heard_lock:
            self._heard[peer] = self._heard.get(peer, False) or fresh

    def _drop(self, why: str, detail: str) -> None:
        """A frame that is not ours to act on: counted, and logged sparsely."""
        self.bad_frames[why] += 1
        n = sum(self.bad_frames.values())
        if worth_logging(n):
            log.warning("%s: control frame dropped (%s; %d so far): %s", self.name, why, n, detail)

    def _decode(self, frame: bytes, origin: str):
        try:
            return p.decode(frame)
        except p.ProtocolError as exc:
            self._drop("decode", f"from {origin}: {exc}")
            return None

    def _wake(self) -> None:
        if self._wake_hook is not None:
            self._wake_hook()
            return
        with self._wake_lock:
            if self._wake_closed:
                return
            try:
                os.write(self._wake_w, b"!")
            except BlockingIOError:  # full: a wake-up is pending anyway
                pass

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _step_probe(self) -> None:
        if self._io_probe is not None:
            self._io_probe.step()

    def _stopped_for_goodbye(self) -> bool:
        """Stop the thread; whether its sockets are now ours to say goodbye on (it ended: a thread
        that hangs still owns them, and its peers learn by its silence instead)."""
        self.stop()
        if self.is_alive():
            log.warning("%s did not stop: its peers learn of its end by its silence", self.name)
            return False
        self._flush_outbox()  # what the engine loop handed over last (an abort_room...) goes first
        return True

    def _close_wake(self) -> None:
        """After the thread has stopped (the I/O probe's sockets go too)."""
        if self._io_probe is not None:
            self._io_probe.close()
            self._io_probe = None
        with self._wake_lock:
            if not self._wake_closed:
                self._wake_closed = True
                os.close(self._wake_r)
                os.close(self._wake_w)

    def _flush_outbox(self) -> None:
        now = self.clock()
        while True:
            try:
                peer, msg = self._outbox.get_nowait()
            except queue.Empty:
                break
            if msg is None:  # a ``forget`` marker, kept in order with the sends around it
                self._forget(peer)
            else:
                self._send_faulty(self._to(peer), p.encode(msg))
        if self._delayed:
            due = [d for d in self._delayed if d[0] <= now]
            self._delayed = [d for d in self._delayed if d[0] > now]
            for _, send, frame in due:
                send(frame)

    def _to(self, peer: Peer) -> Callable[[bytes], None]:
        return lambda frame: self._send_frame(peer, frame)

    def _send_faulty(self, send: Callable[[bytes], None], frame: bytes) -> None:
        """Every outgoing frame goes through here: ``send`` it, or (fault injection) drop, delay or
        duplicate it."""
        f = self._faults
        if f.drop and self._rng.random() < f.drop:
            return
        if f.delay and self._rng.random() < f.delay:
            self._delayed.append((self.clock() + f.delay_s, send, frame))
            return
        send(frame)
        if f.duplicate and self._rng.random() < f.duplicate:
            send(frame)

    def poll_ms(self) -> int:
        """How long the thread may sleep now: until its next heartbeat or delayed frame is due,
        at most ``POLL_MS``."""
        due = self._next_hb
        if self._delayed:
            due = min(due, min(d[0] for d in self._delayed))
        return max(0, min(POLL_MS, int((due - self.clock()) * 1000) + 1))

    def _heartbeat_due(self) -> bool:
        now = self.clock()
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
                log.error("the engine loop has made no progress within --loop-stall-s: heartbeats withheld, "
                          "so that peers declare this worker lost and free what they hold for it")
            else:
                log.warning("the engine loop moves again: heartbeats resume")
        return alive

    # -- what each side fills in -------------------------------------------------------------------

    def _forget(self, peer: Peer) -> None:
        raise NotImplementedError

    def _send_frame(self, peer: Peer, frame: bytes) -> None:
        raise NotImplementedError
