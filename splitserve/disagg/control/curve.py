"""The cluster secret (``--cluster-secret-file``): CURVE on every ZMQ connection between workers
(the control plane, and the tcp transfer backend), and the ZAP handler that admits only holders.
The design and its replay protection: ``docs/protocol.md``; the threat model: ``docs/security.md``.

The secret is at least 32 random bytes, written in its file as hex or base64 (:func:`parse_secret`;
``head -c 32 /dev/urandom | base64``; one plainly not random is refused: ``secret_file.why_guessable``);
a file that other users can read is refused, one its group can read is warned about (a Kubernetes
Secret volume with ``fsGroup`` is 0440). From the secret every holder derives the same two CURVE
key pairs, one for the side that binds (prefill's bootstrap port, a tcp receiver) and one for the
side that connects (:func:`derive_keys`: HKDF-SHA256, RFC 5869, with the role's name in its
``info``). A connecting socket must know the binding side's public key to speak at all, and
proves in the handshake that it holds the connecting side's secret key; the :class:`ZapGuard` of
the binding side's ZMQ context (``inproc://zeromq.zap.01``) admits only that public key.
So a connection from a process without the secret fails its handshake — before any frame of it
reaches our code — and is counted and logged naming authentication; one that has it is encrypted
and authenticated end to end (CurveZMQ: ephemeral keys per connection, strictly increasing nonces).

Nothing here logs a key or the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import stat
import threading
import time
from collections import Counter
from typing import Optional

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from splitserve.log_sparsely import worth_logging
from splitserve.secret_file import MIN_SECRET_BYTES, REFUSE_SAVING_BITS, secret_bytes, why_guessable

log = logging.getLogger(__name__)

HOW_TO_MAKE = "`head -c 32 /dev/urandom | base64 > FILE; chmod 600 FILE`"
HKDF_SALT = b"splitserve cluster secret"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
# How long a new guard waits for the ZAP endpoint to be released. A guard unbinds it when it stops,
# but one whose stop timed out still holds it until its thread ends.
ZAP_BIND_WAIT_S = 5.0
DOMAIN = b"splitserve"
FAILED = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "its credentials were refused",
          zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the handshake failed",
          zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the handshake failed"}
PROTOCOL_ERRORS = {zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "one side has a cluster secret, the other none",
                   zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "it does not hold our cluster secret",
                   zmq.PROTOCOL_ERROR_ZMTP_KEY_EXCHANGE: "it does not hold our cluster secret"}


def hkdf_sha256(ikm: bytes, salt: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF with HMAC-SHA256 (RFC 5869): extract with ``salt``, expand with ``info`` to ``length`` bytes."""
    if not 0 < length <= 255 * 32:
        raise ValueError(f"HKDF-SHA256 gives 1 to {255 * 32} bytes, not {length}")
    prk = hmac.new(salt or bytes(32), ikm, hashlib.sha256).digest()
    okm, block = b"", b""
    for i in range(1, -(-length // 32) + 1):
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        okm += block
    return okm[:length]


def derive_keys(secret: bytes, role: bytes) -> tuple[bytes, bytes]:
    """A CURVE key pair (public, secret; Z85) for ``role`` (``b"bind"`` or ``b"connect"``)."""
    raw = hkdf_sha256(secret, HKDF_SALT, b"splitserve curve v2 " + role)
    secret_z85 = z85.encode(raw)
    return zmq.curve_public(secret_z85), secret_z85


RECORD_KEY_INFO = b"splitserve discovery record v1"  # seals a worker's discovery record (discovery/signing.py)
PROOF_KEY_INFO = b"splitserve identity proof v1"  # a worker's answer to a router's nonce (discovery/proof.py)


def parse_secret(text: bytes) -> bytes:
    """The secret's bytes from the text of its file (``secret_file.secret_bytes``: hex, base64, or
    base64 of either); ValueError (never repeating the text) unless it holds at least
    ``MIN_SECRET_BYTES`` and is not plainly guessable (``secret_file.why_guessable``: a random one
    is refused with probability at most ``2**-REFUSE_SAVING_BITS``)."""
    raw = secret_bytes(text)
    if raw is None:
        raise ValueError(f"a cluster secret is written as hex or base64, e.g. {HOW_TO_MAKE}")
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"a cluster secret has at least {MIN_SECRET_BYTES} random bytes, this one {len(raw)} "
                         f"(e.g. {HOW_TO_MAKE})")
    why = why_guessable(raw)
    if why is not None:
        letters = text.strip().isalpha()
        raise ValueError(f"a cluster secret is random bytes, and this one is plainly not ({why}: written in "
                         f"{REFUSE_SAVING_BITS}+ bits fewer than random bytes need)"
                         + ("; a secret of letters alone is read as base64 and refused, as passphrases and "
                            "placeholders look so, even when the letters were drawn at random" if letters else "")
                         + f"; make one with {HOW_TO_MAKE}")
    return raw




class ClusterSecret:
    """The keys derived from one secret, and one :class:`ZapGuard` per ZMQ context that binds."""

    def __init__(self, secret: bytes, zap_wait_s: float = ZAP_BIND_WAIT_S):
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"a cluster secret has at least {MIN_SECRET_BYTES} random bytes (e.g. {HOW_TO_MAKE})")
        self.bind_public, self.bind_secret = derive_keys(secret, b"bind")
        self.connect_public, self.connect_secret = derive_keys(secret, b"connect")
        self.record_key = hkdf_sha256(secret, HKDF_SALT, RECORD_KEY_INFO)
        self.proof_key = hkdf_sha256(secret, HKDF_SALT, PROOF_KEY_INFO)
        self._guards: dict[int, tuple[ZapGuard, int]] = {}  # by context: the guard, its users
        self._zap_wait_s = zap_wait_s
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return "ClusterSecret(<not shown>)"

    @classmethod
    def load(cls, path: str, warn: bool = True) -> "ClusterSecret":
        """The secret in file ``path`` (:func:`parse_secret`); ValueError naming the file (never its
        content) when it cannot be read, is open to other users, or is not a secret. One its group
        may read is warned about (``warn``)."""
        try:
            with open(path, "rb") as f:
                data = f.read(1 << 16)
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise ValueError(f"--cluster-secret-file {path}: cannot read it: {exc}") from None
        if mode & stat.S_IRWXO:
            raise ValueError(f"--cluster-secret-file {path}: every user of this machine can read or change it "
                             f"(mode {stat.S_IMODE(mode):o}): chmod 600 it")
        if warn and mode & stat.S_IRWXG:
            log.warning("--cluster-secret-file %s can be read by its group (mode %o): chmod 600 it unless that "
                        "group is only the workers", path, stat.S_IMODE(mode))
        try:
            return cls(parse_secret(data))
        except ValueError as exc:
            raise ValueError(f"--cluster-secret-file {path}: {exc}") from None

    def bind(self, sock: zmq.Socket, what: str) -> "ZapGuard":
        """Make ``sock`` (before it binds) a CURVE server admitting only holders; the guard of its
        context counts what it refuses. If it raises, ``sock`` holds no guard (no :meth:`unbind`)."""
        guard = self.guard(sock.context)
        try:
            sock.setsockopt(zmq.ZAP_DOMAIN, DOMAIN)
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self.bind_public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.bind_secret)
            guard.watch(sock, what)
        except BaseException:
            self.unbind(sock)
            raise
        return guard

    def connect(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before it connects) a CURVE client of a holder."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.bind_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.connect_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.connect_secret)

    def unbind(self, sock: zmq.Socket) -> None:
        """Before ``sock`` (made a server by :meth:`bind`) closes, on the thread that owns it: its
        monitor stopped, then one user of its context's guard released — the last one stops the
        guard, before the context is terminated. A guard left running would go on answering ZAP
        for the whole context (``zmq.Context.instance()`` is the process's) and refuse every later
        socket without a secret there; a monitor whose reader closed first would block the
        context's I/O thread for ever on its next event (libzmq #3575)."""
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        ctx = sock.context
        with self._lock:
            guard, users = self._guards.pop(id(ctx), (None, 0))
            if guard is not None and users > 1:
                self._guards[id(ctx)] = (guard, users - 1)
        if guard is None:
            return
        guard.unwatch(sock)
        if users <= 1:
            guard.stop()

    def guard(self, ctx: zmq.Context) -> "ZapGuard":
        """The guard of ``ctx``, started on first use; each call is one more user of it, who
        releases it once (:meth:`unbind`)."""
        with self._lock:
            guard, users = self._guards.get(id(ctx), (None, 0))
            if guard is None or guard.stopped:
                guard, users = ZapGuard(ctx, z85.decode(self.connect_public), self._zap_wait_s), 0
                guard.start()
            self._guards[id(ctx)] = (guard, users + 1)
            return guard


class ZapGuard(threading.Thread):
    """The ZAP handler of one ZMQ context (admits a CURVE client only with the holders' public
    key) and the reader of the monitors of that context's binding sockets (a handshake that failed
    before ZAP: no secret, another secret, or none where we have one). Each refusal is counted in
    ``failures`` (by why) and logged, the first 20 and then every 1000th."""

    POLL_MS = 100

    def __init__(self, ctx: zmq.Context, allowed: bytes, wait_s: float):
        super().__init__(name="control-zap", daemon=True)
        self._allowed = allowed
        self.failures: Counter = Counter()
        self._adopt: "queue.SimpleQueue[tuple[int, Optional[zmq.Socket], str]]" = queue.SimpleQueue()  # by id(socket)
        self._quit = threading.Event()
        self.stopped = False
        self.zap = ctx.socket(zmq.REP)
        self.zap.setsockopt(zmq.LINGER, 0)
        try:
            self._bind_when_free(wait_s)
        except BaseException:
            self.zap.close(0)  # left open, it would block the context's termination for ever
            raise

    def _bind_when_free(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.zap.bind(ZAP_ENDPOINT)
                return
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                    raise
            time.sleep(0.01)

    def watch(self, sock: zmq.Socket, what: str) -> None:
        """Read ``sock``'s handshake failures from now on (thread-safe)."""
        events = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | \
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        self._adopt.put((id(sock), sock.get_monitor_socket(events), what))

    def unwatch(self, sock: zmq.Socket) -> None:
        """``sock``'s monitor was stopped (:meth:`ClusterSecret.unbind`): close our end of it
        (thread-safe)."""
        self._adopt.put((id(sock), None, ""))

    def stop(self) -> None:
        self._quit.set()
        if self.is_alive():
            self.join(5)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.zap, zmq.POLLIN)
        monitors: dict[zmq.Socket, str] = {}
        of: dict[int, zmq.Socket] = {}  # the monitor of each watched socket, by id(socket)
        try:
            while not self._quit.is_set():
                while not self._adopt.empty():
                    key, mon, what = self._adopt.get_nowait()
                    if mon is not None:
                        of[key], monitors[mon] = mon, what
                        poller.register(mon, zmq.POLLIN)
                    elif key in of:
                        mon = of.pop(key)
                        poller.unregister(mon)
                        del monitors[mon]
                        mon.close(0)
                try:
                    ready = dict(poller.poll(self.POLL_MS))
                except zmq.ContextTerminated:
                    return
                for sock in ready:
                    try:
                        if sock is self.zap:
                            self._answer(sock.recv_multipart())
                        else:
                            self._on_event(recv_monitor_message(sock), monitors[sock])
                    except zmq.ContextTerminated:
                        return
                    except Exception:  # a bad request or event is dropped, the guard goes on
                        log.exception("cluster secret: error in the ZAP handler; continuing")
        finally:
            self.stopped = True
            try:  # now: a closed socket's endpoint is released later (by the context's reaper
                # thread), and the next guard of this context binds the same one
                self.zap.unbind(ZAP_ENDPOINT)
            except zmq.ZMQError:
                pass
            self.zap.close(0)
            for mon in monitors:
                mon.close(0)

    def _answer(self, frames: list[bytes]) -> None:
        version, request_id, domain, address, _identity, mechanism, *credentials = frames
        ok = mechanism == b"CURVE" and domain == DOMAIN and len(credentials) == 1 and \
            hmac.compare_digest(credentials[0], self._allowed)
        if not ok:
            self._refused("zap", f"a {mechanism.decode(errors='replace')} connection from "
                                 f"{address.decode(errors='replace')}: its key is not the cluster's")
        status = (b"200", b"OK") if ok else (b"400", b"authentication failed: not a holder of the cluster secret")
        self.zap.send_multipart([version, request_id, *status, b"", b""])

    def _on_event(self, event: dict, what: str) -> None:
        why = FAILED.get(event["event"])
        if why is not None:
            detail = PROTOCOL_ERRORS.get(event.get("value"), why)
            self._refused("handshake", f"{what}: a connection failed the CURVE handshake ({detail})")

    def _refused(self, why: str, detail: str) -> None:
        self.failures[why] += 1
        n = sum(self.failures.values())
        if worth_logging(n):
            log.warning("authentication failed, connection refused (%d so far): %s", n, detail)
