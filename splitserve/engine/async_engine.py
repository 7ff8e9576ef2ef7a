"""The engine loop: one thread that owns the :class:`LLMEngine`, fed through an inbox.

The HTTP front end runs on an asyncio loop in another thread. It never touches request state: it
posts events (add, abort, drain, stop) to the inbox, and the engine loop posts each step's outputs
back with ``call_soon_threadsafe`` to one asyncio queue per request (DESIGN §2, rule 1).

Admission is decided on the asyncio side from its own count of requests in flight, so a full
server refuses at once (429) instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional

from splitserve.config import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.io import (EngineError, GenerateRequest, InvalidRequest, NotReady, Overloaded,
                                  RequestOutput)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AddRequest:
    """Inbox event: a request to run (the roles' ``_handle`` hooks see it too)."""

    req: GenerateRequest


@dataclass(frozen=True)
class AbortRequest:
    """Inbox event: the client went away, or an operator aborted ``rid``."""

    rid: str
    reason: str
    code: int


@dataclass(frozen=True)
class _Stop:
    reason: str


@dataclass(frozen=True)
class _Ask:
    """Run ``fn`` on the engine loop and hand its result to ``future`` (reads of loop-owned state)."""

    fn: Callable[[], object]
    future: concurrent.futures.Future


class AsyncEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.engine: Optional[LLMEngine] = None
        self.ready = False
        self.draining = False
        self._inbox: "queue.Queue[object]" = queue.Queue()
        self._streams: dict[str, asyncio.Queue] = {}  # asyncio thread only
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._stats: Optional[dict] = None  # published by the engine loop after each iteration
        self.last_iteration = time.monotonic()
        """When the engine loop last began an iteration (monotonic); a wedged loop stops moving it."""

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        """Load the model and start the engine thread. Blocking: run it in an executor."""
        self.engine = LLMEngine(self.config)
        self.start_loop(loop)

    def start_loop(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        """Start the engine thread over ``self.engine``."""
        self._stats = self._collect_stats()
        self._loop = loop
        self.last_iteration = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        self.ready = True

    @property
    def spec(self):
        return self.engine.spec

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def begin_drain(self) -> None:
        self.draining = True

    def shutdown(self, reason: str = "the server is shutting down") -> None:
        """End every live request with an error and stop the engine thread."""
        self.ready = False
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(_Stop(reason))
            self._thread.join(timeout=30)

    # -- requests (asyncio thread) ------------------------------------------------------------

    def submit(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if not self.ready or self.draining:
            raise NotReady("the server is not ready" if not self.ready else "the server is draining")
        if len(self._streams) >= self.config.max_running_requests + self.config.max_waiting_requests:
            raise Overloaded(f"{len(self._streams)} requests in flight; the waiting queue is full")
        if req.rid in self._streams:
            raise InvalidRequest(f"request id {req.rid!r} is already in flight", param="rid")
        self._check_fits(req)
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[req.rid] = stream
        self._inbox.put(AddRequest(req))
        return self._iterate(req.rid, stream)

    def _check_fits(self, req: GenerateRequest) -> None:
        self.engine.check_fits(req)  # reads only immutable sizes

    async def _iterate(self, rid: str, stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                out: RequestOutput = await stream.get()
                yield out
                if out.finished:
                    return
        finally:
            if self._streams.get(rid) is stream:  # the consumer went away before the end
                del self._streams[rid]
                self.abort(rid)

    def abort(self, rid: str, reason: str = "aborted by the client", code: int = 499) -> None:
        """Thread-safe and idempotent."""
        self._inbox.put(AbortRequest(rid, reason, code))

    def stats(self) -> dict:
        """What the engine loop last published (any thread may call this)."""
        if self._stats is None:  # not started yet
            return {"pages_free": 0, "pages_total": 0, "queues": {"waiting": 0, "running": 0}, "preemptions": 0}
        return self._stats

    def _collect_stats(self) -> dict:
        """Runs on the engine loop: a fresh dict, never mutated after it is published."""
        s = self.engine.stats()
        return {"pages_free": s.pages_free, "pages_total": s.pages_total,
                "queues": {"waiting": s.waiting, "running": s.running}, "preemptions": s.preemptions}

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Runs on the asyncio thread."""
        for out in outputs:
            stream = self._streams.get(out.rid)
            if stream is None:
                continue
            if out.finished:  # the request is over: it no longer counts as in flight
                del self._streams[out.rid]
            stream.put_nowait(out)

    # -- engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            self.last_iteration = time.monotonic()
            try:
                events = self._take_events(self._wait_s())
                outputs: list[RequestOutput] = []
                for ev in events:
                    if isinstance(ev, _Ask):
                        self._answer_ask(ev)
                        continue
                    if isinstance(ev, _Stop):
                        self._post(self._stop_all(ev.reason))
                        self._stats = self._collect_stats()
                        return
                    outputs += self._handle(ev)
                outputs += self._tick()
                if engine.has_work():
                    outputs += self._step()
                self._stats = self._collect_stats()
                self._post(outputs)
            except Exception:  # never die silently: log, fail what is live, keep serving
                log.exception("engine loop error; failing all live requests")
                self._post(self._stop_all("internal error in the engine loop", 500))

    # -- hooks for the disaggregated roles (disagg/worker.py) ---------------------------------

    def _wait_s(self) -> Optional[float]:
        """How long the loop may wait for an event: 0 while there is work."""
        return 0.0 if self.engine.has_work() else 0.5

    def _tick(self) -> list[RequestOutput]:
        """Called every iteration, after events and before the step."""
        return []

    def _step(self) -> list[RequestOutput]:
        return self.engine.step()

    def _stop_all(self, reason: str, code: int = 503) -> list[RequestOutput]:
        return self.engine.abort_all(reason, code)

    def _take_events(self, wait_s: Optional[float]) -> list[object]:
        events = []
        try:
            events.append(self._inbox.get(timeout=wait_s) if wait_s else self._inbox.get_nowait())
            while True:
                events.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return events

    def ask_loop(self, fn: Callable[[], object], timeout: float = 5.0):
        """Thread-safe: run ``fn`` on the engine loop and return its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_Ask(fn, future))
        return future.result(timeout)

    @staticmethod
    def _answer_ask(ask: _Ask) -> None:
        try:
            ask.future.set_result(ask.fn())
        except Exception as exc:  # the asker gets the error; the loop goes on
            ask.future.set_exception(exc)

    def debug_requests(self) -> list[dict]:
        """Thread-safe: every live request, as ``/debug/requests`` shows it."""
        def snapshot() -> list[dict]:
            now = time.monotonic()
            return [{"rid": seq.rid, "room": None, "role": "colocated", "state": seq.status.value.upper(),
                     "age_s": round(now - seq.arrival, 3), "state_age_s": None, "deadline_s": None,
                     "late": False, "peer": None} for seq in self.engine.live_sequences()]
        return self.ask_loop(snapshot)

    def post_event(self, event: object) -> None:
        """Thread-safe: hand an event to the engine loop (used by the disaggregation threads)."""
        self._inbox.put(event)

    def _handle(self, ev: object) -> list[RequestOutput]:
        if isinstance(ev, AddRequest):
            try:
                self.engine.add_request(ev.req)
            except EngineError as exc:
                return [RequestOutput(rid=ev.req.rid, finished=True, error=str(exc), error_code=exc.status)]
            return []
        if isinstance(ev, AbortRequest):
            out = self.engine.abort(ev.rid, ev.reason, ev.code)
            return [out] if out else []
        raise TypeError(f"unknown engine event {ev!r}")

    def _post(self, outputs: list[RequestOutput]) -> None:
        if outputs and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, outputs)
