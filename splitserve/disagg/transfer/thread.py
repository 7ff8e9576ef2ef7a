"""The transfer thread: the one thread that drives a worker's transfer backend.

The engine loop never touches the backend. It hands commands to this thread (``submit``, a queue
put) and gets events back in its inbox: ``WriteDone`` / ``WriteFailed`` for every write it
started (prefill, the writer: ``backend``), and ``KVNotification`` for every notification that
arrives on a receiving link (decode: ``links``). The thread calls ``notifications()`` every
``BUSY_POLL_S`` while something is due (a write or notification in flight, a room whose pages are
open to a writer); with nothing due it sleeps until a command comes, at most ``IDLE_POLL_S``, so
an idle worker does not take the GIL from the engine thread hundreds of times a second.

Supervised (rule 8): if an iteration raises, or a write polls FAILED with ``may_land`` (its bytes
may still land), its session is declared lost first — so that prefill never tells decode
``WritesSettled`` for it and decode fences it — then every affected write is reported failed and
the loop goes on.

Fault injection (off unless configured, read once at start): ``stall_writes``,
``stall_writes_after=N`` (each room's first N writes land), ``fail_writes``, ``notify_drop=P``
(that fraction of notifications dropped) and ``hang_transfer`` (the thread blocks for good once a
write is in flight).
"""

from __future__ import annotations

import logging
import queue
import random
from dataclasses import dataclass
from typing import Callable, Optional

from splitserve.disagg.lifecycle import Peer, PeerLost, WriteDone, WriteFailed
from splitserve.disagg.supervised import SupervisedThread
from splitserve.disagg.transfer.base import Handle, Span, TransferBackend
from splitserve.disagg.transfer.links import ReceiveLinks

log = logging.getLogger(__name__)

BUSY_POLL_S = 0.002  # while a write, a notification or a room's KV is due: its latency is on TTFT
IDLE_POLL_S = 0.05  # nothing due: a late notification of a room already ended waits this long at most


@dataclass(frozen=True)
class AddPeer:
    peer: Peer
    agent_name: str
    metadata: bytes


@dataclass(frozen=True)
class Write:
    room: int
    write_id: int
    peer: Peer
    spans: tuple[Span, ...]


@dataclass(frozen=True)
class Wake:
    """Nothing to do but look again: something became due that no command brings (a room's pages
    opened to a writer)."""


@dataclass(frozen=True)
class Notify:
    """A notification alone (an empty write): sent only after the room's writes are DONE."""

    peer: Peer
    payload: bytes


@dataclass(frozen=True)
class Cancel:
    write_ids: tuple[int, ...]


@dataclass(frozen=True)
class ResetPeer:
    """Tear down our side of the transfer connection to ``peer``: its pending writes are reported
    failed. Bytes already on the wire may still land (only decode closing its receiving link
    fences them), so the lifecycle never vouches for writes torn down this way. ``forget``: the
    peer is lost, do not reconnect."""

    peer: Peer
    forget: bool = False


@dataclass(frozen=True)
class KVNotification:
    """A notification that arrived on the receiving link of ``peer`` (decode side), sent by the
    transfer agent ``agent_name``."""

    peer: Peer
    agent_name: str
    payload: bytes


@dataclass(frozen=True)
class FaultConfig:
    stall_writes: bool = False
    stall_writes_after: int = 0
    fail_writes: bool = False
    notify_drop: float = 0.0
    hang: bool = False
    seed: int = 0


@dataclass
class _InFlight:
    room: int
    write_id: int
    peer: Peer
    handle: Optional[Handle]  # None: stalled by fault injection, never handed to the backend


class TransferWorker(SupervisedThread):
    def __init__(self, backend: Optional[TransferBackend], post: Callable[[object], None],
                 faults: Optional[FaultConfig] = None, links: Optional[ReceiveLinks] = None):
        super().__init__(name="transfer")
        self.backend = backend  # writes (prefill)
        self.links = links  # receives (decode)
        self._post = post
        self._faults = faults or FaultConfig()
        self._rng = random.Random(self._faults.seed)
        self._commands: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self._agents: dict[Peer, tuple[str, bytes]] = {}  # peer -> (agent name, metadata)
        self._inflight: dict[int, _InFlight] = {}
        self._notifies: list[tuple[Peer, Handle]] = []
        self._writes_of: dict[int, int] = {}  # room -> writes started (stall_writes_after only)

    def submit(self, command: object) -> None:
        """Thread-safe: queue a command for the transfer thread."""
        self._commands.put(command)

    def wake(self) -> None:
        """Thread-safe: poll at once and keep polling while something is due (``serve()``)."""
        self._commands.put(Wake())

    def peer_count(self) -> int:
        """Peers with a transfer connection now (prefill: a NIXL remote agent each); any thread."""
        return len(self._agents)

    def peers(self) -> tuple[Peer, ...]:
        """The peers with a transfer connection now, for checks of what the thread keeps (transfer thread only)."""
        return tuple(self._agents)

    # -- the thread ---------------------------------------------------------------------------

    def serve(self) -> None:
        while not self.stopping.is_set():
            if not self.step():  # sleep until a command comes, or the receiving side is due for progress
                try:
                    self._run(self._commands.get(timeout=BUSY_POLL_S if self.due() else IDLE_POLL_S))
                except queue.Empty:
                    pass

    def due(self) -> bool:
        """Something will come only if the thread polls for it: a write or a notification handed to
        the backend, or (decode) a room whose KV may be written now."""
        return (any(w.handle is not None for w in self._inflight.values()) or bool(self._notifies)
                or (self.links is not None and self.links.expecting()))

    def step(self) -> bool:
        """One iteration: the commands queued, the writes polled, the notifications received.
        True if it did anything (``serve()`` sleeps otherwise; a simulator calls this itself)."""
        self.beat()
        if self._faults.hang:
            self._hang_if_busy()
        busy = self._run_commands()
        busy |= self._poll_writes()
        for peer, agent, payload in self.links.notifications() if self.links is not None else ():
            self._post(KVNotification(peer, agent, payload))
            busy = True
        return busy

    def _hang_if_busy(self) -> None:
        """Fault injection (``hang_transfer``): once a write is in flight, block for good, as a
        backend call that never returns would."""
        if self._inflight:
            log.error("injected fault: the transfer thread hangs now (until shutdown)")
            self.stopping.wait()

    def on_crash(self, exc: BaseException) -> None:
        """Every write in flight is reported failed, but what became of its bytes is unknown: their
        sessions are declared lost first, so that prefill never vouches for them (decode fences)."""
        for peer in sorted({w.peer for w in self._inflight.values() if w.handle is not None}):
            self._post(PeerLost(peer, f"transfer thread error with writes in flight: {exc}"))
        for w in list(self._inflight.values()):
            self._settle(w, WriteFailed(w.room, w.write_id, f"transfer thread error: {exc}"))

    def _run_commands(self) -> bool:
        busy = False
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return busy
            busy = busy or not isinstance(cmd, Wake)  # a wake-up alone did nothing: step() says so
            self._run(cmd)

    def _run(self, cmd: object) -> None:
        if isinstance(cmd, AddPeer):
            self._add(cmd)
        elif isinstance(cmd, Write):
            self._start(cmd)
        elif isinstance(cmd, Notify):
            agent = self._agents.get(cmd.peer)
            if agent is None:
                log.warning("notification for %s dropped: no transfer connection to it", cmd.peer)
                return
            if self._faults.notify_drop and self._rng.random() < self._faults.notify_drop:
                log.warning("injected fault: notification to %s dropped", cmd.peer)
                return
            self._notifies.append((cmd.peer, self.backend.write(agent[0], [], cmd.payload)))
        elif isinstance(cmd, Cancel):
            # A write handed to the backend may still land after a release (NIXL does not recall
            # bytes on the wire), so it is left to settle, or to a ResetPeer; a stalled write was
            # never handed over and settles now.
            for wid in cmd.write_ids:
                w = self._inflight.get(wid)
                if w is not None and w.handle is None:
                    self._settle(w, WriteFailed(w.room, w.write_id, "cancelled while stalled"))
        elif isinstance(cmd, ResetPeer):
            self._reset(cmd.peer, cmd.forget)
        elif isinstance(cmd, Wake):
            pass
        else:
            raise TypeError(f"unknown transfer command {cmd!r}")

    def _add(self, cmd: AddPeer) -> None:
        """Connect to a decode session's receiving link. If that fails (its metadata names no
        interface we can reach, say), the session is useless: the engine declares it lost, which
        fails its rooms and makes decode open a new session (it is refused with peer_lost)."""
        try:
            self.backend.add_peer(cmd.agent_name, cmd.metadata)
        except Exception as exc:
            log.error("cannot connect to the transfer link %s of %s: %s", cmd.agent_name, cmd.peer, exc)
            self._post(PeerLost(cmd.peer, f"its transfer link {cmd.agent_name} cannot be reached: {exc}"))
            return
        self._agents[cmd.peer] = (cmd.agent_name, cmd.metadata)

    def _start(self, cmd: Write) -> None:
        agent = self._agents.get(cmd.peer)
        if agent is None or self.backend is None:
            self._post(WriteFailed(cmd.room, cmd.write_id, f"no transfer connection to {cmd.peer}"))
            # a session whose link never registered (or was dropped) is useless: ending it makes
            # decode open a new one (a no-op for a session declared lost already)
            self._post(PeerLost(cmd.peer, "no transfer link registered for this session"))
            return
        if self._faults.fail_writes:
            self._post(WriteFailed(cmd.room, cmd.write_id, "injected transfer failure"))
            return
        if self._faults.stall_writes_after:
            seen = self._writes_of[cmd.room] = self._writes_of.get(cmd.room, 0) + 1
            if len(self._writes_of) > 4096:  # fault injection only: kept small
                self._writes_of.pop(next(iter(self._writes_of)))
        if self._faults.stall_writes or (self._faults.stall_writes_after and seen > self._faults.stall_writes_after):
            self._inflight[cmd.write_id] = _InFlight(cmd.room, cmd.write_id, cmd.peer, None)
            return
        try:
            handle = self.backend.write(agent[0], list(cmd.spans), b"")
        except Exception as exc:
            # Not yet in flight, so on_crash would not settle it and its room would hold its pages
            # for good. Whether any of its bytes went out is unknown: the session goes first, as
            # on_crash does for the writes in flight (decode fences before prefill vouches).
            self._post(PeerLost(cmd.peer, f"a write to it raised: {exc}"))
            self._post(WriteFailed(cmd.room, cmd.write_id, f"transfer backend error: {exc}"))
            raise
        self._inflight[cmd.write_id] = _InFlight(cmd.room, cmd.write_id, cmd.peer, handle)

    def _poll_writes(self) -> bool:
        busy = False
        for w in list(self._inflight.values()):
            if w.handle is None:
                continue
            state = self.backend.poll(w.handle)
            if state.done:
                self._settle(w, WriteDone(w.room, w.write_id))
                busy = True
            elif state.failed:
                if state.may_land:  # only decode's fence settles it: the session must end first
                    self._post(PeerLost(w.peer, f"a failed write to it may still land ({state.reason})"))
                self._settle(w, WriteFailed(w.room, w.write_id, state.reason))
                busy = True
        for peer, handle in list(self._notifies):
            state = self.backend.poll(handle)
            if not state.pending:
                if state.failed:
                    log.warning("notification to %s failed: %s", peer, state.reason)
                self.backend.release(handle)
                self._notifies.remove((peer, handle))
        return busy

    def _settle(self, w: _InFlight, event: object) -> None:
        self._inflight.pop(w.write_id, None)
        if w.handle is not None:
            self.backend.release(w.handle)
        self._post(event)

    def _reset(self, peer: Peer, forget: bool) -> None:
        agent = self._agents.get(peer)
        for w in [w for w in self._inflight.values() if w.peer == peer]:
            self._settle(w, WriteFailed(w.room, w.write_id, f"transfer connection to {peer} reset"))
        if agent is None:
            return
        self.backend.remove_peer(agent[0])
        if forget:
            del self._agents[peer]
        else:
            self.backend.add_peer(*agent)
