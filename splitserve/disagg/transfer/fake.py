"""In-process transfer backend for unit tests: no network, deterministic, with failure hooks.

Agents live in a process-global registry by name (``_AGENTS``), so "the network" is a dict lookup.
A write does nothing until it is polled: after ``polls_to_complete`` polls (default 1) it copies
its spans straight into the target agent's buffer, queues the notification there and is DONE.
A target that has closed meanwhile makes it FAILED(peer_lost).

Hooks let lifecycle tests strike mid-transfer: ``stall_next(n)`` / ``fail_next(reason, n)`` (the
next n writes never complete / are refused), ``stall(handle)`` / ``fail(handle, reason)`` (cut in
flight: its bytes may still land) / ``complete(handle)``, and ``land(handle)`` (a late write landing
after the writer gave up: what quarantine guards against).

With ``network=`` (the simulator's, ``splitserve/sim/transfer.py``) the agents live in that
network's registry and a write is handed to it (``network.start``): the network lands it when it
decides and sets the handle's state, and ``poll`` asks it. A released or failed write may still be
landed later — until its target is ``closed`` (``close``, or ``die`` with its process): the fence.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .base import DONE, Handle, Span, TransferBackend, TransferState, encode_metadata, failed, refused

_AGENTS: dict[str, "FakeBackend"] = {}
_AGENTS_LOCK = threading.Lock()


@dataclass(eq=False)
class FakeHandle(Handle):
    spans: tuple[Span, ...] = ()
    notif: bytes = b""
    polls_left: int = 1
    stalled: bool = False
    fail_reason: str = ""
    landed: bool = False


@dataclass
class _Hooks:
    stall: int = 0
    fail: list[str] = field(default_factory=list)


class FakeBackend(TransferBackend):
    name = "fake"

    def __init__(self, agent_name: str, buffer: torch.Tensor, *, polls_to_complete: int = 1, network: Any = None,
                 **opts: Any):
        super().__init__(agent_name, buffer)
        if buffer.device.type != "cpu":
            raise ValueError("the fake backend moves CPU memory only")
        self.polls_to_complete = max(1, polls_to_complete)
        self._bytes = buffer.view(-1).view(torch.uint8)  # [nbytes]
        self._peers: dict[str, bytes] = {}
        self._peer_nbytes: dict[str, int] = {}
        self._inbox: collections.deque[tuple[str, bytes]] = collections.deque()
        self._live: dict[int, FakeHandle] = {}
        self._hooks = _Hooks()
        self._closed = False
        self._network = network
        self._agents = network.agents if network is not None else _AGENTS
        with _AGENTS_LOCK:
            if agent_name in self._agents:
                raise ValueError(f"fake agent {agent_name!r} exists already")
            self._agents[agent_name] = self

    def metadata(self) -> bytes:
        return encode_metadata(self.name, self.agent_name, self.nbytes)

    def add_peer(self, peer_name: str, metadata: bytes) -> None:
        md = self._check_new_peer(peer_name, metadata, self._peers.get(peer_name))
        if md is None:
            return
        self._peers[peer_name] = metadata
        self._peer_nbytes[peer_name] = md["nbytes"]

    def remove_peer(self, peer_name: str) -> None:
        if self._peers.pop(peer_name, None) is None:
            return
        del self._peer_nbytes[peer_name]
        for h in list(self._live.values()):
            if h.peer == peer_name and h.state.pending:
                h.state = failed("peer_removed")

    def write(self, peer_name: str, spans: Sequence[Span], notif: bytes) -> FakeHandle:
        spans = tuple(spans)
        h = FakeHandle(peer_name, sum(s.nbytes for s in spans), len(spans), spans=spans, notif=bytes(notif),
                       polls_left=self.polls_to_complete)
        if (reason := self._refusal(peer_name, spans, self._peer_nbytes.get(peer_name))) is not None:
            h.state = refused(reason)
        elif self._hooks.stall:
            self._hooks.stall -= 1
            h.stalled = True
        elif self._hooks.fail:
            h.fail_reason = self._hooks.fail.pop(0)
        elif self._network is not None:
            self._network.start(self, h)
        self._live[h.id] = h
        return h

    def poll(self, handle: Handle) -> TransferState:
        self._check_handle(handle, FakeHandle)
        if not handle.state.pending or handle.stalled or handle.released:
            return handle.state
        if self._network is not None and not handle.fail_reason:
            return self._network.poll(self, handle)  # the network settles it
        handle.polls_left -= 1
        if handle.polls_left > 0:
            return handle.state
        if handle.fail_reason:
            handle.state = refused(handle.fail_reason)  # fail_next: nothing was delivered
        else:
            handle.state = self._deliver(handle)
        return handle.state

    def release(self, handle: Handle) -> None:
        self._check_handle(handle, FakeHandle)
        if handle.state.pending:
            handle.state = failed("released")
        handle.released = True
        self._live.pop(handle.id, None)

    def notifications(self) -> list[tuple[str, bytes]]:
        out = []
        while self._inbox:
            out.append(self._inbox.popleft())
        return out

    @property
    def closed(self) -> bool:
        """Whether this backend is closed: nothing lands in it any more (the fence)."""
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for h in list(self._live.values()):
            self.release(h)
        self._peers.clear()
        with _AGENTS_LOCK:
            if self._agents.get(self.agent_name) is self:
                del self._agents[self.agent_name]

    # -- hooks -------------------------------------------------------------------------------

    def stall_next(self, n: int = 1) -> None:
        """The next ``n`` writes stay PENDING forever (until failed, completed or released)."""
        self._hooks.stall += n

    def fail_next(self, reason: str = "transfer_error", n: int = 1) -> None:
        """The next ``n`` writes poll FAILED(reason) and deliver nothing."""
        self._hooks.fail.extend([reason] * n)

    def stall(self, handle: FakeHandle) -> None:
        handle.stalled = True

    def fail(self, handle: FakeHandle, reason: str = "transfer_error") -> None:
        """A write cut in flight: FAILED, and its bytes may still land (``land``)."""
        if handle.state.pending:
            handle.state = failed(reason)

    def complete(self, handle: FakeHandle) -> TransferState:
        """Deliver a pending write now (stalled or not) and make it DONE."""
        if handle.state.pending:
            handle.state = self._deliver(handle)
        return handle.state

    def land(self, handle: FakeHandle) -> None:
        """Copy a write's bytes and notification into the target whatever its state (a late write)."""
        self._deliver(handle)

    def queue_notification(self, sender: str, notif: bytes) -> None:
        """Queue ``notif`` from agent ``sender`` for :meth:`notifications`: a network's landed write."""
        self._inbox.append((sender, notif))

    def die(self) -> None:
        """Closed as its process died: nothing lands any more, and unlike :meth:`close` nothing is
        released or unregistered (whoever models the death does that)."""
        self._closed = True

    # -- internals ----------------------------------------------------------------------------

    def _deliver(self, h: FakeHandle) -> TransferState:
        with _AGENTS_LOCK:
            target = self._agents.get(h.peer)
        if target is None or target._closed:
            return refused("peer_lost")
        return target._receive(self.agent_name, self._bytes, h)

    def _receive(self, sender: str, src: torch.Tensor, h: FakeHandle) -> TransferState:
        for s in h.spans:  # the receiver checks bounds too: it never trusts the writer's view
            if s.remote_offset + s.nbytes > self.nbytes:
                return refused(f"bad_span: {s} refused by {self.agent_name!r}")
        for s in h.spans:
            self._bytes[s.remote_offset : s.remote_offset + s.nbytes].copy_(
                src[s.local_offset : s.local_offset + s.nbytes]
            )
        h.landed = True
        if h.notif:
            self._inbox.append((sender, h.notif))
        return DONE
