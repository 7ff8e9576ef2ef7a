"""When ``splitserve launch`` gives up on a worker that runs but is not healthy: the health watch.

Once every process is up, launch looks at each worker's ``/health`` every ``interval_s`` (each
look may take that long, at least a second). Two verdicts, each a reason to stop the worker
(SIGTERM, then SIGKILL) and count it as an exit under the restart budget:

- **never healthy**: a worker started again that has not answered 200 (as itself) within
  ``start_timeout_s`` of its start (``--ready-timeout-s``, the bound of the first start too): it
  hangs loading, or its port never opens.
- **wedged**: a worker that was healthy and then failed ``unhealthy_checks`` looks in a row (0:
  never). A worker that says it drains (``"status": "draining"``: a role switch, bounded by its own
  ``--drain-timeout-s``) neither counts nor resets the run. The defaults (every 10 s, 6 in a row,
  as the Kubernetes liveness probes of ``deploy/kubernetes/``) leave a busy worker alone: its
  ``/health`` is answered by the HTTP loop, not the engine loop, and a wedged engine loop says
  ``stalled`` only after ``--loop-stall-s``.

Pure: the caller passes the times and the answers (:meth:`HealthWatch.record`), and does the
looking and the stopping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from splitserve.launch.health_probe import Answer


@dataclass(frozen=True)
class HealthPolicy:
    interval_s: float = 10.0
    """Seconds between two looks at a worker's ``/health``; one look may take as long (at least 1 s)."""
    unhealthy_checks: int = 6
    """Failed looks in a row that make a worker that was healthy wedged; 0: never."""
    start_timeout_s: Optional[float] = None
    """How long a worker started again may take to become healthy; None: the supervisor's
    ``ready_timeout_s`` (launch's ``--ready-timeout-s``)."""

    def check(self) -> None:
        """ValueError naming the option that is out of range."""
        if not (self.interval_s > 0 and math.isfinite(self.interval_s)):
            raise ValueError(f"--worker-health-interval-s is a number of seconds above 0, not {self.interval_s}")
        if self.unhealthy_checks < 0:
            raise ValueError(f"--worker-unhealthy-checks is a number of checks, 0 or more, not {self.unhealthy_checks}")

    def probe_timeout_s(self) -> float:
        return max(1.0, self.interval_s)


@dataclass
class _Track:
    started_at: float
    healthy: bool
    next_at: float
    failed: int = 0
    failing_since: float = 0.0


class HealthWatch:
    """Where each watched worker stands, and the verdict of each answer."""

    def __init__(self, policy: HealthPolicy, start_timeout_s: float):
        self.policy = policy
        self.start_timeout_s = policy.start_timeout_s if policy.start_timeout_s is not None else start_timeout_s
        self._tracks: dict[str, _Track] = {}

    def started(self, name: str, now: float, healthy: bool = False) -> None:
        """``name`` was (re)started at ``now`` (``healthy``: and seen healthy then: the first
        start's wait); looked at from then on."""
        self._tracks[name] = _Track(now, healthy, now + self.policy.interval_s if healthy else now)

    def due(self, name: str, now: float) -> bool:
        track = self._tracks.get(name)
        return track is not None and now >= track.next_at

    def record(self, name: str, asked_at: float, answer: Answer) -> Optional[str]:
        """The answer to the look at ``name`` begun at ``asked_at``: None, or the verdict in words
        (``is not healthy 300 s after it was started ...``): stop it."""
        track = self._tracks[name]
        track.next_at = asked_at + self.policy.interval_s
        if answer.healthy:
            track.healthy, track.failed = True, 0
            return None
        if not track.healthy:
            waited = asked_at - track.started_at
            if waited < self.start_timeout_s:
                return None
            return (f"is not healthy {_seconds(waited)} s after it was started again "
                    f"(--ready-timeout-s {self.start_timeout_s:g})")
        if answer.draining or not self.policy.unhealthy_checks:
            return None
        if not track.failed:
            track.failing_since = asked_at
        track.failed += 1
        if track.failed < self.policy.unhealthy_checks:
            return None
        span = _seconds(asked_at - track.failing_since)
        return (f"failed {track.failed} health checks in a row, {span} s from the first to the last "
                f"(--worker-unhealthy-checks {self.policy.unhealthy_checks}, every {self.policy.interval_s:g} s)")


def _seconds(value: float) -> str:
    """Seconds for a log line: 0.52, 4, 300, 1234."""
    return f"{value:.2g}" if value < 10 else f"{value:.0f}"
