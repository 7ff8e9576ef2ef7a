"""One generation request through the router: one body, two legs, one answer.

:func:`forward` is the handler body of every generation endpoint: it reads and validates the
request, picks a pair (or a decode worker alone, ``split.py``), and runs its :class:`Attempts
<splitserve.router.attempts.Attempts>`: one :class:`Exchange <splitserve.router.exchange.Exchange>`
per attempt, a new room each, while a retry gate lets a failed leg be tried on another worker
(``retry.py``). The contract — when the router commits, who owns a failure, what it waits on, its
bounds — is ``docs/router.md``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Optional

from aiohttp import web

from splitserve.client_writer import ClientLost, send
from splitserve.errors import InvalidRequest, engine_error_body
from splitserve.log_sparsely import worth_logging
from splitserve.router import split
from splitserve.router.attempts import Attempts, Route
from splitserve.router.outcomes import Refusal, RouterOutcome, client_left
from splitserve.router.policy import routing_key
from splitserve.router.client import read_body
from splitserve.router.state import RouterState
from splitserve.validation import (
    REQUEST_ID, RequestContext, check_request_id, one_header, parse_json_body, validate_request,
)

log = logging.getLogger(__name__)

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/generate": "generate"}


class _Answered(Exception):
    """The request was answered before any attempt (a refusal, the client gone): ``response``,
    counted as ``outcome`` with ``status``; ``send``: sent here, bounded (else returned to aiohttp,
    as when the client's body never came whole and its connection is to be closed)."""

    def __init__(self, response: web.StreamResponse, outcome: RouterOutcome, status: int, send: bool = True):
        super().__init__(outcome.value)
        self.response, self.outcome, self.status, self.send = response, outcome, status, send


async def forward(state: RouterState, request: web.Request) -> web.StreamResponse:
    """The handler body of every generation endpoint (``state``: the app's). Every
    answer is sent here, bounded — a refusal as the exchange's — so that a client that had gone
    before it could take it is counted as leaving (``client_disconnect`` / ``client_timeout``),
    never as the failure it was not there to see; so is a cancellation of the handler (aiohttp's
    sign that the client's connection was lost), whatever the exchange was doing then."""
    clock = asyncio.get_running_loop().time
    started = clock()
    endpoint = ENDPOINTS[request.path]
    state.metrics.in_flight.inc()
    outcome, status, attempts = RouterOutcome.CLIENT_DISCONNECT, 499, None
    try:
        try:
            attempts, prefill, decode = await _admit(state, request, endpoint, started)
        except _Answered as answered:
            outcome, status = answered.outcome, answered.status
            if not answered.send:
                return answered.response
            outcome = client_left(await send(request, answered.response, state.config.client_write_timeout_s)) \
                or outcome
            return answered.response
        except web.HTTPException as exc:  # 413: over the size limit
            outcome, status = RouterOutcome.BAD_REQUEST, exc.status
            raise
        try:
            response = await attempts.run(prefill, decode)
        finally:
            if attempts.exchange is not None:
                outcome, status = attempts.exchange.outcome, attempts.exchange.status
        outcome = client_left(await send(request, response, state.config.client_write_timeout_s)) or outcome
        return response
    except asyncio.CancelledError:
        outcome = RouterOutcome.CLIENT_DISCONNECT
        raise
    finally:
        state.metrics.in_flight.dec()
        _record(state, attempts, outcome, status, endpoint, clock() - started)


async def _admit(state: RouterState, request: web.Request, endpoint: str, started: float):
    """The request read, validated and planned: its (attempts, prefill or None, decode); else
    :class:`_Answered` with the refusal."""
    config = state.config
    try:
        raw = await read_body(request, config.client_body_timeout_s, config.max_body_bytes)
    except ClientLost as exc:
        response = Refusal(RouterOutcome.CLIENT_TIMEOUT, str(exc)).response()
        response.force_close()
        raise _Answered(response, client_left(exc), 408, send=False) from None
    try:
        body = parse_json_body(raw)
        validated = validate_request(body, endpoint, RequestContext(served_model_name=state.workers.model_name()))
        rid = validated.rid or check_request_id(one_header(request.headers, REQUEST_ID), REQUEST_ID) or uuid.uuid4().hex
    except InvalidRequest as exc:
        raise _Answered(web.json_response(engine_error_body(exc), status=exc.status), RouterOutcome.BAD_REQUEST,
                        exc.status) from None
    request[REQUEST_ID] = rid  # echoed to the client (app.py)
    key = routing_key(validated)
    route = Route(key, split.estimate_tokens(key, validated.prompt_ids, config.pd_chars_per_token),
                  split.one_worker(validated.sampling))  # e.g. lm-eval's prompt logprobs: decode alone
    planned = state.plan(route.key, route.tokens, one_worker=route.one_worker)
    if isinstance(planned, Refusal):
        state.refusals += 1
        if worth_logging(state.refusals):  # the client reads words; the workers and their states are here
            log.warning("rid=%s refused %d: %s", rid, planned.http_status, planned.logged)
        raise _Answered(planned.response(rid), planned.outcome, planned.http_status)
    prefill, decode, decision = planned
    state.metrics.pd_decisions.labels(decision=decision).inc()
    state.retry_budget.request(asyncio.get_running_loop().time())
    attempts = Attempts(state, request, body, validated.stream, rid, route, started + config.request_timeout_s,
                        started, endpoint)
    return attempts, prefill, decode


def _record(state: RouterState, attempts: Optional[Attempts], outcome: RouterOutcome, status: int, endpoint: str,
            seconds: float) -> None:
    """The request's one count, its record's end and its log line."""
    exchange = attempts.exchange if attempts is not None else None
    times = exchange.times if exchange is not None else None
    state.metrics.record(outcome, seconds, endpoint, times)
    if attempts is None or not attempts.recorded:
        return
    a = attempts.attempt
    detail = exchange.detail if exchange is not None else None  # what the client read only in words
    state.recent.end(attempts.rid, outcome.value, status, seconds, times.ttft if times is not None else None,
                     detail)
    log.log(logging.ERROR if outcome is RouterOutcome.INTERNAL else logging.INFO,
            "room %s %s rid=%s: %s (%s)%s %.3fs%s", a.room if a.room is not None else "- (decode alone)", endpoint,
            attempts.rid, outcome.value, status, a.legs(), seconds, f": {detail}" if detail else "")
