"""A pool of threads shared fairly between keys: the queue the grammar compiler builds requests'
matchers on (``engine/grammar_compiler.py``), keyed by the grammar's hash.

Jobs wait per key; a free thread takes the oldest job of the next key in turn (round robin over
the keys that have jobs waiting), and never runs more than ``per_key`` jobs of one key at once.
So one grammar's requests, however many, hold at most ``per_key`` threads and take one turn in
each round: a request of another grammar waits for at most one job of each key ahead of it in
the round (each bounded in cost by the compiler), never behind a flood of one key. Jobs are
``concurrent.futures.Future`` s, so a waiter may cancel one that has not started.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from concurrent.futures import Future
from typing import Any, Callable, Hashable, Optional


class FairPool:
    """``threads`` threads (daemons, started at once) running :meth:`submit` ted jobs round
    robin over their keys, at most ``per_key`` of one key at a time."""

    def __init__(self, threads: int, per_key: int = 1, name: str = "fair-pool"):
        self.per_key = per_key
        self._cv = threading.Condition()
        self._waiting: OrderedDict[Hashable, deque] = OrderedDict()  # key -> its jobs; keys in turn order
        self._running: dict[Hashable, int] = {}
        self._closed = False
        self.started = 0  # jobs begun, a counter for tests and metrics
        for i in range(threads):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, key: Hashable, fn: Callable, *args: Any) -> Future:
        future: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the pool is shut down")
            self._waiting.setdefault(key, deque()).append((future, fn, args))
            self._cv.notify()
        return future

    def waiting(self) -> int:
        """Jobs not started yet (cancelled ones included until a thread skips them)."""
        with self._cv:
            return sum(len(q) for q in self._waiting.values())

    def _take(self) -> Optional[tuple]:
        """The next job to run (its key counted as running), waiting for one; None once shut down."""
        with self._cv:
            while True:
                if self._closed:
                    return None
                for key, jobs in self._waiting.items():
                    if self._running.get(key, 0) < self.per_key:
                        job = jobs.popleft()
                        if jobs:
                            self._waiting.move_to_end(key)  # its next job waits for the others' turns
                        else:
                            del self._waiting[key]
                        if not job[0].set_running_or_notify_cancel():
                            break  # cancelled while waiting: look again
                        self._running[key] = self._running.get(key, 0) + 1
                        self.started += 1
                        return (key,) + job
                else:
                    self._cv.wait()

    def _work(self) -> None:
        while True:
            job = self._take()
            if job is None:
                return
            key, future, fn, args = job
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # the waiter gets it; the thread carries on
                future.set_exception(exc)
            finally:
                with self._cv:
                    left = self._running[key] - 1
                    if left:
                        self._running[key] = left
                    else:
                        del self._running[key]
                    self._cv.notify_all()

    def shutdown(self) -> None:
        """Stop taking jobs: the waiting ones are cancelled, the running ones end on their own."""
        with self._cv:
            self._closed = True
            for jobs in self._waiting.values():
                for future, _, _ in jobs:
                    future.cancel()
            self._waiting.clear()
            self._cv.notify_all()
