"""When ``splitserve launch`` starts a worker again, and in which role: the restart policy.

A worker that exits or is killed once every process was up, or that launch stopped for not being
healthy (``health_watch.py``), is started again (the router takes it back through its health
checks, or discovery), after a delay that doubles with each restart of that worker in the window
(``first_delay_s``, ``2 * first_delay_s``, ... at most ``max_delay_s``), so a worker that crashes
at once does not spin. At most ``budget`` restarts of one worker in any
``window_s``: the next exit gives up, and launch stops everything and exits 1 naming the worker.
A budget of 0 restarts nothing (a worker's exit stops everything).

The role: the one the worker last wrote to its role file (``serve --role-file``), else, with a
warning, the role launch started it in. The rest of its command line (ports, bootstrap port,
worker id, keys, discovery) stays as launch first built it.

Pure: the caller passes the time (:meth:`Restarts.after_exit`) and does the waiting.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable, Optional

from splitserve.server.role_file import read_role


@dataclass(frozen=True)
class RestartPolicy:
    budget: int = 5
    """Restarts of one worker allowed in any ``window_s``; 0: never restart."""
    window_s: float = 600.0
    """The window the budget counts restarts in."""
    first_delay_s: float = 0.5
    """The delay before a worker's first restart in the window; it doubles with each one more."""
    max_delay_s: float = 30.0
    """The longest delay before a restart."""

    def check(self) -> None:
        """ValueError naming the option that is out of range."""
        if self.budget < 0:
            raise ValueError(f"--restart-budget is a number of restarts, 0 or more, not {self.budget}")
        for flag, value in (("--restart-window-s", self.window_s), ("--restart-delay-s", self.first_delay_s),
                            ("--restart-max-delay-s", self.max_delay_s)):
            if not value >= 0 or value == float("inf"):
                raise ValueError(f"{flag} is a number of seconds, 0 or more, not {value}")

    def delay_s(self, attempt: int) -> float:
        """The delay before restart number ``attempt`` (from 1) of the window."""
        return min(self.max_delay_s, self.first_delay_s * 2.0 ** min(attempt - 1, 60))


class Restarts:
    """The restarts of each worker in the last window, and the decision for the next exit."""

    def __init__(self, policy: RestartPolicy):
        self.policy = policy
        self._times: dict[str, collections.deque[float]] = {}

    def after_exit(self, name: str, now: float) -> Optional[tuple[int, float]]:
        """Restart ``name`` (exited at ``now``)? ``(attempt, delay_s)``, counted as done; or None:
        the budget of the window is used up (or 0), give up."""
        times = self._times.setdefault(name, collections.deque())
        while times and times[0] <= now - self.policy.window_s:
            times.popleft()
        if len(times) >= self.policy.budget:
            return None
        times.append(now)
        return len(times), self.policy.delay_s(len(times))

    def in_window(self, name: str) -> int:
        """Restarts of ``name`` counted in the window as of its last exit."""
        return len(self._times.get(name, ()))


def role_to_restart(argv: tuple[str, ...], role_file: Optional[str],
                    warn: Callable[[str], None]) -> tuple[tuple[str, ...], str]:
    """The command line to start a worker again with (``argv`` with ``--role`` set to the role in
    ``role_file``), and that role. An unreadable or malformed file keeps the role of ``argv``, and
    ``warn`` is told why."""
    at = argv.index("--role") + 1 if "--role" in argv[:-1] else None
    launched = argv[at] if at is not None else ""
    if role_file is None or at is None:
        return argv, launched
    role, why = read_role(role_file)
    if role is None:
        warn(f"role file {role_file}: {why}; restarting it as a {launched} worker, the role it was launched in")
        return argv, launched
    return argv[:at] + (role,) + argv[at + 1:], role
