"""The simulated network between hosts: links with latency and faults, partitions that heal, and
the control plane's sockets on top (the simulated side of the seams in ``disagg/control/``).

**Links.** Every frame between two hosts goes through :meth:`Network.carry`: it arrives after the
link's latency, in order per connection — unless the seed's faults for that directed link drop
it, duplicate it, delay it (a reordering: frames behind it overtake it) — and not at all while
the two hosts are partitioned (a frame sent into a partition is lost, or held and delivered when
it heals, as a TCP connection would). Partitions may be one-way.

**Control sockets** keep ZMQ's semantics, which the control threads rely on:

- prefill binds a ROUTER (:class:`RouterEndpoint`) at ``host:port``; a frame it sends to an
  identity no connected peer has is dropped, and of two connections with one identity the second
  is refused (libzmq without ``ROUTER_HANDOVER``);
- decode dials one DEALER per session (:class:`Dealer`); while nothing is bound at its address
  its frames wait in the socket (up to ``HWM``) and go to whatever binds there next — a restarted
  prefill, a new incarnation, gets them, as with a real reconnecting DEALER;
- a killed process's sockets vanish without a word (kill -9): peers only see silence.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

HWM = 1000  # frames a DEALER keeps while nothing is bound at its address


@dataclass
class LinkFaults:
    """Faults of frames on one directed link (host to host), from the seed."""

    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0  # a frame delayed by ``reorder_s`` more: later ones overtake it
    reorder_s: float = 0.05
    latency_s: float = 0.0002
    jitter_s: float = 0.0002


@dataclass
class Partition:
    a: str
    b: str
    start: float
    end: float
    one_way: bool = False  # only frames from a to b are cut
    hold: float = 0.5  # chance that a frame sent into it is held and delivered at the heal

    def cuts(self, src: str, dst: str, now: float) -> bool:
        if not self.start <= now < self.end:
            return False
        return (src, dst) == (self.a, self.b) or (not self.one_way and (src, dst) == (self.b, self.a))


class Network:
    def __init__(self, loop, rng: random.Random, trace: Callable[[str], None]):
        self.loop = loop
        self.rng = rng
        self.trace = trace
        self.faults: dict[tuple[str, str], LinkFaults] = {}
        self.default = LinkFaults()
        self.partitions: list[Partition] = []
        self.endpoints: dict[str, "RouterEndpoint"] = {}  # "host:port" -> the ROUTER bound there
        self.dealers: dict[str, list["Dealer"]] = {}  # "host:port" -> DEALERs dialled to it
        self.counts = {"frames": 0, "dropped": 0, "duplicated": 0, "reordered": 0, "partitioned": 0, "held": 0}

    # -- links ----------------------------------------------------------------------------------

    def partitioned(self, src: str, dst: str, now: Optional[float] = None) -> Optional[Partition]:
        now = self.loop.time() if now is None else now
        for part in self.partitions:
            if part.cuts(src, dst, now):
                return part
        return None

    def carry(self, src: str, dst: str, deliver: Callable[[], None], order: Optional[list] = None,
              faulty: bool = True) -> None:
        """Send one frame from host ``src`` to host ``dst``; ``deliver()`` runs when it arrives.
        ``order``: a one-element list holding the time the connection's last frame arrives, so that
        frames of one connection arrive in order (unless reordered)."""
        self.counts["frames"] += 1
        now = self.loop.time()
        f = self.faults.get((src, dst), self.default)
        rng = self.rng
        part = self.partitioned(src, dst, now)
        if part is not None:
            self.counts["partitioned"] += 1
            if rng.random() < part.hold:  # held in the connection, delivered at the heal
                self.counts["held"] += 1
                self.loop.call_at(part.end + f.latency_s + rng.random() * f.jitter_s, deliver)
            return
        if faulty and f.drop and rng.random() < f.drop:
            self.counts["dropped"] += 1
            return
        at = now + f.latency_s + rng.random() * f.jitter_s
        if faulty and f.reorder and rng.random() < f.reorder:
            self.counts["reordered"] += 1
            at += rng.random() * f.reorder_s
        elif order is not None:
            at = order[0] = max(at, order[0])
        self.loop.call_at(at, deliver)
        if faulty and f.duplicate and rng.random() < f.duplicate:
            self.counts["duplicated"] += 1
            self.loop.call_at(at + rng.random() * f.jitter_s, deliver)

    # -- control sockets ------------------------------------------------------------------------

    def bind(self, host: str, port: int, wake: Callable[[], None]) -> "RouterEndpoint":
        address = f"{host}:{port}"
        if address in self.endpoints:
            raise OSError(f"address {address} in use")
        ep = self.endpoints[address] = RouterEndpoint(self, host, address, wake)
        for dealer in self.dealers.get(address, ()):
            dealer.connected(ep)
        return ep

    def dial(self, src_host: str, address: str, ident: bytes, wake: Callable[[], None]) -> "Dealer":
        dealer = Dealer(self, src_host, address, ident, wake)
        self.dealers.setdefault(address, []).append(dealer)
        ep = self.endpoints.get(address)
        if ep is not None:
            dealer.connected(ep)
        return dealer


@dataclass(eq=False)
class RouterEndpoint:
    """What ``PrefillControl`` binds (``ZmqRouterEndpoint``'s surface)."""

    net: Network
    host: str
    address: str
    wake: Callable[[], None]
    inbox: deque = field(default_factory=deque)
    peers: dict = field(default_factory=dict)  # identity -> the Dealer connected with it
    closed: bool = False
    fail_recv: int = 0  # fault injection: the next recv() calls raise (a crashing control thread)

    last_source: Optional[str] = None  # the host the message recv last returned came from

    def recv(self) -> Optional[list[bytes]]:
        if self.fail_recv:
            self.fail_recv -= 1
            raise RuntimeError("simulated control-thread crash (recv raised)")
        if not self.inbox:
            return None
        parts = self.inbox.popleft()
        dealer = self.peers.get(parts[0])
        self.last_source = dealer.host if dealer is not None else None
        return parts

    def send(self, ident: bytes, frame: bytes) -> None:
        dealer = self.peers.get(ident)
        if dealer is None or self.closed:
            return  # no such peer connected: a ROUTER drops it
        self.net.carry(self.host, dealer.host, lambda: dealer.arrive(frame, self), dealer.order_in)

    def arrive(self, ident: bytes, frame: bytes, dealer: "Dealer") -> None:
        if self.closed or self.peers.get(ident) is not dealer:
            return
        self.inbox.append([ident, frame])
        self.wake()

    def close(self, linger_ms: int = 0) -> None:
        """Unbind (a clean close, or the process died): connected DEALERs wait for the next bind.
        ``linger_ms``: ``ZmqRouterEndpoint``'s surface (frames sent before are carried or dropped
        by the simulated network as it is)."""
        if self.closed:
            return
        self.closed = True
        if self.net.endpoints.get(self.address) is self:
            del self.net.endpoints[self.address]
        for dealer in list(self.peers.values()):
            dealer.endpoint = None
        self.peers.clear()


@dataclass(eq=False)
class Dealer:
    """What ``DecodeControl`` dials per session (``ZmqDealer``'s surface)."""

    net: Network
    host: str
    address: str
    ident: bytes
    wake: Callable[[], None]
    inbox: deque = field(default_factory=deque)
    endpoint: Optional[RouterEndpoint] = None
    waiting: deque = field(default_factory=deque)  # sent while not connected
    closed: bool = False
    order_out: list = field(default_factory=lambda: [0.0])
    order_in: list = field(default_factory=lambda: [0.0])
    fail_recv: int = 0

    def connected(self, ep: RouterEndpoint) -> None:
        if self.closed:
            return
        if self.ident in ep.peers and ep.peers[self.ident] is not self:
            self.net.trace(f"router {ep.address} refused a second connection with identity {self.ident!r}")
            return  # libzmq: the identity is taken; this connection is refused
        self.endpoint = ep
        ep.peers[self.ident] = self
        self.order_out, self.order_in = [0.0], [0.0]  # a new TCP connection
        while self.waiting:
            self._carry(self.waiting.popleft())

    @property
    def sock(self):
        return self

    def send(self, frame: bytes) -> None:
        if self.closed:
            return
        if self.endpoint is None or self.endpoint.closed:
            self.endpoint = None
            if len(self.waiting) < HWM:
                self.waiting.append(frame)
            return
        self._carry(frame)

    def _carry(self, frame: bytes) -> None:
        ep = self.endpoint
        self.net.carry(self.host, ep.host, lambda: ep.arrive(self.ident, frame, self), self.order_out)

    def arrive(self, frame: bytes, ep: RouterEndpoint) -> None:
        if self.closed or self.endpoint is not ep:
            return
        self.inbox.append(frame)
        self.wake()

    def recv(self) -> Optional[bytes]:
        if self.fail_recv:
            self.fail_recv -= 1
            raise RuntimeError("simulated control-thread crash (recv raised)")
        return self.inbox.popleft() if self.inbox else None

    def close(self, linger_ms: int = 0) -> None:
        if self.closed:
            return
        self.closed = True
        ep = self.endpoint
        if ep is not None and ep.peers.get(self.ident) is self:
            del ep.peers[self.ident]
        self.endpoint = None
        dealers = self.net.dealers.get(self.address)
        if dealers is not None and self in dealers:
            dealers.remove(self)
            if not dealers:
                del self.net.dealers[self.address]
