"""Built-in tcp backend: KV bytes over ZMQ, no dependency beyond pyzmq.

Each backend binds one ROUTER socket (``host:port``, IPv4 or IPv6; port 0 picks a free port)
served by a receiver thread, and advertises its address in :meth:`TcpBackend.metadata`. A writer
keeps one DEALER socket per peer, dialled only at a ``tcp://HOST:PORT`` (:func:`peer_endpoint`),
and cuts a write into frames ``[header, payload]`` (``payload`` a copy of our buffer's bytes, read
when the frame is sent); the receiver counts each write's frames, queues ``(frm, notif)`` for
:meth:`~TcpBackend.notifications` once the last one completes it, and answers ``{wid, ok[,
reason]}``, which makes the writer's handle DONE or FAILED. The frame format, what a lost frame or
answer does, and what the receiver refuses: ``docs/protocol.md``, *Transfer backends*.

Never blocking: frames are sent with ``NOBLOCK``; what the socket's high-water mark refuses stays
in the peer's FIFO and is sent by later ``write``/``poll`` calls. Memory is bounded by
``send_hwm`` frames per peer on each side. With a cluster secret (``secret``,
``disagg/control/curve.py``) every socket is CURVE: only holders connect, and the KV bytes are
encrypted on the wire. A receiving link (``writable_page_nbytes``) takes bytes only into the pages
:meth:`TcpBackend.allow_pages` opened to its writer; once :meth:`TcpBackend.revoke_pages` returns
nothing lands in them. An unexpected error in the receiver loop is logged and the loop goes on;
the thread ends only at :meth:`~TcpBackend.close`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import msgpack
import numpy as np
import torch
import zmq

from splitserve.disagg.zmq_frames import max_msg_size
from splitserve.hosts import allow_host, check_host, zmq_endpoint
from splitserve.log_sparsely import worth_logging

from .base import DONE, Handle, Span, TransferBackend, TransferState, encode_metadata, failed, refused

log = logging.getLogger(__name__)

PROTOCOL = 2  # 2: frames are counted per write
_HEADER_SLACK = 4096  # bytes a header may take beyond its notification
_WRITES_KEPT = 4096  # writes in progress (and failed ones) remembered until their last frame
_ctl_ids = itertools.count()


@dataclass(eq=False)
class TcpHandle(Handle):
    chunks: collections.deque = field(default_factory=collections.deque)  # (local_off, remote_off, n) unsent
    notif: bytes = b""
    nframes: int = 1  # frames in the whole write
    last_sent: bool = False


@dataclass(eq=False)
class _Peer:
    name: str
    metadata: bytes
    nbytes: int
    max_frame: int
    max_notif: int
    sock: zmq.Socket
    outbox: collections.deque = field(default_factory=collections.deque)  # TcpHandle, FIFO
    inflight: dict = field(default_factory=dict)  # write id -> TcpHandle, last frame sent


class TcpBackend(TransferBackend):
    name = "tcp"

    @classmethod
    def options(cls, host: str, secret: Any) -> dict:
        return {"host": host, "secret": secret}

    @classmethod
    def receiver_options(cls, page_nbytes: Optional[int]) -> dict:
        return {"writable_page_nbytes": page_nbytes} if page_nbytes is not None else {}

    def __init__(
        self,
        agent_name: str,
        buffer: torch.Tensor,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: Optional[str] = None,
        max_frame_bytes: int = 4 << 20,
        max_notif_bytes: int = 64 << 10,
        send_hwm: int = 16,
        secret: Any = None,
        writable_page_nbytes: Optional[int] = None,
        **opts: Any,
    ):
        super().__init__(agent_name, buffer)
        if buffer.device.type != "cpu":
            raise ValueError("the tcp backend moves CPU memory only")
        if max_frame_bytes <= 0 or max_notif_bytes < 0:
            raise ValueError("max_frame_bytes must be positive and max_notif_bytes non-negative")
        self.max_frame_bytes = max_frame_bytes
        self.max_notif_bytes = max_notif_bytes
        self._send_hwm = send_hwm
        self._bytes = buffer.view(-1).view(torch.uint8).numpy()  # [nbytes], shares memory
        self._ctx = zmq.Context(io_threads=1)
        self._secret = secret  # control/curve.ClusterSecret: CURVE on the receiver and every writer's socket
        self._peers: dict[str, _Peer] = {}
        self._closed = False
        if writable_page_nbytes is not None and writable_page_nbytes <= 0:
            raise ValueError("writable_page_nbytes must be positive")
        # a receiving link: writes land only in the pages allowed (allow_pages); None: anywhere in the buffer
        self._writable = _WritablePages(writable_page_nbytes) if writable_page_nbytes else None
        self._receiver = _Receiver(
            self._ctx, agent_name, self._bytes, host, port,
            max_msg=max(max_frame_bytes, max_notif_bytes + _HEADER_SLACK), hwm=send_hwm, secret=secret,
            writable=self._writable,
        )
        self._receiver.start()
        self._receiver.ready.wait()
        if self._receiver.error is not None:
            self._ctx.destroy(linger=0)
            raise OSError(f"tcp transfer backend could not bind {host}:{port}: {self._receiver.error}")
        bound_host, _, bound_port = self._receiver.endpoint.removeprefix("tcp://").rpartition(":")
        # an IPv4 address bound with zmq.IPV6 reads back IPv4-mapped: advertised as the IPv4 address
        self.endpoint = zmq_endpoint(advertise_host or allow_host(bound_host), bound_port)

    def metadata(self) -> bytes:
        return encode_metadata(
            self.name, self.agent_name, self.nbytes, protocol=PROTOCOL, endpoint=self.endpoint,
            max_frame=self.max_frame_bytes, max_notif=self.max_notif_bytes,
        )

    def stats(self) -> dict[str, int]:
        """Receiver counters: frames handled, bad frames refused, bytes written into our buffer."""
        r = self._receiver
        return {"frames": r.frames, "bad_frames": r.bad_frames, "bytes_received": r.bytes_received}

    def allow_pages(self, key: object, pages: Sequence[int]) -> None:
        if self._writable is not None:
            self._writable.allow(key, pages)

    def revoke_pages(self, key: object, pages: Optional[Sequence[int]] = None) -> None:
        if self._writable is not None:
            self._writable.revoke(key, pages)

    def add_peer(self, peer_name: str, metadata: bytes) -> None:
        known = self._peers.get(peer_name)
        md = self._check_new_peer(peer_name, metadata, known.metadata if known is not None else None)
        if md is None:
            return
        if md.get("protocol") != PROTOCOL:
            raise ValueError(f"peer {peer_name!r}: tcp transfer protocol {md.get('protocol')!r}, ours is {PROTOCOL}")
        endpoint = peer_endpoint(peer_name, md.get("endpoint"))
        sock = self._ctx.socket(zmq.DEALER)
        if self._secret is not None:
            self._secret.connect(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)  # else libzmq resolves and dials IPv4 only
        sock.setsockopt(zmq.SNDHWM, self._send_hwm)
        sock.connect(endpoint)
        self._peers[peer_name] = _Peer(
            peer_name, metadata, md["nbytes"], min(self.max_frame_bytes, int(md["max_frame"])),
            int(md["max_notif"]), sock,
        )

    def remove_peer(self, peer_name: str) -> None:
        peer = self._peers.pop(peer_name, None)
        if peer is None:
            return
        for h in [*peer.outbox, *peer.inflight.values()]:
            if h.state.pending:
                h.state = failed("peer_removed")
        peer.outbox.clear()
        peer.inflight.clear()
        peer.sock.close(linger=0)

    def write(self, peer_name: str, spans: Sequence[Span], notif: bytes) -> TcpHandle:
        h = TcpHandle(peer_name, sum(s.nbytes for s in spans), len(spans), notif=bytes(notif))
        peer = self._peers.get(peer_name)
        if (reason := self._refusal(peer_name, spans, peer.nbytes if peer is not None else None)) is not None:
            h.state = refused(reason)
        elif len(h.notif) > peer.max_notif:
            h.state = refused(f"notif_too_large: {len(h.notif)} B, peer takes {peer.max_notif} B")
        else:
            for s in spans:
                for at in range(0, s.nbytes, peer.max_frame):
                    n = min(peer.max_frame, s.nbytes - at)
                    h.chunks.append((s.local_offset + at, s.remote_offset + at, n))
            h.nframes = max(1, len(h.chunks))
            peer.outbox.append(h)
            self._flush(peer)
        return h

    def poll(self, handle: Handle) -> TransferState:
        self._check_handle(handle, TcpHandle)
        if handle.state.pending:
            peer = self._peers.get(handle.peer)
            if peer is not None:
                self._flush(peer)
                self._drain_answers(peer)
        return handle.state

    def release(self, handle: Handle) -> None:
        self._check_handle(handle, TcpHandle)
        if handle.state.pending:
            handle.state = failed("released")  # unsent frames are dropped; sent ones may still land
        handle.released = True
        handle.chunks.clear()
        peer = self._peers.get(handle.peer)
        if peer is not None:
            peer.inflight.pop(handle.id, None)
            if handle in peer.outbox:
                peer.outbox.remove(handle)

    def notifications(self) -> list[tuple[str, bytes]]:
        inbox, out = self._receiver.inbox, []
        while inbox:
            out.append(inbox.popleft())
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for name in list(self._peers):
            self.remove_peer(name)
        self._receiver.stop()  # it unbinds its socket (its ZAP handler's sockets, before the context ends)
        if self._receiver.is_alive():
            log.error("tcp receiver of %r did not stop; destroying its sockets", self.agent_name)
            self._ctx.destroy(linger=0)
        else:
            self._ctx.term()

    # -- writer internals (transfer thread) --------------------------------------------------

    def _flush(self, peer: _Peer) -> None:
        """Send queued frames to ``peer`` in order until its socket would block."""
        while peer.outbox:
            h: TcpHandle = peer.outbox[0]
            while True:
                lo, ro, n = h.chunks[0] if h.chunks else (0, 0, 0)
                last = len(h.chunks) <= 1
                header: dict[str, Any] = {"v": PROTOCOL, "to": peer.name, "frm": self.agent_name, "wid": h.id,
                                          "off": ro, "n": h.nframes, "last": last}
                if last and h.notif:
                    header["notif"] = h.notif
                frames: list[Any] = [msgpack.packb(header, use_bin_type=True)]
                if n:
                    frames.append(self._bytes[lo : lo + n])
                try:
                    peer.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    return
                except zmq.ZMQError as e:
                    h.state = failed(f"transfer_error: {e}")
                    peer.outbox.popleft()
                    break
                if h.chunks:
                    h.chunks.popleft()
                if last:
                    h.last_sent = True
                    peer.outbox.popleft()
                    peer.inflight[h.id] = h
                    break

    def _drain_answers(self, peer: _Peer) -> None:
        while True:
            try:
                raw = peer.sock.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                answer = msgpack.unpackb(raw, raw=False)
                wid, ok = answer["wid"], answer["ok"]
            except Exception as e:
                log.warning("bad answer from tcp peer %r: %s", peer.name, e)
                continue
            h = peer.inflight.pop(wid, None)
            if h is None:
                continue
            self._answer_lost(peer, before=h)
            if h.state.pending:
                # the receiver handled the last frame and answered: nothing of the write can land any more
                h.state = DONE if ok is True else refused(f"refused_by_peer: {answer.get('reason', '?')}")

    @staticmethod
    def _answer_lost(peer: _Peer, before: TcpHandle) -> None:
        """Fail the writes whose last frame went out before ``before``'s and are still unanswered.
        One connection keeps frames in order and the receiver answers each write as its last frame
        arrives, so their answers would have come first: the connection broke and took their last
        frame or their answer with it. Whether their bytes landed is unknown (``may_land``: the
        session ends and decode fences it), but they fail now, not at the transfer deadline."""
        for wid in list(peer.inflight):
            h = peer.inflight[wid]
            if h.id >= before.id:
                break
            del peer.inflight[wid]
            if h.state.pending:
                h.state = failed("answer_lost: the connection broke after the write's last frame went out")


class _WritablePages:
    """The pages of a receiving link that writes may land in, by key (a room), each page counted
    once per key that holds it. The receiver checks and copies under ``lock``; ``allow`` and
    ``revoke`` (any thread) take it too."""

    def __init__(self, page_nbytes: int):
        self.page_nbytes = page_nbytes
        self.lock = threading.Lock()
        self._by_key: dict[object, set[int]] = {}
        self._holders: collections.Counter = collections.Counter()  # page -> keys that allow it

    def allow(self, key: object, pages: Sequence[int]) -> None:
        with self.lock:
            held = self._by_key.setdefault(key, set())
            for page in set(pages) - held:
                held.add(page)
                self._holders[page] += 1

    def revoke(self, key: object, pages: Optional[Sequence[int]] = None) -> None:
        with self.lock:
            held = self._by_key.get(key)
            if held is None:
                return
            for page in held if pages is None else held & set(pages):
                self._holders[page] -= 1
                if not self._holders[page]:
                    del self._holders[page]
            if pages is None:
                del self._by_key[key]
            else:
                held.difference_update(pages)

    def covers(self, offset: int, nbytes: int) -> bool:
        """Whether every page the bytes touch is allowed (call with ``lock`` held)."""
        first, last = offset // self.page_nbytes, (offset + nbytes - 1) // self.page_nbytes
        return all(page in self._holders for page in range(first, last + 1))


def peer_endpoint(peer_name: str, endpoint: object) -> str:
    """The ``tcp://HOST:PORT`` a peer's metadata names, in ``hosts``' form; ValueError for anything
    else (another transport, ``inproc://`` or ``ipc://``, would reach this process's own sockets)."""
    if isinstance(endpoint, str) and endpoint.startswith("tcp://"):
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        try:
            if port.isdigit() and 0 < int(port) < 65536:
                return zmq_endpoint(check_host(host), int(port))
        except ValueError:
            pass
    raise ValueError(f"peer {peer_name!r}: its endpoint {str(endpoint)[:100]!r} is not tcp://HOST:PORT")


class _Receiver(threading.Thread):
    """Owns the ROUTER socket: writes incoming payloads into the buffer, queues notifications,
    answers each write's last frame. Survives bad frames; stops at :meth:`stop`."""

    def __init__(self, ctx: zmq.Context, agent_name: str, dst: np.ndarray, host: str, port: int,
                 max_msg: int, hwm: int, secret: Any = None, writable: Optional[_WritablePages] = None):
        super().__init__(name=f"tcp-transfer-rx-{agent_name}", daemon=True)
        self._ctx, self._agent_name, self._dst = ctx, agent_name, dst
        self._writable = writable
        self._bind = zmq_endpoint(host, port)
        self._max_msg, self._hwm = max_msg, hwm
        self._secret = secret
        self._guarded = False  # the receiving socket holds a user of the secret's guard (unbind once)
        self._ctl = f"inproc://splitserve-tcp-ctl-{next(_ctl_ids)}-{id(self)}"
        self._stopping = False
        self.ready = threading.Event()
        self.error: Optional[BaseException] = None
        self.endpoint = ""
        self.inbox: collections.deque[tuple[str, bytes]] = collections.deque()
        # (writer, write id) -> [frames received, why it failed or None], until its last frame
        self._writes: collections.OrderedDict[tuple[str, int], list] = collections.OrderedDict()
        self.frames = self.bad_frames = self.bytes_received = 0

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        ctl = self._ctx.socket(zmq.PAIR)
        ctl.setsockopt(zmq.LINGER, 0)
        ctl.connect(self._ctl)
        ctl.send(b"stop", flags=zmq.NOBLOCK)
        self.join(timeout)
        ctl.close(linger=0)

    def run(self) -> None:
        sock = ctl = None
        try:
            sock = self._ctx.socket(zmq.ROUTER)
            if self._secret is not None:
                self._secret.bind(sock, f"tcp transfer receiver of {self._agent_name}")
                self._guarded = True
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IPV6, 1)  # else libzmq binds IPv4 only
            sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size(self._max_msg, self._secret))  # CURVE's bytes too
            sock.setsockopt(zmq.RCVHWM, self._hwm)
            sock.bind(self._bind)
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            ctl = self._ctx.socket(zmq.PAIR)
            ctl.bind(self._ctl)
        except Exception as e:
            self.error = e
            self._close(sock, ctl)
            self.ready.set()
            return
        self.ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(ctl, zmq.POLLIN)
        try:
            while not self._stopping:
                try:
                    events = dict(poller.poll())
                    if ctl in events:
                        break
                    self._drain(sock)
                except zmq.ContextTerminated:
                    break
                except Exception:  # never die silently (docs/design.md, rule 8): log, breathe, go on
                    log.exception("tcp receiver of %r: unexpected error; continuing", self._agent_name)
                    time.sleep(0.01)
        finally:
            self._close(sock, ctl)

    def _close(self, sock: Optional[zmq.Socket], ctl: Optional[zmq.Socket]) -> None:
        """On this thread, which owns them: the receiving socket (unbound from the cluster
        secret first: its monitor stopped before the guard closes its end) and the control pair."""
        if sock is not None:
            if self._guarded:
                self._secret.unbind(sock)
                self._guarded = False
            sock.close(linger=0)
        if ctl is not None:
            ctl.close(linger=0)

    def _drain(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.frames += 1
            try:
                self._handle(sock, frames)
            except Exception as e:
                self._refuse(f"bad frame: {type(e).__name__}: {e}")

    def _land(self, off: int, payload) -> Optional[str]:
        """Copy ``payload`` to ``off`` (a receiving link: only into pages allowed now); why not, or None."""
        guard = self._writable
        if guard is None:
            self._copy(off, payload)
            return None
        with guard.lock:
            if not guard.covers(off, len(payload)):
                return (f"not_writable: {len(payload)} B at offset {off} fall outside the pages of the rooms "
                        "registered with this link's writer")
            self._copy(off, payload)
        return None

    def _copy(self, off: int, payload) -> None:
        self._dst[off : off + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        self.bytes_received += len(payload)

    def _refuse(self, reason: str) -> None:
        self.bad_frames += 1
        if worth_logging(self.bad_frames, first=10):
            log.warning("tcp receiver of %r refused a frame (%d so far): %s", self._agent_name, self.bad_frames, reason)

    def _handle(self, sock: zmq.Socket, frames: list) -> None:
        if len(frames) not in (2, 3):
            raise ValueError(f"{len(frames)} frames")
        ident = frames[0].bytes
        header = msgpack.unpackb(frames[1].bytes, raw=False)
        if not isinstance(header, dict) or header.get("v") != PROTOCOL:
            raise ValueError(f"header is not a protocol-{PROTOCOL} map")
        wid, off, last, frm, n = header.get("wid"), header.get("off"), header.get("last"), header.get("frm"), header.get("n")
        notif = header.get("notif", b"")
        if not (isinstance(wid, int) and isinstance(off, int) and isinstance(last, bool) and isinstance(n, int)
                and n >= 1 and isinstance(frm, str) and isinstance(notif, bytes)):
            raise ValueError(f"bad header fields {sorted(header)}")
        payload = frames[2].buffer if len(frames) == 3 else memoryview(b"")
        state = self._writes.get((frm, wid))
        if state is None:
            state = self._writes[(frm, wid)] = [0, None]
            while len(self._writes) > _WRITES_KEPT:
                self._writes.popitem(last=False)
        state[0] += 1
        if state[1] is None:
            if header.get("to") != self._agent_name:
                state[1] = f"wrong_peer: addressed to {header.get('to')!r}, this is {self._agent_name!r}"
            elif off < 0 or off + len(payload) > len(self._dst):
                state[1] = f"bad_span: {len(payload)} B at offset {off} outside the {len(self._dst)} B buffer"
            elif len(payload):
                state[1] = self._land(off, payload)
            if state[1] is not None:
                self._refuse(f"write {wid} from {frm!r}: {state[1]}")
        if not last:
            return
        del self._writes[(frm, wid)]
        reason = state[1]
        if reason is None and state[0] != n:
            reason = f"frames_missing: {state[0]} of the write's {n} frames arrived"
            self._refuse(f"write {wid} from {frm!r}: {reason}")
        if reason is None and notif:
            self.inbox.append((frm, notif))
        answer = {"wid": wid, "ok": reason is None}
        if reason is not None:
            answer["reason"] = reason
        try:
            sock.send_multipart([ident, msgpack.packb(answer, use_bin_type=True)], flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("tcp receiver of %r: could not answer write %d from %r (writer backlogged)",
                        self._agent_name, wid, frm)
