"""A worker's counts as they are now, one typed object (:class:`WorkerStats`): its engine's pages,
queues and counters (``engine.EngineStats``), the engine loop's error counts, and a prefill or
decode role's own (:class:`RoleStats`, from ``role.stats()``: its lifecycle, peers, threads, and
what only a prefill or only a decode worker has). Readers take fields by attribute; an answer that
shows some builds its JSON from them. A mapping field is keyed by what a metric labels (a state, a
peer, a thread, a why)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Union

from splitserve.engine.engine import EngineStats


@dataclass(frozen=True)
class PrefillStats:
    """What only a prefill worker counts."""
    kv_transfer_bytes: int  # KV bytes handed to the transfer for decode workers
    sessions_refused: Mapping[str, int]  # new decode sessions refused, by why


@dataclass(frozen=True)
class DecodeStats:
    """What only a decode worker counts."""
    kv_transfer_bytes: int  # KV bytes prefill wrote into this worker's pages
    pages_quarantined: int
    links_open: int
    links_fenced: int
    kv_fallbacks: Mapping[str, int]  # rooms that recomputed their prompt here, by why
    prompts_computed: int


@dataclass(frozen=True)
class RoleStats:
    """A prefill or decode role's counts (``DisaggRole.stats``); ``own``: its kind's alone."""
    queues: Mapping[str, int]  # live rooms by lifecycle state
    lifecycle: Mapping[str, int]  # bookkeeping that is no live request, by kind
    outcomes: Mapping[str, int]
    notices: Mapping[str, int]
    peers: Mapping[str, int]  # live, lost
    peer_silence: Mapping[str, float]  # seconds, by peer
    action_failures: int
    control_sessions: int
    control_ended: Optional[int]  # None where the control plane keeps no ended sessions (decode)
    bad_frames: Mapping[str, int]  # by why
    transfer_peers: int
    thread_restarts: Mapping[str, int]  # by thread
    thread_age: Mapping[str, float]  # seconds, by thread
    zmq_io_age: Optional[float]  # None where the ZMQ I/O thread is not watched
    own: Union[PrefillStats, DecodeStats, None] = None

    @property
    def prefill(self) -> Optional[PrefillStats]:
        return self.own if isinstance(self.own, PrefillStats) else None

    @property
    def decode(self) -> Optional[DecodeStats]:
        return self.own if isinstance(self.own, DecodeStats) else None


@dataclass(frozen=True)
class WorkerStats:
    engine: Optional[EngineStats]  # None until the engine has started
    loop_errors: int = 0
    request_errors: int = 0
    role: Optional[RoleStats] = None  # None: a colocated worker's role counts nothing of its own

    @property
    def pages_free(self) -> int:
        return self.engine.pages_free if self.engine is not None else 0

    @property
    def pages_total(self) -> int:
        return self.engine.pages_total if self.engine is not None else 0

    @property
    def queues(self) -> dict[str, int]:
        """Requests by queue: a prefill or decode worker's by lifecycle state (its role's), else
        the engine's ``waiting`` and ``running``."""
        if self.role is not None:
            return dict(self.role.queues)
        e = self.engine
        return {"waiting": e.waiting if e is not None else 0, "running": e.running if e is not None else 0}
