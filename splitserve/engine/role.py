"""The role interface: what a worker does with its requests, called by the engine loop
(``async_engine.py``) at fixed points of each iteration. ``colocated.py`` is the engine alone; the
disaggregated roles are ``disagg/prefill_role.py`` and ``disagg/decode_role.py``."""

from __future__ import annotations

from typing import Callable, Optional, Protocol

from splitserve.engine.engine import LLMEngine, StepReport
from splitserve.engine.io import GenerateRequest, RequestOutput
from splitserve.engine.worker_stats import RoleStats
from splitserve.outcomes import Ending

IDLE_WAIT_S = 0.5  # the longest the loop waits for an event when nothing is due


class EngineLoop(Protocol):
    """What a role is given when it starts: the engine loop that runs it (``AsyncEngine``)."""

    engine: LLMEngine
    loop_stall_s: float
    clock: Callable[[], float]
    """The only clock the loop reads (monotonic seconds); ``tick`` is given its ``now``."""

    def poster(self) -> Callable[[object], None]:
        """What the role's threads post events to the loop with (thread-safe)."""
        ...

    def loop_stalled(self) -> bool:
        """Whether the loop has made no iteration within ``loop_stall_s``."""
        ...


class Role(Protocol):
    """What a worker does with its requests; the engine loop calls it at fixed points (the
    docstring of ``async_engine.py``). Every method runs on the engine loop, except ``check`` (the
    HTTP thread, at submission), ``stats`` and ``debug_rows`` (any thread: they only read)."""

    name: str

    def start(self, loop: EngineLoop) -> None: ...
    def check(self, req: GenerateRequest) -> None: ...
    def admit(self, req: GenerateRequest) -> list[RequestOutput]: ...
    def abort(self, rid: str, ending: Ending) -> list[RequestOutput]: ...
    def abort_request(self, rid: Optional[str], room: Optional[int], kv_lost: bool,
                      detail: str) -> tuple[bool, list[RequestOutput]]: ...
    def on_event(self, event: object) -> list[RequestOutput]: ...
    def tick(self, now: float) -> list[RequestOutput]: ...
    def after_step(self, report: StepReport) -> list[RequestOutput]: ...
    def fail_all(self, ending: Ending) -> list[RequestOutput]: ...
    def fail_request(self, rid: str, ending: Ending) -> list[RequestOutput]: ...
    def wait_s(self, now: float) -> float: ...
    def stats(self) -> Optional[RoleStats]: ...
    def debug_rows(self, now: float) -> list[dict]: ...
    def close(self, goodbye: Optional[str] = None) -> None: ...
