"""The simulated transfer network: where the fake backend's writes travel (``transfer/fake.py``
with ``network=``), and how they go wrong.

A write (``FakeBackend.write`` on a prefill, to a decode's receiving link) takes a copy of its
source bytes at once (the NIC has read them) and is then, by the seed: **landed** after a delay
(bytes into the target pool, notification queued; DONE one ack later); **refused** (FAILED,
nothing landed); **cut in flight** (FAILED with ``may_land``: its bytes may land later);
**stalled** (PENDING; if its writer gives up, its bytes may still land at any later moment); held
by a **partition** until it heals, then landed; or landed with its **notification lost**.

Whatever its writer did meanwhile, a write lands only while its target link is open: closing
the link (``FakeBackend.close``: decode's fence, or the process dying) is the only thing that
stops a late write. Before every landing the simulator checks that each page it touches belongs
to the room whose KV it carries (``invariants.py``), and that no page is handed to a new room
while a write that may still land targets it (:meth:`TransferNet.landable_into`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from splitserve.disagg.transfer.base import DONE, TransferState, failed, refused
from splitserve.disagg.transfer.fake import FakeBackend, FakeHandle


@dataclass
class TransferFaults:
    """Per write (chances), from the seed."""

    refuse: float = 0.0
    cut: float = 0.0  # FAILED in flight, may land later
    stall: float = 0.0
    late: float = 0.5  # a write its writer gave up on, or a cut one, still lands (if not fenced)
    notify_drop: float = 0.0
    delay_s: float = 0.0005
    per_byte_s: float = 2e-9
    crash: float = 0.0  # a backend call raises: the transfer thread crashes (and restarts)


@dataclass(eq=False)
class Flight:
    """One write on the wire."""

    handle: FakeHandle
    writer: object  # the SimWorker that wrote it
    writer_agent: str
    target: str  # agent name
    data: list[bytes]  # the source bytes of each span, read at write time
    first_key: Optional[float]  # the key of its first slot (model.chain), for the trace
    landed: bool = False
    gone: bool = False  # landed, or can never land any more


def _pool_bytes(agent: FakeBackend) -> torch.Tensor:
    """The agent's whole pool as bytes: a view (writing into it writes the pool)."""
    return agent.buffer.view(-1).view(torch.uint8)


class TransferNet:
    def __init__(self, loop, rng: random.Random, network, trace: Callable[[str], None]):
        self.loop = loop
        self.rng = rng
        self.network = network  # hosts and partitions
        self.trace = trace
        self.agents: dict[str, FakeBackend] = {}
        self.owner: dict[str, object] = {}  # agent name -> SimWorker
        self.faults = TransferFaults()
        self.flights: dict[int, Flight] = {}  # handle id -> in flight (not gone)
        self.on_land: Optional[Callable[[Flight, object], None]] = None  # the invariants' check
        self.counts = {"writes": 0, "landed": 0, "refused": 0, "cut": 0, "stalled": 0, "late": 0,
                       "notify_dropped": 0, "fenced": 0, "crashes": 0}

    def view(self, worker) -> "NetView":
        return NetView(self, worker)

    # -- from the writer ----------------------------------------------------------------------

    def start(self, worker, sender: FakeBackend, h: FakeHandle) -> None:
        f, rng = self.faults, self.rng
        if f.crash and rng.random() < f.crash:
            self.counts["crashes"] += 1
            raise RuntimeError("simulated transfer backend error (write raised)")
        self.counts["writes"] += 1
        src = _pool_bytes(sender)
        data = [bytes(src[s.local_offset:s.local_offset + s.nbytes].numpy()) for s in h.spans]
        tag = None
        if h.spans:
            first = h.spans[0].local_offset // 8  # slot 0 of the first page: its key, the room tag
            tag = float(sender.buffer.view(-1)[first].item())
        flight = Flight(h, worker, sender.agent_name, h.peer, data, tag)
        self.flights[h.id] = flight
        now = self.loop.time()
        delay = f.delay_s * (1 + rng.random()) + f.per_byte_s * h.nbytes
        roll = rng.random()
        if roll < f.refuse:
            self.counts["refused"] += 1
            self._settle(flight, refused("simulated: refused before posting"), now + delay)
            flight.gone = True
            self.flights.pop(h.id, None)
        elif roll < f.refuse + f.cut:
            self.counts["cut"] += 1
            self._settle(flight, failed("simulated: connection cut in flight"), now + delay)
            if rng.random() < f.late:
                self._land_at(flight, now + delay + rng.random() * 10.0)
            else:
                self._gone_at(flight, now + delay)
        elif roll < f.refuse + f.cut + f.stall:
            self.counts["stalled"] += 1
            if rng.random() < f.late:
                self._land_at(flight, now + rng.random() * 30.0)  # maybe after the writer gave up
        else:
            self._land_at(flight, now + delay, ack=True)

    def poll(self, backend: FakeBackend, h: FakeHandle) -> TransferState:
        f = self.faults
        if f.crash and self.rng.random() < f.crash / 4:
            self.counts["crashes"] += 1
            raise RuntimeError("simulated transfer backend error (poll raised)")
        return h.state

    # -- on the wire --------------------------------------------------------------------------

    def _settle(self, flight: Flight, state: TransferState, at: float) -> None:
        def settle() -> None:
            h = flight.handle
            if h.state.pending and not h.released:
                h.state = state
                flight.writer.wake_transfer()
        self.loop.call_at(at, settle)

    def _gone_at(self, flight: Flight, at: float) -> None:
        def gone() -> None:
            flight.gone = True
            self.flights.pop(flight.handle.id, None)
        self.loop.call_at(at, gone)

    def _land_at(self, flight: Flight, at: float, ack: bool = False) -> None:
        self.loop.call_at(at, lambda: self._land(flight, ack))

    def _land(self, flight: Flight, ack: bool) -> None:
        if flight.gone:
            return
        h = flight.handle
        src_host = flight.writer.host
        target = self.agents.get(flight.target)
        if target is None or target.closed:  # fenced (or never there): nothing lands
            flight.gone = True
            self.flights.pop(h.id, None)
            if ack:
                self._settle(flight, refused("simulated: peer_lost"), self.loop.time())
            return
        tworker = self.owner.get(target.agent_name)
        part = self.network.partitioned(src_host, tworker.host) if tworker is not None else None
        if part is not None:  # held on the wire until the partition heals
            self._land_at(flight, part.end + self.rng.random() * 0.01, ack)
            return
        late = not h.state.pending or h.released
        if late:
            self.counts["late"] += 1
        if self.on_land is not None and tworker is not None:
            self.on_land(flight, tworker)
        dst = _pool_bytes(target)
        for span, data in zip(h.spans, flight.data):
            dst[span.remote_offset:span.remote_offset + span.nbytes].numpy()[:] = np.frombuffer(data, np.uint8)
        flight.landed = flight.gone = True
        self.flights.pop(h.id, None)
        self.counts["landed"] += 1
        if h.notif:
            if self.faults.notify_drop and self.rng.random() < self.faults.notify_drop:
                self.counts["notify_dropped"] += 1
            else:
                target.queue_notification(flight.writer_agent, h.notif)
                if tworker is not None:
                    tworker.wake_transfer()
        if ack:
            self._settle(flight, DONE, self.loop.time() + self.faults.delay_s * self.rng.random())

    # -- what the invariants ask --------------------------------------------------------------

    def landable_into(self, worker) -> list[Flight]:
        """Writes that may still land in ``worker``'s pool: on the wire, target link open."""
        out = []
        for flight in self.flights.values():
            target = self.agents.get(flight.target)
            if not flight.gone and target is not None and not target.closed and self.owner.get(flight.target) is worker:
                out.append(flight)
        return out

    def kill(self, worker) -> None:
        """``worker``'s process died: its links are gone (nothing lands there any more); what it
        wrote may still be on the wire."""
        for name, agent in list(self.agents.items()):
            if self.owner.get(name) is worker:
                agent.die()
                del self.agents[name]


class NetView:
    """What one worker's fake backends see as ``network`` (``transfer/fake.py``)."""

    def __init__(self, net: TransferNet, worker):
        self.net = net
        self.worker = worker
        self.agents = _Registry(net, worker)
        self.fail_next = 0  # fault injection: the next calls raise (a crashing transfer thread)

    def _maybe_fail(self) -> None:
        if self.fail_next:
            self.fail_next -= 1
            self.net.counts["crashes"] += 1
            raise RuntimeError("simulated transfer backend error")

    def start(self, sender: FakeBackend, h: FakeHandle) -> None:
        self._maybe_fail()
        self.net.start(self.worker, sender, h)

    def poll(self, sender: FakeBackend, h: FakeHandle) -> TransferState:
        self._maybe_fail()
        return self.net.poll(sender, h)


class _Registry(dict):
    """The network's agent registry, as one worker's backends register into it."""

    def __init__(self, net: TransferNet, worker):
        super().__init__()
        self.net, self.worker = net, worker

    def __contains__(self, name) -> bool:
        return name in self.net.agents

    def get(self, name, default=None):
        return self.net.agents.get(name, default)

    def __setitem__(self, name, agent) -> None:
        self.net.agents[name] = agent
        self.net.owner[name] = self.worker

    def __delitem__(self, name) -> None:
        del self.net.agents[name]
        self.net.counts["fenced"] += 1

