"""A worker's counts as they are now, one typed object (:class:`WorkerStats`): its engine's pages,
queues and counters (``engine.EngineStats``), the engine loop's error counts, and its role's own
(``role.stats()``: a prefill or decode worker's lifecycle, peers, threads). Readers take fields by
attribute; an answer that shows some builds its JSON from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from splitserve.engine.engine import EngineStats


@dataclass(frozen=True)
class WorkerStats:
    engine: Optional[EngineStats]  # None until the engine has started
    loop_errors: int = 0
    request_errors: int = 0
    role: Mapping[str, Any] = field(default_factory=dict)  # the role's own, by name (``Role.stats``)

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
        if "queues" in self.role:
            return self.role["queues"]
        e = self.engine
        return {"waiting": e.waiting if e is not None else 0, "running": e.running if e is not None else 0}
