"""Simulated time and randomness: one asyncio event loop whose clock is virtual, and random
streams derived from the seed by name.

:class:`SimLoop` is an ``asyncio`` selector loop whose ``time()`` is a number the loop moves
itself: when nothing is ready to run it jumps straight to the next timer instead of sleeping.
Everything in a simulated cluster runs on it — the router's and the workers' coroutines (the real
ones, ``asyncio.wait_for`` and ``call_later`` included) and the callbacks that stand for each
worker's threads — so a run is one thread, the order of events is the loop's (timers by time,
then in the order they were made), and an hour of bad luck takes as long as its events take.
No file descriptor is ever polled.

:class:`Streams` gives each part of the simulation its own ``random.Random``, seeded from the run's
seed and the part's name (with a stable hash: never Python's ``hash``, which differs per
process), so that the same seed gives the same run in any process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import heapq
import itertools
import random
import selectors
from asyncio import base_events, events

_PURGE_AT = base_events._MIN_SCHEDULED_TIMER_HANDLES  # asyncio's: purge cancelled timers past this many


class _ClockSelector(selectors.BaseSelector):
    """Registers what the loop asks (its self-pipe) and never reports anything ready (the loop's
    own ``_run_once`` never even asks: nothing outside the simulation can become ready)."""

    def __init__(self):
        self._map: dict = {}

    def register(self, fileobj, events, data=None):
        key = selectors.SelectorKey(fileobj, fileobj if isinstance(fileobj, int) else fileobj.fileno(), events, data)
        self._map[fileobj] = key
        return key

    def unregister(self, fileobj):
        return self._map.pop(fileobj)

    def modify(self, fileobj, events, data=None):
        self.unregister(fileobj)
        return self.register(fileobj, events, data)

    def select(self, timeout=None):
        return []

    def get_map(self):
        return self._map

    def close(self):
        self._map.clear()


class InlineExecutor(concurrent.futures.Executor):
    """A worker's thread pool (its tokenizer's), run in place: the simulation never leaves its
    one thread. ``SimLoop.run_in_executor`` calls it directly; ``submit`` is for anyone else."""

    def submit(self, fn, *args, **kwargs):
        return _settled(concurrent.futures.Future(), fn, *args, **kwargs)


def _settled(future, fn, *args, **kwargs):
    """``future`` (either kind) with the answer of ``fn(*args, **kwargs)``, called now."""
    try:
        future.set_result(fn(*args, **kwargs))
    except Exception as exc:
        future.set_exception(exc)
    return future


class Idle(Exception):
    """The loop has neither ready callbacks nor timers (nothing can ever happen again)."""


class SimLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on virtual time (module docstring). Not for threads: the simulation never
    leaves this one.

    Its timers sit in a heap of ``(when, order made, handle)``: asyncio's own heap leaves timers
    due at one instant in no defined order (and on a virtual clock instants tie all the time),
    and tuples compare without a call into Python. ``_run_once`` is asyncio's, step for step (the
    same purge of cancelled timers, the same clock-resolution window for what is due), but that
    where asyncio would wait in ``select`` it moves the clock to the next timer."""

    def __init__(self, start: float = 0.0):
        self._now = start
        self._orders = itertools.count()
        super().__init__(selector=_ClockSelector())

    def time(self) -> float:
        return self._now

    def call_at(self, when, callback, *args, context=None):
        """``asyncio``'s ``call_at``, with timers due at one instant run in the order they were made."""
        self._check_closed()
        timer = events.TimerHandle(when, callback, args, self, context)
        heapq.heappush(self._scheduled, (when, next(self._orders), timer))
        timer._scheduled = True
        return timer

    def _run_once(self) -> None:
        heap, ready = self._scheduled, self._ready
        if len(heap) > _PURGE_AT and 2 * self._timer_cancelled_count > len(heap):
            for _, _, timer in heap:
                if timer._cancelled:
                    timer._scheduled = False
            heap[:] = [entry for entry in heap if not entry[2]._cancelled]
            heapq.heapify(heap)
            self._timer_cancelled_count = 0
        else:
            while heap and heap[0][2]._cancelled:
                self._timer_cancelled_count -= 1
                heapq.heappop(heap)[2]._scheduled = False
        if not ready and not self._stopping:
            if not heap:
                raise Idle("nothing is scheduled: the simulation has no future")
            wait = heap[0][0] - self._now
            if wait > 0:
                self._now += wait
        due = self._now + self._clock_resolution
        while heap and heap[0][0] < due:
            timer = heapq.heappop(heap)[2]
            timer._scheduled = False
            ready.append(timer)
        for _ in range(len(ready)):
            handle = ready.popleft()
            if not handle._cancelled:
                handle._run()

    def run_in_executor(self, executor, func, *args):
        """On an :class:`InlineExecutor`: ``func`` runs now, and its answer is a future already
        done (not one that a thread's completion settles a loop turn later)."""
        if not isinstance(executor, InlineExecutor):
            return super().run_in_executor(executor, func, *args)
        return _settled(self.create_future(), func, *args)

    def _write_to_self(self) -> None:
        pass  # call_soon_threadsafe from this very thread: the callback is queued, nothing to wake

    def run_until(self, when: float) -> None:
        """Run every callback due up to virtual time ``when``, then stop there."""
        stop = self.call_at(when, self.stop)
        try:
            self.run_forever()
        finally:
            stop.cancel()
        self._now = max(self._now, when)


def stable_seed(*parts: object) -> int:
    """A 64-bit seed from ``parts`` (their ``str``), the same in every process."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Streams:
    """Named random streams of one run: ``streams("network")`` is the same generator for the same
    seed and name, whatever else the run draws."""

    def __init__(self, seed: int):
        self.seed = seed
        self._streams: dict[str, random.Random] = {}

    def __call__(self, name: str) -> random.Random:
        rng = self._streams.get(name)
        if rng is None:
            rng = self._streams[name] = random.Random(stable_seed(self.seed, name))
        return rng
