"""Supervised helper threads (docs/design.md, rule 8): a thread that dies silently pins every request
that waits on it. A :class:`SupervisedThread` runs ``serve()`` in a loop; an exception is logged,
counted, handed to ``on_crash`` (which fails the rooms the thread was working on) and the thread
starts ``serve()`` again after a short pause. ``stop()`` ends it for good.

A thread that *hangs* (blocked in a call that never returns) cannot be restarted, but it can be
seen: ``serve()`` calls :meth:`beat` every iteration, and :meth:`age` tells any thread how long ago
that was. The engine loop judges it (``disagg/role.py``): a worker whose transfer or control
thread stopped beating fails what depends on it and reports itself unhealthy, to be restarted.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)

RESTART_PAUSE_S = 0.1


class SupervisedThread(threading.Thread):
    def __init__(self, name: str):
        super().__init__(name=name, daemon=True)
        self.stopping = threading.Event()
        self.restarts = 0
        self._beat = time.monotonic()

    def beat(self) -> None:
        """``serve()`` is alive: call once per iteration."""
        self._beat = time.monotonic()

    def age(self) -> float:
        """Seconds since the last :meth:`beat` (any thread may ask)."""
        return time.monotonic() - self._beat

    def serve(self) -> None:
        """Do the work until ``self.stopping`` is set; may raise (the thread restarts)."""
        raise NotImplementedError

    def on_crash(self, exc: BaseException) -> None:
        """Fail whatever the crashed ``serve()`` was in the middle of."""

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.serve()
            except Exception as exc:
                self.restarts += 1
                log.exception("%s crashed (restart %d)", self.name, self.restarts)
                try:
                    self.on_crash(exc)
                except Exception:
                    log.exception("%s: on_crash failed", self.name)
                time.sleep(RESTART_PAUSE_S)

    def stop(self, timeout: float = 5.0) -> None:
        self.stopping.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)
