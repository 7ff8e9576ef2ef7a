"""What the simulator must take from asyncio's and aiohttp's private parts, in this one module.

:class:`SimLoop` is asyncio's selector loop on a virtual clock (``clock.py`` tells what for): its
``_run_once`` is asyncio's own, step for step, over asyncio's private timer heap
(``_scheduled``, ``_ready``, ``_timer_cancelled_count``, ``_clock_resolution``, ``_stopping``,
a handle's ``_scheduled``, ``_cancelled`` and ``_run``), except that where asyncio would wait in
``select`` it moves the clock. :func:`with_match_info` sets the route match of a ``web.Request``
built by hand, as ``aiohttp.test_utils`` does (``_match_info``); :func:`handle` runs one through
the app's handler chain as aiohttp's server does (``Application._handle``). No other module of ``splitserve``
touches these names (``tests/test_sim_seams.py`` reads every file for them).

They were checked on the Python versions in :data:`CHECKED_ON` (by a hash of the source of what
this module copies or relies on) and on the aiohttp pinned in ``pyproject.toml``
(:data:`AIOHTTP_CHECKED`). When Python moves past them, ``tests/test_sim_seams.py`` fails: read
the new ``asyncio/base_events.py`` (``BaseEventLoop._run_once`` and ``call_at``) and
``asyncio/events.py`` (``TimerHandle``), carry what changed into :class:`SimLoop`, run
``tests/test_sim.py`` (two runs of one seed must still print the same), then add the new version's
hashes below. For a new aiohttp, check ``web.Request.match_info`` still reads ``_match_info`` and
``web_protocol.RequestHandler`` still calls ``Application._handle``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import selectors
from asyncio import base_events, events

from aiohttp import web

CHECKED_ON = {
    (3, 11): {"BaseEventLoop._run_once": "26970ce6b0d67ef5", "BaseEventLoop.call_at": "f0c8e92441792fa7",
              "TimerHandle.__init__": "663a1b078f6ae833"},
}
"""Python (major, minor) -> the first 16 hex digits of the sha256 of each relied-on function's source."""
AIOHTTP_CHECKED = "3.14.5"


def relied_on() -> dict:
    """What this module relies on, by name (the keys of :data:`CHECKED_ON`)."""
    return {"BaseEventLoop._run_once": base_events.BaseEventLoop._run_once,
            "BaseEventLoop.call_at": base_events.BaseEventLoop.call_at,
            "TimerHandle.__init__": events.TimerHandle.__init__}


def with_match_info(req: web.Request, match_info) -> web.Request:
    """``req`` (built by hand, as ``aiohttp.test_utils`` builds one) with its route match."""
    req._match_info = match_info
    return req


async def handle(app: web.Application, req: web.Request) -> web.StreamResponse:
    """``app``'s answer to ``req``: its middlewares and handler, as ``web_protocol`` calls them."""
    return await app._handle(req)


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


