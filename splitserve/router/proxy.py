"""One generation request through the router: one body, two legs, one answer.

:func:`forward` is the handler body of every generation endpoint: it reads and validates the
request, picks a pair (or a decode worker alone, ``split.py``), and runs one :class:`Exchange` per
attempt, a new room each, while :class:`RetryGate` lets a failed leg be tried on another worker
(``retry.py``). An exchange sends the body to both workers at once (plus the bootstrap fields),
commits to decode's answer when it may, ends decode's leg with the cause when prefill fails before
it accepted the room, and closes every leg still open whatever ends it. The contract — when the
router commits, who owns a failure, what it waits on, its bounds — is ``docs/router.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from typing import Optional

import aiohttp
from aiohttp import web

from splitserve.client_writer import ClientLost, ClientWriter, send
from splitserve.errors import InvalidRequest, engine_error_body, error_body
from splitserve.router import retry, split
from splitserve.router.client import read_body
from splitserve.router.legs import Leg, NoHeaders, describe_error
from splitserve.router.metrics import TokenTimes
from splitserve.router.outcomes import RouterOutcome, client_left
from splitserve.router.policy import routing_key
from splitserve.router.stream import DecodeStream
from splitserve.router.workers import DECODE, PREFILL, Worker
from splitserve.validation import REQUEST_ID, check_request_id, parse_json_body, validate_request

log = logging.getLogger(__name__)

PASS_HEADERS = ("Content-Type", "Cache-Control", "X-Accel-Buffering", "Retry-After")
ERROR_BODY_S = 10.0  # reading a worker's error body
ECHO_CODES = ("peer_failed", "peer_abort")  # one leg's error that only repeats what the other said
ECHO_STATUS = 502  # the status of an echo (Reason.PEER_FAILED)
ECHO_WAIT_S = 2.0  # how long the router then waits for the other leg's own answer
LINGER_S = 5.0  # a prefill leg still open this long after its exchange finished is closed
ROOM_BITS = 63
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")  # the router's own, never a client's


class Deadline(Exception):
    """``request_timeout_s`` passed."""


class Exchange:
    """The two legs of one request and the answer built from them (:meth:`run`)."""

    def __init__(self, state, request: web.Request, body: dict, stream: bool, prefill: Optional[Worker],
                 decode: Worker, room: Optional[int], deadline: float, rid: str = "", started: Optional[float] = None,
                 retry_gate: Optional["RetryGate"] = None):
        self.state = state
        self.retry_gate = retry_gate
        self.config = state.config
        self.request = request
        self.body = body
        self.stream = stream
        self.prefill_worker, self.decode_worker = prefill, decode
        self.room = room
        self.name = f"room {room}" if room is not None else f"request {rid} (decode alone)"  # for log lines
        self.rid = rid
        self.deadline = deadline
        self.times = TokenTimes(self.clock() if started is None else started)  # what the client sees
        self.prefill: Optional[Leg] = None
        self.decode: Optional[Leg] = None
        self.outcome = RouterOutcome.CLIENT_DISCONNECT  # until known better: a cancellation is the client leaving
        self.status = 499
        self.prefill_handed_off = False
        self.client = ClientWriter(request, self.config.client_write_timeout_s)
        self.response: Optional[web.StreamResponse] = None  # the client's response, once prepared
        self.decode_stream: Optional[DecodeStream] = None  # decode's SSE body, once its headers came (streaming)
        self.retry: Optional[tuple[str, Worker, str]] = None
        """(role, worker, cause) when a leg failed before anything reached the client in a way that
        another worker of its role may be tried for (``retry.cause``) and ``retry_gate`` (the
        caller's rules: attempts, budget, deadline) let it: the answer returned is then not sent."""
        self.fallback = False
        """The prefill leg failed before prefill accepted the request, no retry was left, and the
        request goes to this exchange's decode worker alone (``split.py``): the answer is not sent."""

    @staticmethod
    def clock() -> float:
        return asyncio.get_running_loop().time()

    def remaining(self) -> float:
        return max(0.0, self.deadline - self.clock())

    async def run(self) -> web.StreamResponse:
        data = json.dumps(self.body, ensure_ascii=False).encode("utf-8")
        path = self.request.path
        bounds = dict(connect_timeout=min(self.config.worker_connect_timeout_s, self.config.request_timeout_s),
                      header_timeout=self.config.worker_header_timeout_s if self.stream else None,
                      headers={REQUEST_ID: self.rid} if self.rid else None)
        session = self.state.session
        if self.prefill_worker is not None:  # else decode alone: no prefill leg (split.py)
            self.prefill = Leg(self.prefill_worker, session, path, data, **bounds)
        self.decode = Leg(self.decode_worker, session, path, data, **bounds)
        try:
            return await self._run()
        except Deadline:
            return await self._timed_out()
        except ClientLost as exc:
            self.outcome = client_left(exc)
            log.info("%s: %s", self.name, exc)
            return self.response or web.Response(status=499)
        finally:
            self._close_legs()

    async def _run(self) -> web.StreamResponse:
        p, d = self.prefill, self.decode
        while not self._may_commit():
            waiting = {leg.task for leg in (p, d) if leg is not None and not leg.answered}
            if self.stream and d.ok:  # read decode's stream ahead meanwhile (see _may_commit)
                if self.decode_stream is None:
                    self.decode_stream = DecodeStream(d.response, self._wait)
                waiting.add(self.decode_stream.read())
            await self._wait(waiting)
            if p is not None and p.answered and not self.prefill_handed_off:  # prefill first: its failure is the cause
                if not p.ok and not await self._decode_has_the_cause():
                    return await self._prefill_failed()
                self._hand_off_prefill()
            if d.answered and not d.ok:
                return await self._decode_failed()
            if self.decode_stream is not None:
                self.decode_stream.keep()
        if self.stream:
            return await self._stream_decode()
        if self.prefill is not None and not self.prefill_handed_off:
            self._hand_off_prefill()
        return await self._unary_decode()

    def _may_commit(self) -> bool:
        """Whether the client's answer may begin. A stream waits for prefill's status (its failure
        is the cause) and for decode's first bytes: a stream that breaks before them reached the
        client may still go to another worker, decode alone too."""
        if not self.decode.ok:
            return False
        if not self.stream:
            return True
        ahead = self.decode_stream
        if ahead is not None and ahead.decided:
            return True
        return (self.prefill is None or self.prefill.answered) and ahead is not None and ahead.ahead_bytes > 0

    async def _wait(self, tasks: set) -> None:
        done, _ = await asyncio.wait(tasks, timeout=self.remaining(), return_when=asyncio.FIRST_COMPLETED)
        if not done:
            raise Deadline()

    # -- failures before the commit ----------------------------------------------------------------

    async def _decode_has_the_cause(self) -> bool:
        """Prefill failed because decode told it so (its error code says the peer failed or
        aborted): wait up to ``ECHO_WAIT_S`` for decode's own answer. True if it came."""
        if self.prefill.error is not None or await self._error_code(self.prefill) not in ECHO_CODES:
            return False
        if not self.decode.answered:
            await asyncio.wait({self.decode.task}, timeout=min(self.remaining(), ECHO_WAIT_S))
        return self.decode.answered

    async def _error_code(self, leg: Leg) -> Optional[str]:
        """The OpenAI-style ``error.code`` of a leg's error body (read once; aiohttp keeps it)."""
        try:
            async with asyncio.timeout(min(self.remaining(), ERROR_BODY_S)):  # not wait_for (router/legs.py)
                payload = await leg.response.read()
            code = json.loads(payload).get("error", {}).get("code")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            return None
        return code if isinstance(code, str) else None

    async def _prefill_failed(self) -> web.Response:
        """Prefill failed before it accepted the request (``docs/router.md``, who owns a failure):
        the router's to handle. Tried again with a new room, or sent to decode alone, or the
        failure is the answer; either way decode's leg is ended at once with that cause (not only
        closed, which would read as the client gone), for it must not wait for KV that will not come."""
        self.outcome = RouterOutcome.PREFILL_FAILED
        leg = self.prefill
        error = leg.error
        status = None if error is not None else leg.response.status
        why = retry.cause(error, status)
        echo = error is None and await self._error_code(leg) in ECHO_CODES  # decode failed first: not prefill's
        if self.retry_gate is not None and self.response is None and not echo:
            verdict = self.retry_gate(PREFILL, leg.worker, why, fallback=retry.fallback_cause(error, status))
            self.retry = (PREFILL, leg.worker, why) if verdict == "retry" else None
            self.fallback = verdict == "fallback"
        failure = describe_error(error) if error is not None else f"it answered {status}"
        then = ("the router tries again with a new room" if self.retry else
                "the router sends the request to a decode worker alone" if self.fallback else "the request failed")
        self._end_decode_leg(f"the prefill worker {leg.worker.url} failed before it accepted the request "
                             f"({failure}); {then}")
        return await self._leg_error(self.prefill, PREFILL)

    def _end_decode_leg(self, detail: str) -> None:
        """End decode's leg with its cause: ``POST /abort_request`` for the room (bounded), then the
        leg closed (which alone ends it, should the worker not have the room yet)."""
        leg = self.decode
        if leg is None or not leg.open or self.room is None:
            return
        self.decode = None  # the task below closes it
        self.state.spawn(abort_with_cause(self.state.session, leg, self.room, detail))

    async def _prefill_has_the_cause(self) -> bool:
        """Decode failed as when prefill told it so (it answered an echo's status): wait up to
        ``ECHO_WAIT_S`` for prefill's own answer, the one that names the cause (a transfer timeout is prefill's 504, not decode's 502 repeating it). True if
        prefill then answered an error. The mirror of :meth:`_decode_has_the_cause`, so the
        client's answer does not depend on which leg's answer reached the router first."""
        p, d = self.prefill, self.decode
        # decode's status, not its body, which may never come (the body is read after prefill's
        # leg is closed); 502 is what an echo answers (Reason.PEER_FAILED's status)
        if p is None or self.prefill_handed_off or d.error is not None or d.response.status != ECHO_STATUS:
            return False
        if not p.answered:
            await asyncio.wait({p.task}, timeout=min(self.remaining(), ECHO_WAIT_S))
        return p.answered and p.error is None and not p.ok and await self._error_code(p) not in ECHO_CODES

    async def _decode_failed(self) -> web.Response:
        if await self._prefill_has_the_cause():
            return await self._prefill_failed()  # as when prefill's answer comes first
        self._abort_prefill()  # nobody will come for its KV
        self.outcome = RouterOutcome.DECODE_FAILED
        self._may_retry(self.decode, DECODE)
        return await self._leg_error(self.decode, DECODE)

    def _abort_prefill(self) -> None:
        if self.prefill is not None:
            self.prefill.abort()

    def _may_retry(self, leg: Leg, role: str, error: Optional[BaseException] = None) -> None:
        """``leg`` failed: is the request to be tried again (:attr:`retry`)? Only if it failed in a
        way another worker may be tried for, before the client's answer began, and the gate agrees."""
        error = error if error is not None else leg.error
        why = retry.cause(error, None if error is not None else leg.response.status)
        if why is not None and self.response is None and self.retry_gate is not None \
                and self.retry_gate(role, leg.worker, why) == "retry":
            self.retry = (role, leg.worker, why)

    async def _leg_error(self, leg: Leg, role: str) -> web.Response:
        exc = leg.error
        if exc is not None:
            timed_out = isinstance(exc, (asyncio.TimeoutError, NoHeaders))
            status = 504 if timed_out else 502
            message = f"the {role} worker {leg.worker.url} failed: {describe_error(exc)}"
            log.warning("%s: %s", self.name, message)
            self.status = status
            code = "worker_timeout" if isinstance(exc, NoHeaders) else "worker_unreachable"
            return web.json_response(error_body(message, status, code=code), status=status)
        resp = leg.response
        self.status = resp.status
        try:
            async with asyncio.timeout(min(self.remaining(), ERROR_BODY_S)):
                payload = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            message = f"the {role} worker {leg.worker.url} answered {resp.status} and then failed: {describe_error(e)}"
            return web.json_response(error_body(message, resp.status), status=resp.status)
        finally:
            leg.abort()  # the body is read (or unreadable): close this connection too
        return web.Response(status=resp.status, body=payload, headers=_pass_headers(resp))

    async def _timed_out(self) -> web.StreamResponse:
        self.outcome, self.status = RouterOutcome.TIMEOUT, 504
        message = f"the request took longer than the router's request_timeout_s " \
                  f"({self.config.request_timeout_s:g} s)"
        self._close_legs()
        if self.response is None:
            return web.json_response(error_body(message, 504, code="timeout"), status=504)
        await self._end_stream_with_error(message, 504)
        return self.response

    # -- the commit --------------------------------------------------------------------------------

    def _hand_off_prefill(self) -> None:
        """Prefill accepted the request (or decode answered first): read the prefill leg to its end
        in the background, so the prefill worker sees a normal end. It is still aborted if the
        exchange does not finish normally (see :meth:`_close_legs`)."""
        self.prefill_handed_off = True
        self.state.spawn(self.prefill.drain(self.remaining()))

    async def _unary_decode(self) -> web.Response:
        resp = self.decode.response
        try:
            async with asyncio.timeout(self.remaining()):
                payload = await resp.read()
        except asyncio.TimeoutError:
            raise Deadline() from None
        except aiohttp.ClientError as exc:
            self._abort_prefill()
            self.outcome, self.status = RouterOutcome.DECODE_FAILED, 502
            self._may_retry(self.decode, DECODE, exc)
            message = f"the decode worker {self.decode.worker.url} broke off its answer: {describe_error(exc)}"
            return web.json_response(error_body(message, 502, code="worker_unreachable"), status=502)
        self.decode.release()
        self.outcome, self.status = RouterOutcome.FINISHED, resp.status
        return web.Response(status=resp.status, body=payload, headers=_pass_headers(resp))

    async def _stream_decode(self) -> web.StreamResponse:
        resp = self.decode.response
        if self.decode_stream is None:
            self.decode_stream = DecodeStream(resp, self._wait)
        decode_in = self.decode_stream
        if decode_in.broke is not None:  # before anything reached the client: another decode may take it
            self._may_retry(self.decode, DECODE, decode_in.broke)
            if self.retry is not None:
                self._abort_prefill()
                self.outcome, self.status = RouterOutcome.DECODE_FAILED, 502
                message = f"the decode worker {self.decode.worker.url} broke off its stream: " \
                          f"{describe_error(decode_in.broke)}"
                return web.json_response(error_body(message, 502, code="worker_unreachable"), status=502)
        if decode_in.failed:
            self._abort_prefill()  # decode decided first, and failed: nobody will come for prefill's KV
        elif self.prefill is not None and not self.prefill_handed_off:
            self._hand_off_prefill()
        self.status = resp.status
        out = web.StreamResponse(status=resp.status, headers=_pass_headers(resp))
        self.response = out
        await self.client.prepare(out)
        try:
            async with contextlib.aclosing(decode_in.chunks()) as chunks:
                async for chunk in chunks:
                    if decode_in.watch.saw_error:
                        self._abort_prefill()  # decode failed: nobody will come for prefill's KV
                    await self.client.write(out, chunk)
                    self.times.feed(chunk, self.clock())
        except aiohttp.ClientError as exc:
            return await self._decode_broke_off(describe_error(exc))
        self.decode.release()
        if not decode_in.watch.saw_done:
            return await self._decode_broke_off("its stream ended without data: [DONE]")
        self.outcome = RouterOutcome.DECODE_FAILED if decode_in.watch.saw_error else RouterOutcome.FINISHED
        await self.client.finish(out)
        return out

    async def _decode_broke_off(self, why: str) -> web.StreamResponse:
        self.outcome = RouterOutcome.DECODE_FAILED
        message = f"the decode worker {self.decode.worker.url} broke off its stream: {why}"
        log.warning("%s: %s", self.name, message)
        self._close_legs()
        await self._end_stream_with_error(message, 502)
        return self.response

    async def _end_stream_with_error(self, message: str, status: int) -> None:
        event = "data: " + json.dumps(error_body(message, status), separators=(",", ":")) + "\n\n"
        try:
            if not self.response.prepared:
                await self.client.prepare(self.response)
            await self.client.write(self.response, event.encode("utf-8") + b"data: [DONE]\n\n")
            await self.client.finish(self.response)
        except ClientLost as exc:  # the client had gone: counted as its leaving, not as the failure
            self.outcome = client_left(exc)
            log.info("%s: the error event did not reach the client: %s", self.name, exc)

    def _close_legs(self) -> None:
        """Abort every leg not finished (and the prefill leg unless it was handed off after a
        normal answer, which then gets :data:`LINGER_S` to end). Idempotent; never awaits, so it
        also runs on cancellation."""
        if self.decode_stream is not None:
            self.decode_stream.cancel()
        if self.decode is not None:
            self.decode.abort()  # a no-op after release()
        if self.prefill is not None:
            if self.prefill_handed_off and self.outcome is RouterOutcome.FINISHED:
                self.prefill.abort_after(LINGER_S)
            else:
                self.prefill.abort()


ABORT_CAUSE_S = 2.0  # POST /abort_request, before the leg is closed anyway
JSON_HEADERS = {"Content-Type": "application/json"}
ABORT_AGAIN_S = (0.05, 0.1, 0.2, 0.4)  # asked again after these while decode has not seen the room


async def abort_with_cause(session: aiohttp.ClientSession, leg: Leg, room: int, detail: str) -> None:
    """End a decode leg whose KV will not come, saying why (``POST /abort_request`` for its room:
    decode's log line for the room then names the cause, not only a client gone), then close it.
    A decode worker that has not taken the room yet (both legs were sent at once) is asked again
    a few times; all bounded by :data:`ABORT_CAUSE_S`, after which the leg is closed anyway, which
    ends the room as a client's abort."""
    data = json.dumps({"bootstrap_room": room, "reason": "client_abort", "detail": detail[:256]}).encode("utf-8")
    clock = asyncio.get_running_loop().time
    until = clock() + ABORT_CAUSE_S
    try:
        for wait in ABORT_AGAIN_S:  # the legs went out together: decode may not have taken the room yet
            async with session.post(leg.worker.url + "/abort_request", data=data, headers=JSON_HEADERS,
                                    timeout=aiohttp.ClientTimeout(total=max(0.1, until - clock()))) as resp:
                payload = await resp.read()
            answer = json.loads(payload) if resp.status == 200 else {}
            if answer.get("found") or leg.answered or clock() + wait >= until:
                return
            await asyncio.sleep(wait)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError) as exc:
        log.info("%s: /abort_request for room %d failed: %s", leg.worker.describe(), room, describe_error(exc))
    finally:
        leg.abort()


def attempt_rid(rid: str, attempt: int) -> str:
    """The request id a worker gets for attempt ``attempt`` (0 first) of request ``rid``: ``rid``
    itself, then ``rid~N`` (cut to 256 characters): a worker may still hold the id of an attempt
    that was closed a moment ago, and would refuse the same id again while it does."""
    if attempt == 0:
        return rid
    suffix = f"~{attempt}"
    return rid[:256 - len(suffix)] + suffix


def _fresh_room(state, used: list[int]) -> int:
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

    def __init__(self, state, n: int, failed: dict, deadline: float, rid: str):
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

    async def next_attempt(self, key: str, tokens: int, one_worker: bool = False):
        """After the backoff, the next attempt's (prefill or None, decode, decision) by
        ``RouterState.plan``, none of them a worker that failed; None if none is in rotation by then."""
        await asyncio.sleep(self.delay)
        planned = self.state.plan(key, tokens, exclude=self.failed, retrying=True, one_worker=one_worker)
        if isinstance(planned, str):
            self.state.metrics.retries_denied.labels(reason="no_other_worker").inc()
            return None
        prefill, decode, _ = planned
        log.info("rid=%s: retry %d (the %s leg failed) on prefill=%s decode=%s", self.rid, self.n, self.role,
                 prefill.url if prefill is not None else "none (decode alone)", decode.url)
        return planned


def _pass_headers(resp: aiohttp.ClientResponse) -> dict:
    return {k: resp.headers[k] for k in PASS_HEADERS if k in resp.headers}


ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/generate": "generate"}


async def forward(state, request: web.Request) -> web.StreamResponse:
    """The handler body of every generation endpoint (``state`` is the app's RouterState). Every
    answer is sent here, bounded — a refusal as the exchange's — so that a client that had gone
    before it could take it is counted as leaving (``client_disconnect`` / ``client_timeout``),
    never as the failure it was not there to see; so is a cancellation of the handler (aiohttp's
    sign that the client's connection was lost), whatever the exchange was doing then."""
    clock = asyncio.get_running_loop().time
    started = clock()
    endpoint = ENDPOINTS[request.path]
    config = state.config
    metrics = state.metrics
    metrics.in_flight.inc()
    outcome, status, room, legs, rid, exchange = RouterOutcome.CLIENT_DISCONNECT, 499, None, "", None, None
    recorded = False  # the router's record of the request (state.recent) was started
    try:
        try:
            raw = await read_body(request, config.client_body_timeout_s, config.max_body_bytes)
        except ClientLost as exc:
            outcome, status = client_left(exc), 408
            response = web.json_response(error_body(str(exc), 408, code="client_timeout"), status=408)
            response.force_close()
            return response
        except web.HTTPException as exc:  # 413: over the size limit
            outcome, status = RouterOutcome.BAD_REQUEST, exc.status
            raise
        try:
            body = parse_json_body(raw)
            validated = validate_request(body, endpoint, served_model_name=state.workers.model_name())
            rid = validated.rid or check_request_id(request.headers.get(REQUEST_ID), REQUEST_ID) or uuid.uuid4().hex
        except InvalidRequest as exc:
            outcome, status = RouterOutcome.BAD_REQUEST, exc.status
            response = web.json_response(engine_error_body(exc), status=exc.status)
            outcome = client_left(await send(request, response, config.client_write_timeout_s)) or outcome
            return response
        key = routing_key(validated)
        tokens = split.estimate_tokens(key, validated.prompt_ids, config.pd_chars_per_token)
        one_worker = split.one_worker(validated.sampling)  # e.g. lm-eval's prompt logprobs: decode alone
        planned = state.plan(key, tokens, one_worker=one_worker)
        if isinstance(planned, str):
            outcome, status = RouterOutcome.NO_WORKERS, 503
            response = web.json_response(error_body(planned, 503, code="no_healthy_workers"), status=503,
                                         headers={"Retry-After": "1"})
            outcome = client_left(await send(request, response, config.client_write_timeout_s)) or outcome
            return response
        prefill, decode, decision = planned
        metrics.pd_decisions.labels(decision=decision).inc()
        request[REQUEST_ID] = rid  # echoed to the client (app.py)
        deadline = started + config.request_timeout_s
        state.retry_budget.request(clock())
        rooms: list[int] = []
        failed: dict[str, set] = {PREFILL: set(), DECODE: set()}  # workers that failed this request, by role
        attempt = 0
        while True:
            worker_rid = attempt_rid(rid, attempt)
            leg_body = {k: v for k, v in body.items() if k not in BOOTSTRAP_FIELDS}
            if prefill is not None:  # split: both legs, a room never used before by this request
                room = _fresh_room(state, rooms)
                rooms.append(room)
                leg_body.update(bootstrap_host=prefill.host, bootstrap_port=prefill.bootstrap_port, bootstrap_room=room)
            else:  # decode alone: no bootstrap fields (decode draws a room of its own)
                room = None
            if endpoint == "generate" or "rid" in leg_body:  # SGLang's field (the OpenAI routes take it too,
                leg_body["rid"] = worker_rid                  # else carry the id as X-Request-Id): this attempt's
            p_url = prefill.url if prefill is not None else None
            legs = f" prefill={p_url or '-'} decode={decode.url}" + (f" attempt={attempt + 1}" if attempt else "")
            if attempt == 0:
                state.recent.start(rid, room, endpoint, p_url, decode.url, started)
                recorded = True
            else:
                state.recent.attempt(rid, room, worker_rid, p_url, decode.url)
            gate = RetryGate(state, attempt + 1, failed, deadline, rid)
            exchange = Exchange(state, request, leg_body, validated.stream, prefill, decode, room, deadline,
                                worker_rid, started, gate)
            try:
                response = await exchange.run()
            except Exception:  # a bug: the middleware answers 500; count it as what it is
                exchange.outcome, exchange.status = RouterOutcome.INTERNAL, 500
                raise
            finally:
                outcome, status = exchange.outcome, exchange.status
            attempt += 1
            if exchange.retry is not None:
                again = await gate.next_attempt(key, tokens, one_worker)
                if again is None:
                    break
                prefill, decode, _ = again
            elif exchange.fallback:
                metrics.pd_decisions.labels(decision="fallback").inc()
                prefill = None  # the same decode worker, alone
            else:
                break
        outcome = client_left(await send(request, response, config.client_write_timeout_s)) or outcome
        return response
    except asyncio.CancelledError:
        outcome = RouterOutcome.CLIENT_DISCONNECT
        raise
    finally:
        metrics.in_flight.dec()
        seconds = clock() - started
        times = exchange.times if exchange is not None else None
        metrics.record(outcome, seconds, endpoint, times)
        if recorded:
            state.recent.end(rid, outcome.value, status, seconds, times.ttft if times is not None else None)
            log.log(logging.ERROR if outcome is RouterOutcome.INTERNAL else logging.INFO,
                    "room %s %s rid=%s: %s (%s)%s %.3fs", room if room is not None else "- (decode alone)", endpoint,
                    rid, outcome.value, status, legs, seconds)
