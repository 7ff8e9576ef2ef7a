"""``Call``: a function run in its own thread and timed, so a test can strike while it waits."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional


class Call:
    """A function run in its own thread, timed: ``outcome()`` waits for it (bounded)."""

    def __init__(self, fn: Callable, *args, **kwargs):
        self.started = time.monotonic()
        self.ended: Optional[float] = None
        self.future: Future = Future()
        self.thread = threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True)
        self.thread.start()

    def _run(self, fn, args, kwargs) -> None:
        try:
            value = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.ended = time.monotonic()
            self.future.set_exception(exc)
        else:
            self.ended = time.monotonic()
            self.future.set_result(value)

    def outcome(self, timeout: float):
        """(response or exception, when it ended)."""
        try:
            value = self.future.result(timeout)
        except TimeoutError:
            raise AssertionError(f"no answer after {timeout:g}s: the client hangs") from None
        except BaseException as exc:  # noqa: BLE001
            value = exc
        return value, self.ended
