"""The attempts of one request through the router, each an :class:`~splitserve.router.exchange.Exchange`.

:class:`Attempts` runs the loop: each attempt a new room (never one of the request's earlier
ones) and its own request id on the workers (:func:`attempt_rid`), the workers that failed the
request remembered by role so no later attempt goes to them, and what follows an exchange that
failed (:meth:`Attempts.after`): a retry on other workers (:class:`RetryGate`, ``retry.py``), or
the same decode worker alone (``split.py``), or a migration: a decode lost after the client's
answer began continued on another decode worker alone (``migrate.py``; a whole answer sent there
again), or the answer. ``after`` is the one place that decides whether there is another attempt.
"""

from __future__ import annotations

import asyncio
import logging
from typing import NamedTuple, Optional

from aiohttp import web

from splitserve.router import retry
from splitserve.router.exchange import Attempt, Carried, Exchange
from splitserve.router.outcomes import Refusal, RouterOutcome
from splitserve.router.state import Plan, RouterState
from splitserve.router.workers import DECODE, PREFILL, Worker

log = logging.getLogger(__name__)

BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")  # the router's own, never a client's
ROUTER_FIELDS = (*BOOTSTRAP_FIELDS, "stream_ids", "continuation")  # likewise (migrate.py): never passed on


class Route(NamedTuple):
    """What the router plans a request's workers by (``RouterState.plan``)."""

    key: str
    """Its routing key (``policy.routing_key``)."""
    tokens: int
    """Its prompt's estimated tokens (``split.estimate_tokens``)."""
    one_worker: bool
    """It runs on one worker, decode alone (``split.one_worker``)."""


def attempt_rid(rid: str, attempt: int) -> str:
    """The request id a worker gets for attempt ``attempt`` (0 first) of request ``rid``: ``rid``
    itself, then ``rid~N`` (cut to 256 characters): a worker may still hold the id of an attempt
    that was closed a moment ago, and would refuse the same id again while it does."""
    if attempt == 0:
        return rid
    suffix = f"~{attempt}"
    return rid[:256 - len(suffix)] + suffix


def _fresh_room(state: RouterState, used: list[int]) -> int:
    """A room drawn for this request's next attempt, never one of its earlier attempts'."""
    while True:
        room = state.new_room()
        if room not in used:
            return room


class RetryGate:
    """What becomes of a request whose leg just failed before anything reached the client, on its
    attempt number ``n`` (from 1): tried again (``retry.py``), sent to decode alone (``split.py``,
    after a prefill failure with no retry left), or neither; and the next attempt's workers.
    ``failed``: role -> the workers that failed this request so far (no later attempt goes to
    them)."""

    def __init__(self, state: RouterState, n: int, failed: dict, deadline: float, rid: str):
        self.state, self.n, self.failed, self.deadline, self.rid = state, n, failed, deadline, rid
        self.delay = 0.0
        self.role: Optional[str] = None

    def __call__(self, role: str, worker: Worker, why: Optional[str], fallback: Optional[str] = None) -> Optional[str]:
        """A leg of ``role`` on ``worker`` failed: ``why`` is its retry cause (``retry.CAUSES``, or
        None), ``fallback`` (prefill only) its cause for going to decode alone (or None).
        ``"retry"``, ``"fallback"`` or None. Counted; a retry takes one from the budget."""
        state, metrics = self.state, self.state.metrics
        now = asyncio.get_running_loop().time()
        self.failed[role].add(worker)
        if why is not None:
            denied = self._denied(role, now)
            if denied is None:
                self.role = role
                metrics.retries.labels(role=role, cause=why).inc()
                state.recent.retried(self.rid, role, why)
                return "retry"
            metrics.retries_denied.labels(reason=denied).inc()
            log.info("rid=%s: the %s leg failed (%s); not tried again: %s", self.rid, role, why, denied)
        if role == PREFILL and fallback is not None and state.config.pd_fallback and now < self.deadline:
            state.recent.retried(self.rid, role, f"{fallback}; decode alone")
            log.info("rid=%s: the prefill leg failed (%s); the decode worker computes the prompt alone", self.rid,
                     fallback)
            return "fallback"
        return None

    def _denied(self, role: str, now: float) -> Optional[str]:
        """Why no retry (``retry.DENIALS``), or None (then the budget has paid for one)."""
        state = self.state
        if self.n > state.config.max_retries:
            return "max_retries"
        others = state.workers.has_pair(self.failed) if role == PREFILL else \
            state.workers.candidates(DECODE, self.failed)
        if not others:
            return "no_other_worker"
        self.delay = retry.backoff(self.n, retry.jitter_unit(state.new_room()))
        if now + self.delay >= self.deadline:
            return "deadline"
        if not state.retry_budget.spend(now):
            return "budget"
        return None

    async def next_attempt(self, key: str, tokens: int, one_worker: bool = False) -> Optional[Plan]:
        """After the backoff, the next attempt's (prefill or None, decode, decision) by
        ``RouterState.plan``, none of them a worker that failed; None if none is in rotation by then."""
        await asyncio.sleep(self.delay)
        planned = self.state.plan(key, tokens, exclude=self.failed, retrying=True, one_worker=one_worker)
        if isinstance(planned, Refusal):
            self.state.metrics.retries_denied.labels(reason="no_other_worker").inc()
            return None
        prefill, decode, _ = planned
        log.info("rid=%s: retry %d (the %s leg failed) on prefill=%s decode=%s", self.rid, self.n, self.role,
                 prefill.url if prefill is not None else "none (decode alone)", decode.url)
        return planned


class Attempts:
    """The attempts of one request: ``body`` (the client's, validated), ``stream``, ``rid`` (the
    router's id of it), its ``route``, ``deadline`` and ``started`` (its arrival)."""

    def __init__(self, state: RouterState, request: web.Request, body: dict, stream: bool, rid: str, route: Route,
                 deadline: float, started: float, endpoint: str):
        self.state, self.request, self.body, self.stream, self.rid = state, request, body, stream, rid
        self.route, self.deadline, self.started, self.endpoint = route, deadline, started, endpoint
        self.rooms: list[int] = []
        self.failed: dict[str, set] = {PREFILL: set(), DECODE: set()}  # workers that failed it, by role
        self.attempt: Optional[Attempt] = None  # the latest
        self.exchange: Optional[Exchange] = None  # the latest
        self.recorded = False  # the router's record of the request (state.recent) was started
        self.migrations = 0
        self.carried: Optional[Carried] = None  # the client's stream the next attempt continues
        self.continuation: Optional[dict] = None  # the next attempt's continuation field

    async def run(self, prefill: Optional[Worker], decode: Worker) -> web.StreamResponse:
        """Attempt until an exchange's answer is the request's; that answer (not yet sent)."""
        n = 0
        while True:
            self.attempt = self._attempt(n, prefill, decode)
            self._record(self.attempt)
            gate = RetryGate(self.state, n + 1, self.failed, self.deadline, self.rid)
            self.exchange = Exchange(self.state, self.request, self.attempt, gate, self.carried)
            try:
                response = await self.exchange.run()
            except Exception:  # a bug: the middleware answers 500; count it as what it is
                self.exchange.outcome, self.exchange.status = RouterOutcome.INTERNAL, 500
                raise
            following = await self.after(self.exchange, gate)
            if following is None:
                return response
            prefill, decode = following
            n += 1

    async def after(self, exchange: Exchange, gate: RetryGate) -> Optional[tuple[Optional[Worker], Worker]]:
        """The next attempt's (prefill or None, decode) after ``exchange``, or None: its answer is
        the request's. A retry on other workers, its decode worker alone after a prefill failure,
        or another decode worker alone after a decode lost (:meth:`_migrate`)."""
        if exchange.lost is not None and (exchange.track is not None or not exchange.stream):
            return await self._migrate(exchange)
        if exchange.retry is not None:
            again = await gate.next_attempt(self.route.key, self.route.tokens, self.route.one_worker)
            return None if again is None else (again[0], again[1])
        if exchange.fallback:
            self.state.metrics.pd_decisions.labels(decision="fallback").inc()
            return None, exchange.decode_worker
        return None

    async def _migrate(self, exchange: Exchange) -> Optional[tuple[None, Worker]]:
        """``exchange``'s decode was lost (:attr:`Exchange.lost`): the request goes on at another
        healthy decode worker alone, never one that failed it, within ``--max-migrations`` and its
        deadline (not charged to the retry budget): a stream under way continued from the ids the
        client has, else (nothing reached the client) the request sent again whole. Else the
        client's answer ends with the failure. A stream whose headers alone reached the client
        (decode lost before its first event) is sent again whole on the same client stream."""
        state, lost = self.state, exchange.lost
        self.failed[DECODE].add(exchange.decode_worker)
        under_way = exchange.stream and exchange.response is not None  # else nothing reached the client
        # headers only, no event passed: the client has no token, so the request goes again whole
        whole = not under_way or not exchange.track.passed
        continuation = None if whole else exchange.track.continuation()
        denied = "the request's own error" if lost.own_error else \
            "--max-migrations used up" if self.migrations >= state.config.max_migrations else \
            "its deadline passed" if asyncio.get_running_loop().time() >= self.deadline else \
            "nothing to continue from" if not whole and continuation is None else None
        decodes = state.workers.candidates(DECODE, self.failed) if denied is None else []
        if not decodes:
            log.info("rid=%s: %s (%s); not continued: %s", self.rid, lost.detail, lost.reason,
                     denied or "no other decode worker")
            await exchange.end_lost()
            return None
        decode = state.policies[DECODE].pick(decodes, self.route.key)
        self.migrations += 1
        state.metrics.migrations.labels(reason=lost.reason).inc()
        state.recent.retried(self.rid, DECODE, f"{lost.reason}: {lost.detail}; continued on {decode.url}")
        log.info("rid=%s: %s (%s); migration %d: continued on decode=%s", self.rid, lost.detail, lost.reason,
                 self.migrations, decode.url)
        if under_way:
            self.carried = Carried(exchange.response, exchange.times, exchange.track)
        self.continuation = continuation
        return None, decode

    def _attempt(self, n: int, prefill: Optional[Worker], decode: Worker) -> Attempt:
        """Attempt ``n``'s plan: split, a room never used before by this request; alone, no
        bootstrap fields (decode draws a room of its own)."""
        worker_rid = attempt_rid(self.rid, n)
        leg_body = {k: v for k, v in self.body.items() if k not in ROUTER_FIELDS}
        room = None
        if prefill is not None:
            room = _fresh_room(self.state, self.rooms)
            self.rooms.append(room)
            leg_body.update(bootstrap_host=prefill.host, bootstrap_port=prefill.bootstrap_port, bootstrap_room=room)
        if self.continuation is not None:
            leg_body["continuation"] = self.continuation
        if self.endpoint == "generate" or "rid" in leg_body:  # SGLang's field (the OpenAI routes take it too,
            leg_body["rid"] = worker_rid                       # else carry the id as X-Request-Id): this attempt's
        return Attempt(n, prefill, decode, room, worker_rid, leg_body, self.stream, self.deadline, self.started)

    def _record(self, a: Attempt) -> None:
        p_url = a.prefill.url if a.prefill is not None else None
        if a.n == 0:
            self.state.recent.start(self.rid, a.room, self.endpoint, p_url, a.decode.url, self.started)
            self.recorded = True
        else:
            self.state.recent.attempt(self.rid, a.room, a.rid, p_url, a.decode.url)
