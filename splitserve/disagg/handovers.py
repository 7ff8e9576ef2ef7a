"""Hand-overs that must happen: what a session's end leaves for a role's threads to do (the
control thread forgets the session; prefill's transfer thread drops its connection). One that
raises is **owed** (``docs/design.md``, glossary) and tried again at every tick until it goes
through — else the thread would keep what belongs to a session that is over, for good."""

from __future__ import annotations

import logging
from collections import deque
from typing import Callable

from splitserve.log_sparsely import worth_logging

log = logging.getLogger(__name__)


class HandOvers:
    """The owed hand-overs of one role, oldest first; all on the engine loop."""

    def __init__(self, role_name: str):
        self.role_name = role_name
        self._owed: deque[tuple[str, Callable[[], None]]] = deque()
        self.failures = 0
        """Times a hand-over raised and was left owed."""

    def hand_over(self, what: str, call: Callable[[], None]) -> None:
        """Make ``call`` (``what``, for the log) after every earlier owed one; owed if it raises."""
        self._owed.append((what, call))
        self.retry_owed()

    def retry_owed(self) -> None:
        """Make the owed calls in order, up to the first that raises again."""
        while self._owed:
            what, call = self._owed[0]
            try:
                call()
            except Exception:
                self.failures += 1
                if worth_logging(self.failures):
                    log.exception("%s: %s could not be handed over (%d so far); it is owed", self.role_name, what,
                                  self.failures)
                return
            self._owed.popleft()

    def owed(self) -> int:
        """How many hand-overs are owed now (any thread may ask)."""
        return len(self._owed)

    def forget(self) -> None:
        """Drop the owed ones: the threads they were for are stopped for good (a replaced role)."""
        self._owed.clear()
