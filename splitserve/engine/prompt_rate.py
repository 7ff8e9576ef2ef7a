"""Whether a worker can compute a request's prompt within the time its sender gives it.

The engine loop notes, after each step, the prompt tokens the step computed and how long it took
(:meth:`PromptRate.note`, on the loop's own clock). Steps are summed into windows of at least
``WINDOW_S`` of computing and ``WINDOW_TOKENS`` tokens; the pace of a window is its tokens over
its seconds, and the estimate uses the **fastest** of the last ``KEEP`` windows measured within
``FORGET_S``: a worker refuses only work that its best recent pace could not finish, so a busy
moment (a slow step, a loaded machine, its first warm-up steps) never makes it refuse work it
could still do. A worker with no such window (fresh, or idle for ``FORGET_S``) refuses nothing:
so a pace can never keep refusing work that, refused, measures nothing new.

:func:`refuse_if_late` is the check at submission (the asyncio thread): the prompt tokens the
scheduler holds uncomputed (``Scheduler.prompt_backlog``, each request's in arrival order)
plus this request's, at that pace, against its deadline (``GenerateRequest.deadline_s``, the
router's remaining time). Too late: 503 ``overloaded`` at once, which a router takes as "try
another worker" (``router/retry.py``), instead of a request queued to miss its deadline here.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

from splitserve.errors import EngineError
from splitserve.outcomes import Reason

WINDOW_S = 0.25
WINDOW_TOKENS = 256
KEEP = 32
FORGET_S = 120.0


class TooLate(EngineError):
    """This worker cannot compute the request's prompt within the deadline it came with (503)."""

    reason = Reason.OVERLOADED


class PromptRate:
    """The engine's recent pace at computing prompt tokens (engine loop writes, any thread reads)."""

    def __init__(self) -> None:
        self._tokens = 0
        self._seconds = 0.0
        self._paces: deque[tuple[float, float]] = deque(maxlen=KEEP)  # (when measured, tokens per second)

    def note(self, tokens: int, seconds: float, now: float) -> None:
        """A step that ended at ``now`` computed ``tokens`` prompt tokens in ``seconds`` (steps
        without any are not a pace)."""
        if tokens <= 0 or not seconds > 0:
            return
        self._tokens += tokens
        self._seconds += seconds
        if self._seconds >= WINDOW_S and self._tokens >= WINDOW_TOKENS:
            self._paces.append((now, self._tokens / self._seconds))
            self._tokens, self._seconds = 0, 0.0

    def best(self, now: float) -> Optional[float]:
        """Prompt tokens per second of the fastest window measured within ``FORGET_S`` of ``now``
        (any thread: it reads a copy); None: none."""
        paces = [pace for when, pace in list(self._paces) if when >= now - FORGET_S]
        return max(paces) if paces else None

    def seconds_for(self, tokens: int, now: float) -> Optional[float]:
        """How long ``tokens`` prompt tokens take at the best recent pace; None: not measured."""
        best = self.best(now)
        return None if best is None else tokens / best


def refuse_if_late(rate: PromptRate, backlog: int, prompt_tokens: int, deadline_s: Optional[float],
                   now: float) -> None:
    """Raise :class:`TooLate` when ``backlog`` queued prompt tokens and this request's
    ``prompt_tokens`` cannot be computed within ``deadline_s`` at ``rate``'s best pace."""
    if deadline_s is None:
        return
    needs = rate.seconds_for(backlog + prompt_tokens, now)
    if needs is not None and needs > deadline_s:
        raise TooLate(f"this worker cannot compute the prompt in time: {backlog} prompt tokens are queued "
                      f"before its {prompt_tokens}, about {needs:.1f}s at its best recent pace, and the request "
                      f"has {deadline_s:.1f}s left")
