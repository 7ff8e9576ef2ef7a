"""Supervised helper threads (docs/design.md, rule 8): a thread that dies silently pins every request
that waits on it. A :class:`SupervisedThread` runs ``serve()`` in a loop; an exception is logged,
counted, handed to ``on_crash`` (which fails the rooms the thread was working on) and the thread
starts ``serve()`` again after a short pause. ``stop()`` ends it for good.

A thread that *hangs* (blocked in a call that never returns) cannot be restarted, but it can be
seen: ``serve()`` calls :meth:`beat` every iteration, and :meth:`age` tells any thread how long ago
that was. The engine loop judges it (``disagg/role.py``): a worker whose transfer or control
thread stopped beating fails what depends on it and reports itself unhealthy, to be restarted.

A simulator (``splitserve/sim/``) runs the same work without the thread: it calls each
subclass's ``step()`` (one iteration of ``serve()``) itself, hands an exception to
:meth:`crashed` as ``run()`` does, swaps ``clock``, and says whether the thread is up
(:meth:`alive`).
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
        self.clock = time.monotonic  # the only clock the thread reads (a simulator swaps it)
        self._beat = self.clock()

    def beat(self) -> None:
        """``serve()`` is alive: call once per iteration."""
        self._beat = self.clock()

    def age(self) -> float:
        """Seconds since the last :meth:`beat` (any thread may ask)."""
        return self.clock() - self._beat

    def alive(self) -> bool:
        """The thread is up (started and not ended); a simulator that drives ``step()`` says so itself."""
        return self.is_alive()

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
                self.crashed(exc)
                time.sleep(RESTART_PAUSE_S)

    def crashed(self, exc: BaseException) -> None:
        """An iteration raised ``exc``: count and log it, and fail what it was in the middle of.
        Call from the ``except`` block (the log line carries the traceback)."""
        self.restarts += 1
        log.exception("%s crashed (restart %d)", self.name, self.restarts)
        try:
            self.on_crash(exc)
        except Exception:
            log.exception("%s: on_crash failed", self.name)

    def stop(self, timeout: float = 5.0) -> None:
        self.stopping.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)
