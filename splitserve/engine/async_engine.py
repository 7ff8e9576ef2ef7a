"""The engine loop: one thread that owns the :class:`LLMEngine` and a role, fed through an inbox.

The HTTP front end runs on an asyncio loop in another thread. It never touches request state: it
posts events (add, abort, stop) to the inbox, and the engine loop posts each step's outputs back
with ``call_soon_threadsafe`` to one asyncio queue per request (``docs/lifecycle.md``, rule 1).
What the loop does with a request is its **role**'s business (``role.py``: ``colocated.py``, or
``disagg/prefill_role.py``, ``disagg/decode_role.py``). Each iteration, in order: note that it
begins (``last_progress``, which a forward pass also moves after each decoder layer: its age is
how ``/health`` and the metrics see a wedged loop); take the inbox's events, waiting up to
``role.wait_s()`` when idle, and hand each to the role (``admit``, ``abort``, ``on_event``);
``role.tick(now)``; one ``engine.step()`` and ``role.after_step(report)`` if there is work (a
step that scheduled nothing makes the next iteration wait as an idle one); post the outputs.
The simulator runs it without its thread (``start_loop(loop, thread=False)``, ``iterate_once``).

No exception ends the loop: one request's own data fails that request alone (``role.fail_request``,
``StepReport.failed``); anything else escaping a role is logged and counted, and the role fails
whatever it holds (``role.fail_all``). Refusal is decided on the asyncio side, at once: 429 for a
full server, 400 for a request that could never fit the pool (``LLMEngine.check_fits``). A request
id stays taken until the engine has ended that request, so a reused id never gets the old one's end.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional

from splitserve.config import EngineConfig
from splitserve.engine.colocated import ColocatedRole
from splitserve.engine.engine import LLMEngine, ModelParts
from splitserve.engine.io import (FLUSH_WAIT_S, GenerateRequest, InvalidRequest, NotReady, Overloaded,
                                  RequestOutput)
from splitserve.engine.prompt_rate import PromptRate, refuse_if_late
from splitserve.engine.step_pace import StepPace
from splitserve.engine.role import Role
from splitserve.engine.worker_stats import WorkerStats
from splitserve.outcomes import Ending, Reason

log = logging.getLogger(__name__)

EVENTS_PER_ITERATION = 4096  # a burst of events is taken in slices, so that ticks and steps go on


@dataclass(frozen=True)
class AddRequest:
    """Inbox event: a request to run."""

    req: GenerateRequest


@dataclass(frozen=True)
class AbortRequest:
    """Inbox event: the client went away, or an operator aborted ``rid``."""

    rid: str
    ending: Ending = Ending(Reason.CLIENT_ABORT)


@dataclass(frozen=True)
class _Stop:
    ending: Ending


@dataclass(frozen=True)
class _Posted:
    """Inbox event from a role's own threads, stamped with that role (``poster``): once the role is
    replaced, what its threads posted — also later, from a thread that did not stop — is dropped."""

    role: int
    event: object


@dataclass(frozen=True)
class _Call:
    """Run ``fn`` on the engine loop (a change of loop-owned state, e.g. flushing the prefix
    cache) and hand its result to ``future``."""

    fn: Callable[[], object]
    future: concurrent.futures.Future


@dataclass(eq=False)
class _Stream:
    """The asyncio side of one request: its outputs, and whether anyone still reads them."""

    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    abandoned: bool = False
    """The reader is gone (client left, or the worker answered for a wedged loop): later outputs
    are dropped; the entry goes when the engine's last output comes."""


class AsyncEngine:
    def __init__(self, config: EngineConfig, role: Optional[Role] = None, loop_stall_s: float = 30.0,
                 parts: Optional[ModelParts] = None, inbox: Optional["queue.SimpleQueue[object]"] = None):
        """``parts``: what the engine runs (default: loaded from ``config.model`` at :meth:`start`).
        ``inbox``: where the loop's events go (default a new queue; a simulator passes one whose put
        wakes its loop)."""
        self.config = config
        self.parts = parts
        self.role: Role = role or ColocatedRole()
        self.loop_stall_s = loop_stall_s
        self.engine: Optional[LLMEngine] = None
        self.ready = False
        self.draining = False
        self.loop_errors = 0
        self.request_errors = 0  # admissions that raised: each failed its own request only
        self._inbox: "queue.SimpleQueue[object]" = inbox if inbox is not None else queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # asyncio thread only
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self.clock = time.monotonic  # the only clock the loop reads (a simulator swaps it)
        self._unschedulable = False  # the last step had work and could schedule none of it
        self._role_serial = 0  # which role the loop runs (``replace_role`` counts them); stamps what is posted
        self.stale_events = 0  # events of a replaced role's threads, dropped
        self.prompt_rate = PromptRate()  # the engine's recent pace at prompts: who is refused as too late
        self.step_pace = StepPace(config.prompt_chunk_cost)  # prompt tokens beside decode (step_pace.py)
        self.last_progress = self.clock()
        """When the engine loop last moved (monotonic): began an iteration, or finished a decoder
        layer of a forward pass (``note_progress``); a wedged loop stops moving it."""

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        """Load the model, start the role (its threads) and the engine thread. Blocking: run it in
        an executor."""
        self.engine = LLMEngine(self.config, self.parts, progress=self.note_progress)
        self.role.start(self)
        self.start_loop(loop)

    def start_loop(self, loop: Optional[asyncio.AbstractEventLoop] = None, thread: bool = True) -> None:
        """Start the engine thread over ``self.engine`` (``thread=False``: the caller drives
        ``iterate_once`` itself)."""
        self._loop = loop
        self.last_progress = self.clock()
        if thread:
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

    def end_drain(self) -> None:
        """Take requests again (after a role switch: ``replace_role``)."""
        self.draining = False

    def replace_role(self, role: Role, goodbye: str, timeout: float = 120.0) -> int:
        """Thread-safe, blocking: on the engine loop, end what the current role still holds
        (``fail_all`` with ``goodbye``, which says why; a worker that switches has drained first),
        close it (its threads stopped, its peers told ``goodbye``, its sockets and transfer agent
        closed), give back every page it held (``release_all``: nothing can write into them once it
        is closed), drop what its threads posted, and start ``role`` on the same engine. The
        number of pages the old role still held. If ``role`` cannot start, it is closed again and
        the exception raised: the loop then runs the closed old role, which takes no request
        (replace it again)."""
        def on_loop() -> int:
            old = self.role
            self._post(self._contained(old.fail_all, Ending(Reason.NOT_READY, goodbye)))
            old.close(goodbye)
            release = getattr(old, "release_all", None)
            freed = release() if release is not None else 0
            self._role_serial += 1  # what the old role's threads posted is stale from here on
            try:
                role.start(self)
            except BaseException:
                try:
                    role.close(None)
                except Exception:
                    log.exception("closing the role that failed to start raised")
                raise
            self.role = role
            return freed

        return self.call_on_loop(on_loop, timeout)

    def shutdown(self, reason: str = "the server is shutting down") -> None:
        """End every live request with an error and stop the engine thread, then the role."""
        self.ready = False
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(_Stop(Ending(Reason.NOT_READY, reason)))
            self._thread.join(timeout=30)
        self.role.close()

    # -- health, read from any thread ---------------------------------------------------------

    def note_progress(self) -> None:
        """Engine thread, during a forward pass (after each decoder layer): the loop moves."""
        self.last_progress = self.clock()

    def loop_age(self) -> float:
        """Seconds since the engine loop last moved: began an iteration (an idle loop begins one at
        least every ``IDLE_WAIT_S``) or finished a layer of a forward pass. A step of any length
        keeps it at most one layer's time; a wedged loop lets it grow."""
        return self.clock() - self.last_progress

    def open_streams(self) -> int:
        """How many requests have a stream here (their answer not yet ended). Asyncio thread only."""
        return len(self._streams)

    def awaited_rids(self) -> list[str]:
        """The request ids whose client still waits on their stream. Asyncio thread only."""
        return [rid for rid, st in self._streams.items() if not st.abandoned]

    def loop_stalled(self) -> bool:
        """The loop has not moved within ``loop_stall_s``: it is wedged or dead."""
        return self.ready and self.loop_age() > self.loop_stall_s

    def health_problem(self) -> Optional[str]:
        """Why this worker cannot serve now although it started (None when it can): a wedged
        engine loop, or a thread of its role that hangs. Any thread may ask; it never waits."""
        if self.loop_stalled():
            return f"the engine loop has made no progress for {self.loop_age():.0f}s (--loop-stall-s {self.loop_stall_s:g})"
        problem = getattr(self.role, "health_problem", None)
        return problem() if problem is not None and self.ready else None

    # -- requests (asyncio thread) ------------------------------------------------------------

    def submit(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if not self.ready or self.draining:
            raise NotReady("the server is not ready" if not self.ready else "the server is draining")
        if self.loop_stalled():
            raise NotReady(f"the engine loop has made no progress for {self.loop_age():.0f}s "
                           f"(--loop-stall-s {self.loop_stall_s:g})")
        if len(self._streams) >= self.config.max_running_requests + self.config.max_waiting_requests:
            raise Overloaded(f"{len(self._streams)} requests in flight; the waiting queue is full")
        if req.rid in self._streams:
            raise InvalidRequest(f"request id {req.rid!r} is already in flight", param="rid")
        self.role.check(req)
        if req.continuation is not None:  # its ids refused here, not once a role has taken it
            self.engine.check_continuation(req)
        if getattr(self.role, "computes_prompt", lambda r: True)(req):  # 503 when it could not be in time
            refuse_if_late(self.prompt_rate, self.engine.scheduler.prompt_backlog, len(req.prompt_ids), req.deadline_s,
                           self.clock())
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        stream = self._streams[req.rid] = _Stream()
        self._inbox.put(AddRequest(req))
        return self._iterate(req.rid, stream)

    async def _iterate(self, rid: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                out: RequestOutput = await stream.queue.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished and not stream.abandoned:  # the consumer went away before the end
                stream.abandoned = True
                self.abort(rid)

    def abort(self, rid: str, ending: Ending = Ending(Reason.CLIENT_ABORT)) -> None:
        """Thread-safe and idempotent."""
        self._inbox.put(AbortRequest(rid, ending))

    def fail_streams(self, ending: Ending) -> int:
        """Asyncio thread: answer every request still read with ``ending`` now, without the engine
        loop (which is wedged: see ``loop_stalled``); their ids stay taken until the loop ends
        them. The number answered."""
        answered = 0
        for rid, stream in self._streams.items():
            if not stream.abandoned:
                stream.abandoned = True
                stream.queue.put_nowait(RequestOutput.ended(rid, ending))
                answered += 1
        return answered

    def stats(self) -> WorkerStats:
        """Gauges, read from any thread: the engine's counts and the role's own, as they are now
        (never a copy the loop publishes, which would freeze with a wedged loop)."""
        if self.engine is None:  # not started yet
            return WorkerStats(None)
        return WorkerStats(self.engine.stats(), self.loop_errors, self.request_errors, self.role.stats())

    def debug_requests(self) -> list[dict]:
        """Thread-safe, never waits on the engine loop: every live request, as ``/debug/requests``
        shows it (read from the role's records as they are now)."""
        if self.engine is None:
            return []
        return self.role.debug_rows(self.clock())

    def timeline(self, rid: Optional[str] = None, room: Optional[int] = None) -> Optional[dict]:
        """Thread-safe, never waits on the engine loop: the timeline of request ``rid`` (or of
        ``room``) on this worker, live or recently ended, as ``/debug/requests/{rid}`` shows it."""
        book = getattr(self.role, "timelines", None)
        if book is None:
            return None
        tl = book.get(rid) if rid is not None else book.get_room(room)
        return tl.to_dict(book.clock(), book.wall) if tl is not None else None

    def timeline_short(self, rid: str) -> str:
        """The short form of ``rid``'s timeline, for the log line at its end."""
        book = getattr(self.role, "timelines", None)
        return book.short(rid) if book is not None else "-"

    def post_event(self, event: object) -> None:
        """Thread-safe: hand an event to the engine loop for the role it runs now."""
        self._inbox.put(_Posted(self._role_serial, event))

    def poster(self) -> Callable[[object], None]:
        """What a role starting now gives its threads to post with (thread-safe): their events
        reach the loop while it runs this role, and are dropped once it is replaced."""
        serial = self._role_serial
        return lambda event: self._inbox.put(_Posted(serial, event))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Runs on the asyncio thread."""
        for out in outputs:
            stream = self._streams.get(out.rid)
            if stream is None:
                continue
            if out.finished:  # the request is over: its id is free again
                del self._streams[out.rid]
            if not stream.abandoned:
                stream.queue.put_nowait(out)

    # -- engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while self.iterate_once():
            pass

    def iterate_once(self, wait: bool = True) -> bool:
        """One iteration of the loop (module docstring); False once told to stop. ``wait``: block
        on an empty inbox for up to the role's ``wait_s`` (a benchmark driving the loop passes False)."""
        engine = self.engine
        now = self.last_progress = self.clock()
        outputs: list[RequestOutput] = []
        timeout = self.role.wait_s(now) if wait and (self._unschedulable or not engine.has_work()) else 0.0
        for ev in self._take_events(timeout):  # (a _Call may replace the role: self.role is read anew)
            if isinstance(ev, _Stop):
                outputs += self._contained(self.role.fail_all, ev.ending)
                self._post(outputs)
                return False
            if isinstance(ev, _Call):
                self._answer_call(ev)
                continue
            if isinstance(ev, _Posted):
                if ev.role != self._role_serial:  # posted by a role replaced since
                    self.stale_events += 1
                    continue
                ev = ev.event
            outputs += self._contained(self._dispatch, ev)
        outputs += self._contained(self.role.tick, self.clock())
        self._unschedulable = False
        if engine.has_work():
            outputs += self._contained(self._step, None)
        self._post(outputs)
        return True

    def _step(self, _) -> list[RequestOutput]:
        began, computed = self.clock(), self.engine.prompt_tokens_computed
        report = self.engine.step(self.step_pace.prompt_budget())
        now = self.clock()
        prompt_tokens = self.engine.prompt_tokens_computed - computed
        self.prompt_rate.note(prompt_tokens, now - began, now)
        self.step_pace.note(report.decoding, prompt_tokens, now - began)
        self._unschedulable = not report.scheduled
        return self.role.after_step(report)

    def call_on_loop(self, fn: Callable[[], object], timeout: float = 5.0):
        """Thread-safe: run ``fn`` on the engine loop and return its result (TimeoutError if the
        loop does not get to it in ``timeout``)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_Call(fn, future))
        return future.result(timeout)

    def abort_request(self, rid: Optional[str], room: Optional[int], kv_lost: bool, detail: str,
                      timeout: float = FLUSH_WAIT_S) -> bool:
        """Thread-safe: end ``rid`` (or ``room``'s request) for a stated cause (``POST
        /abort_request``): its client left, or (``kv_lost``, decode) its KV will not come. Whether
        it was here. TimeoutError if the loop does not get to it within ``timeout``."""
        return self.abort_request_later(rid, room, kv_lost, detail).result(timeout)

    def abort_request_later(self, rid: Optional[str], room: Optional[int], kv_lost: bool,
                            detail: str) -> concurrent.futures.Future:
        """:meth:`abort_request` without waiting: the future of whether it was here, set on the
        engine loop (an HTTP handler awaits it with ``asyncio.wrap_future``, no thread held; on the
        simulator's one thread that keeps a run a function of its seed)."""
        def on_loop() -> bool:
            found, outputs = self.role.abort_request(rid, room, kv_lost, detail)
            self._post(outputs)
            return found

        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_Call(on_loop, future))
        return future

    def flush_cache(self, timeout: float = FLUSH_WAIT_S) -> int:
        """Thread-safe: drop every cached page no one owns; how many (``POST /flush_cache``).
        TimeoutError if the loop does not get to it within ``timeout`` (it still does it later)."""
        return self.call_on_loop(self.engine.flush_cache, timeout)

    @staticmethod
    def _answer_call(call: _Call) -> None:
        # A caller that stopped waiting (its timeout cancelled the future) gets no answer, but the
        # work is still done, as promised; answering a cancelled future raises, and that must
        # never reach the loop. Once marked running, the future cannot be cancelled any more.
        wanted = call.future.set_running_or_notify_cancel()
        try:
            result = call.fn()
        except Exception as exc:  # the caller gets the error; the loop goes on
            if wanted:
                call.future.set_exception(exc)
            else:
                log.warning("a call on the engine loop whose caller stopped waiting raised: %r", exc)
            return
        if wanted:
            call.future.set_result(result)

    def _dispatch(self, ev: object) -> list[RequestOutput]:
        if isinstance(ev, AddRequest):
            return self._admit(ev.req)
        if isinstance(ev, AbortRequest):
            return self.role.abort(ev.rid, ev.ending)
        return self.role.on_event(ev)

    def _admit(self, req: GenerateRequest) -> list[RequestOutput]:
        """``role.admit``; an exception there is about this request's own data (or a bug it alone
        met): logged, counted, and this request alone is failed. If failing it raises too, the
        bug is in what the requests share: ``_contained`` fails them all."""
        try:
            return self.role.admit(req)
        except Exception as exc:
            self.request_errors += 1
            log.exception("request %s: its admission failed; failing that request alone", req.rid)
            return self.role.fail_request(req.rid, Ending(
                Reason.INTERNAL_ERROR, f"internal error admitting the request: {type(exc).__name__}: {exc}"))

    def _contained(self, fn, arg) -> list[RequestOutput]:
        """``fn(arg)``; an exception that escapes it is a bug: logged, counted, and every live
        request is failed through the role (its pages freed by its own rules), never left pinned."""
        try:
            return fn(arg)
        except Exception as exc:
            self.loop_errors += 1
            log.exception("engine loop error; failing every live request")
            try:
                return self.role.fail_all(Ending(Reason.INTERNAL_ERROR,
                                                 f"internal error in the engine loop: {type(exc).__name__}: {exc}"))
            except Exception:
                log.exception("the role could not fail its requests")
                return []

    def _take_events(self, wait_s: float) -> list[object]:
        events = []
        try:
            events.append(self._inbox.get(timeout=wait_s) if wait_s > 0 else self._inbox.get_nowait())
            while len(events) < EVENTS_PER_ITERATION:
                events.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return events

    def _post(self, outputs: list[RequestOutput]) -> None:
        if outputs and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, outputs)
