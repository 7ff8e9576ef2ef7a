"""A prefill worker played by the test: it speaks the real control protocol on a real ZMQ socket
and writes with the real ``tcp`` transfer backend, but answers each registration the way the test
says — so a real decode worker can be shown what a faulty or hostile prefill sends.

    with FakePrefill(info_like(decode_info)) as fake:
        fake.on_register = lambda fake, peer, msg: fake.kv_done(peer, msg, first_token=-1)
        ... requests to the decode worker with bootstrap_host/port = fake.host/fake.port ...

It answers ``GetInfo`` (with ``info``, under its own incarnation), ``RegisterPeer`` (connects a
tcp writer to the link and answers ``PeerRegistered``), and heartbeats both ways (``HeartbeatAck``
to each ``Heartbeat``, a ``Heartbeat`` to every registered session each ``heartbeat_s``).
``RegisterRoom`` goes to ``on_register`` (default: held, never answered); ``AbortRoom`` is
answered ``WritesSettled`` (nothing was written); every message it receives is kept in
``received``. One thread owns the socket and the writer; ``kv_done`` and
``send`` may be called from ``on_register`` (that thread) or from the test (queued to it).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import uuid
from typing import Callable, Optional

import torch
import zmq

from splitserve.disagg import protocol as p
from splitserve.disagg.control import identity, peer_of
from splitserve.disagg.lifecycle import Peer
from splitserve.disagg.transfer.base import create_backend


class FakePrefill:
    def __init__(self, info: p.Info, heartbeat_s: float = 0.2, host: str = "127.0.0.1"):
        self.incarnation = uuid.uuid4().hex[:16]
        self.info = dataclasses.replace(info, incarnation=self.incarnation, backend="tcp")
        self.heartbeat_s = heartbeat_s
        self.on_register: Callable[["FakePrefill", Peer, p.RegisterRoom], None] = lambda fake, peer, msg: None
        self.received: list[tuple[Peer, object]] = []
        self.registered: set[Peer] = set()
        self._agents: dict[Peer, str] = {}
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.host = host  # any 127.x address is this host's loopback
        self.port = self._sock.bind_to_random_port(f"tcp://{self.host}")
        self._writer = create_backend("tcp", f"fake-prefill-{self.incarnation}", torch.zeros(4096, dtype=torch.uint8),
                                      host=self.host)
        self._todo: "queue.Queue[Callable[[], None]]" = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-prefill", daemon=True)

    # -- what a test calls ---------------------------------------------------------------------

    def kv_done(self, peer: Peer, reg: p.RegisterRoom, first_token: int, num_tokens: Optional[int] = None) -> None:
        """Send ``KVDone`` for ``reg``'s room as the transfer notification (no KV bytes)."""
        msg = p.KVDone(reg.room, self.incarnation, first_token, reg.prompt_len if num_tokens is None else num_tokens)
        self._on_thread(lambda: self._writer.write(self._agents[peer], [], p.encode(msg)))

    def send(self, peer: Peer, msg) -> None:
        self._on_thread(lambda: self._sock.send_multipart([identity(peer), p.encode(msg)]))

    def messages(self, cls) -> list:
        return [m for _, m in list(self.received) if isinstance(m, cls)]

    # -- the thread ----------------------------------------------------------------------------

    def _on_thread(self, fn: Callable[[], None]) -> None:
        if threading.current_thread() is self._thread:
            fn()
        else:
            self._todo.put(fn)

    def _run(self) -> None:
        next_hb = 0.0
        while not self._stop.is_set():
            if self._sock.poll(5):
                while True:
                    try:
                        ident, frame = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(peer_of(ident), p.decode(frame))
            while not self._todo.empty():
                self._todo.get()()
            if time.monotonic() >= next_hb:
                next_hb = time.monotonic() + self.heartbeat_s
                for peer in self.registered:
                    self._sock.send_multipart([identity(peer), p.encode(p.Heartbeat(self.incarnation, 1))])

    def _handle(self, peer: Peer, msg) -> None:
        self.received.append((peer, msg))
        if isinstance(msg, p.GetInfo):
            self.send(peer, self.info)
        elif isinstance(msg, p.Heartbeat):
            self.send(peer, p.HeartbeatAck(self.incarnation, msg.seq))
        elif isinstance(msg, p.RegisterPeer):
            if peer not in self._agents:
                self._writer.add_peer(msg.agent_name, msg.agent_metadata)
                self._agents[peer] = msg.agent_name
            self.registered.add(peer)
            self.send(peer, p.PeerRegistered(self.incarnation, msg.agent_name))
        elif isinstance(msg, p.RegisterRoom):
            self.on_register(self, peer, msg)
        elif isinstance(msg, p.AbortRoom):
            self.send(peer, p.WritesSettled(msg.room, self.incarnation))

    def __enter__(self) -> "FakePrefill":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)
        self._writer.close()
        self._sock.close(0)
        self._ctx.term()


def decode_info(decode_worker) -> p.Info:
    """The bootstrap info a compatible prefill of ``decode_worker`` (a ServerProcess of the tiny
    model over tcp) would send: asked from the worker's own code, for its own model."""
    import requests

    from splitserve.disagg.bootstrap import local_info
    from splitserve.engine.kv_pool import KVLayout
    from splitserve.models.loader import load_model

    info = requests.get(decode_worker.url + "/get_server_info", timeout=10).json()
    _, spec = load_model(info["model_path"], dtype="float32")
    layout = KVLayout(num_pages=1, num_layers=spec.num_layers, page_size=info["page_size"],
                      num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dtype=spec.dtype)
    return local_info(spec, layout, "tcp", "unset")
