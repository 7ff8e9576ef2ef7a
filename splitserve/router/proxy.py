"""One generation request through the router: one body, two legs, one answer.

The router sends the same JSON body (plus ``bootstrap_host``, ``bootstrap_port`` and a random
63-bit ``bootstrap_room``, the SGLang PD convention) to a prefill and a decode worker at once, and
answers the client with the decode worker's response. The prefill leg's body is never shown to the
client, but its status is: a prefill worker that refuses the request (429 queue full, 503
draining, 400) or cannot be reached means the decode worker would only wait for KV that never
comes, so the router closes the decode leg at once (a closed connection is a client abort to a
worker) and returns prefill's error. Unless prefill's error only echoes decode's: a room that
decode failed or aborted first fails on prefill with ``peer_failed`` / ``peer_abort``; then the
decode worker's own answer, which names the cause, is awaited (briefly) and returned instead.

When may the router commit to the decode worker's answer (send the client a status)?

- The decode leg answered an error (non-2xx) or could not be reached: that is the answer, passed
  through as is; the prefill leg is closed (nobody will come for its KV).
- Non-streaming: the decode worker's response arrives when generation is over, so it is passed on
  at once, whatever the prefill leg is doing.
- Streaming: a worker sends its SSE headers before the first token, so a 200 from decode says
  little. The router holds the client's headers until the prefill leg's status is known as well
  (a prefill worker answers its status when it accepts or refuses the request, so this costs no
  more than the time to first token). Then it copies decode's bytes through unchanged.

Once the prefill worker has accepted (2xx), its leg is read to its end and dropped in the
background (bounded by the request's deadline), so that the prefill worker records a normal end
rather than an abort, and its in-flight count drops when its work is done. Failures of the prefill
leg after that are the workers' business (each side learns of the other's failures over their
control channel; DESIGN.md rule 5), unless the exchange itself fails: then it is aborted too.

Whatever ends the exchange early — the client disconnecting (seen as the handler's cancellation or
as a failed write), ``request_timeout_s`` passing, the decode stream breaking off — every leg still
open is closed in the ``finally``, so both workers abort. A stream that breaks after its headers
were sent ends with ``data: {"error": ...}`` and ``data: [DONE]``, as the workers themselves do, so
that a truncated answer never looks complete.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from typing import Optional

import aiohttp
from aiohttp import web

from splitserve.engine.io import InvalidRequest
from splitserve.router.workers import DECODE, PREFILL, Worker
from splitserve.server.openai_protocol import engine_error_body, error_body
from splitserve.server.validation import parse_json_body, validate_request

log = logging.getLogger(__name__)

PASS_HEADERS = ("Content-Type", "Cache-Control", "X-Accel-Buffering", "Retry-After")
CONNECT_TIMEOUT_S = 10.0
ECHO_CODES = ("peer_failed", "peer_abort")  # a prefill error that only repeats what decode said
ECHO_WAIT_S = 2.0  # how long the router then waits for decode's own answer
ROOM_BITS = 63


class Leg:
    """One POST to one worker, started at once; ``task`` resolves when its headers arrive."""

    def __init__(self, worker: Worker, session: aiohttp.ClientSession, path: str, data: bytes,
                 connect_timeout: float):
        self.worker = worker
        self.response: Optional[aiohttp.ClientResponse] = None
        self._counted = True
        self.aborted = False
        worker.in_flight += 1
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, connect=connect_timeout)
        self.task = asyncio.ensure_future(self._post(session, worker.url + path, data, timeout))
        self.task.add_done_callback(_retrieve)

    async def _post(self, session, url: str, data: bytes, timeout) -> aiohttp.ClientResponse:
        resp = await session.post(url, data=data, headers={"Content-Type": "application/json"}, timeout=timeout,
                                  allow_redirects=False)
        self.response = resp
        return resp

    @property
    def answered(self) -> bool:
        return self.task.done()

    @property
    def error(self) -> Optional[BaseException]:
        """The exception that ended the leg before its headers (connection refused, reset ...)."""
        if not self.task.done():
            return None
        return asyncio.CancelledError() if self.task.cancelled() else self.task.exception()

    @property
    def ok(self) -> bool:
        return self.task.done() and self.error is None and 200 <= self.response.status < 300

    def abort(self) -> None:
        """Close the connection now: the worker sees its client go away and aborts the request."""
        self.aborted = self.aborted or self._counted  # closed before its end (not after release)
        if not self.task.done():
            self.task.cancel()
            self.task.add_done_callback(lambda t: self._close_response())
        self._close_response()
        self._uncount()

    def release(self) -> None:
        """The body was read to the end: give the connection back to the pool."""
        if self.response is not None:
            self.response.release()
        self._uncount()

    async def drain(self, timeout: float) -> None:
        """Wait for the headers and read the body to its end (dropped); abort if it takes longer than
        ``timeout``. Never raises, except for the caller's own cancellation (which aborts first)."""
        try:
            await asyncio.wait_for(self._read_all(), timeout)
        except asyncio.CancelledError:
            self.abort()
            raise
        except Exception as exc:
            if not self.aborted:  # not closed on purpose by the exchange
                log.info("%s: leg ended without its full answer: %s", self.worker.describe(), describe_error(exc))
            self.abort()
        else:
            self.release()

    async def _read_all(self) -> None:
        resp = await asyncio.shield(self.task)
        await resp.read()

    def _close_response(self) -> None:
        if self.response is not None:
            self.response.close()

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self.worker.in_flight -= 1


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # marks it retrieved: a failed leg is reported by the exchange, not by asyncio


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Deadline(Exception):
    """``request_timeout_s`` passed."""


class Exchange:
    """The two legs of one request and the answer built from them (:meth:`run`)."""

    def __init__(self, state, request: web.Request, body: dict, stream: bool, prefill: Worker, decode: Worker,
                 room: int, deadline: float):
        self.state = state
        self.request = request
        self.body = body
        self.stream = stream
        self.prefill_worker, self.decode_worker = prefill, decode
        self.room = room
        self.deadline = deadline
        self.prefill: Optional[Leg] = None
        self.decode: Optional[Leg] = None
        self.outcome = "client_disconnect"  # until known better: a cancellation is the client leaving
        self.status = 499
        self.prefill_handed_off = False
        self.response: Optional[web.StreamResponse] = None  # the client's response, once prepared

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    async def run(self) -> web.StreamResponse:
        data = json.dumps(self.body, ensure_ascii=False).encode("utf-8")
        path = self.request.path
        connect = min(CONNECT_TIMEOUT_S, self.state.config.request_timeout_s)
        session = self.state.session
        self.prefill = Leg(self.prefill_worker, session, path, data, connect)
        self.decode = Leg(self.decode_worker, session, path, data, connect)
        try:
            return await self._run()
        except Deadline:
            return await self._timed_out()
        finally:
            self._close_legs()

    async def _run(self) -> web.StreamResponse:
        p, d = self.prefill, self.decode
        while True:
            await self._wait({leg.task for leg in (p, d) if not leg.answered}, asyncio.FIRST_COMPLETED)
            if p.answered and not self.prefill_handed_off:  # prefill first: its failure is the cause
                if not p.ok and not await self._decode_has_the_cause():
                    return await self._prefill_failed()
                self._hand_off_prefill()
            if d.answered:
                if not d.ok:
                    return await self._decode_failed()
                if p.answered or not self.stream:  # streaming: decode's SSE headers say little yet
                    break
        if not self.prefill_handed_off:
            self._hand_off_prefill()
        if self.stream:
            return await self._stream_decode()
        return await self._unary_decode()

    async def _wait(self, tasks: set, when=asyncio.ALL_COMPLETED) -> None:
        done, _ = await asyncio.wait(tasks, timeout=self.remaining(), return_when=when)
        if not done or (when == asyncio.ALL_COMPLETED and len(done) < len(tasks)):
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

    async def _error_code(self, leg: "Leg") -> Optional[str]:
        """The OpenAI-style ``error.code`` of a leg's error body (read once; aiohttp keeps it)."""
        try:
            payload = await asyncio.wait_for(leg.response.read(), min(self.remaining(), CONNECT_TIMEOUT_S))
            code = json.loads(payload).get("error", {}).get("code")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            return None
        return code if isinstance(code, str) else None

    async def _prefill_failed(self) -> web.Response:
        self.decode.abort()  # at once: the decode worker must not wait for KV that will not come
        self.outcome = "prefill_failed"
        return await self._leg_error(self.prefill, PREFILL)

    async def _decode_failed(self) -> web.Response:
        self.prefill.abort()  # nobody will come for its KV
        self.outcome = "decode_failed"
        return await self._leg_error(self.decode, DECODE)

    async def _leg_error(self, leg: Leg, role: str) -> web.Response:
        exc = leg.error
        if exc is not None:
            status = 504 if isinstance(exc, asyncio.TimeoutError) else 502
            message = f"the {role} worker {leg.worker.url} failed: {describe_error(exc)}"
            log.warning("room %d: %s", self.room, message)
            self.status = status
            return web.json_response(error_body(message, status, code="worker_unreachable"), status=status)
        resp = leg.response
        self.status = resp.status
        try:
            payload = await asyncio.wait_for(resp.read(), min(self.remaining(), CONNECT_TIMEOUT_S))
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            message = f"the {role} worker {leg.worker.url} answered {resp.status} and then failed: {describe_error(e)}"
            return web.json_response(error_body(message, resp.status), status=resp.status)
        finally:
            leg.abort()  # the body is read (or unreadable): close this connection too
        return web.Response(status=resp.status, body=payload, headers=_pass_headers(resp))

    async def _timed_out(self) -> web.StreamResponse:
        self.outcome, self.status = "timeout", 504
        message = f"the request took longer than the router's request_timeout_s " \
                  f"({self.state.config.request_timeout_s:g} s)"
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
            payload = await asyncio.wait_for(resp.read(), self.remaining())
        except asyncio.TimeoutError:
            raise Deadline() from None
        except aiohttp.ClientError as exc:
            self.outcome, self.status = "decode_failed", 502
            message = f"the decode worker {self.decode.worker.url} broke off its answer: {describe_error(exc)}"
            return web.json_response(error_body(message, 502, code="worker_unreachable"), status=502)
        self.decode.release()
        self.outcome, self.status = "finished", resp.status
        return web.Response(status=resp.status, body=payload, headers=_pass_headers(resp))

    async def _stream_decode(self) -> web.StreamResponse:
        resp = self.decode.response
        self.status = resp.status
        out = web.StreamResponse(status=resp.status, headers=_pass_headers(resp))
        self.response = out
        sniffer = ErrorSniffer()
        if not await self._write(None):
            return out
        while True:
            try:
                chunk = await asyncio.wait_for(resp.content.readany(), self.remaining())
            except asyncio.TimeoutError:
                raise Deadline() from None
            except aiohttp.ClientError as exc:
                self.outcome = "decode_failed"
                message = f"the decode worker {self.decode.worker.url} broke off its stream: {describe_error(exc)}"
                log.warning("room %d: %s", self.room, message)
                self.decode.abort()
                await self._end_stream_with_error(message, 502)
                return out
            if not chunk:
                break
            sniffer.feed(chunk)
            if not await self._write(chunk):
                return out
        self.decode.release()
        self.outcome = "decode_failed" if sniffer.saw_error else "finished"
        try:
            await out.write_eof()
        except ConnectionError:
            self.outcome = "client_disconnect"
        return out

    async def _write(self, chunk: Optional[bytes]) -> bool:
        """Prepare (``chunk`` None) or write to the client; False if the client has gone."""
        transport = self.request.transport
        try:
            if transport is None or transport.is_closing():
                raise ConnectionResetError("the client closed the connection")
            if chunk is None:
                await self.response.prepare(self.request)
            else:
                await self.response.write(chunk)
            return True
        except ConnectionError:
            self.outcome = "client_disconnect"
            self._close_legs()
            return False

    async def _end_stream_with_error(self, message: str, status: int) -> None:
        event = "data: " + json.dumps(error_body(message, status), separators=(",", ":")) + "\n\n"
        try:
            if not self.response.prepared:
                await self.response.prepare(self.request)
            await self.response.write(event.encode("utf-8") + b"data: [DONE]\n\n")
            await self.response.write_eof()
        except ConnectionError:
            pass

    def _close_legs(self) -> None:
        """Abort every leg not finished (and the prefill leg unless it was handed off after a
        normal answer). Idempotent; never awaits, so it also runs on cancellation."""
        if self.decode is not None:
            self.decode.abort()  # a no-op after release()
        if self.prefill is not None and (not self.prefill_handed_off or self.outcome != "finished"):
            self.prefill.abort()


class ErrorSniffer:
    """Notices an SSE ``data: {"error": ...}`` event in a byte stream cut at arbitrary points (so
    that a stream the worker ended with an error is not counted as finished)."""

    def __init__(self):
        self._tail = b""
        self.saw_error = False

    def feed(self, chunk: bytes) -> None:
        if self.saw_error:
            return
        data = self._tail + chunk
        lines = data.split(b"\n")
        self._tail = lines.pop()[:64]  # only a line's start matters
        self.saw_error = any(line.startswith(b'data: {"error"') for line in lines)


def _pass_headers(resp: aiohttp.ClientResponse) -> dict:
    return {k: resp.headers[k] for k in PASS_HEADERS if k in resp.headers}


ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/generate": "generate"}


async def forward(state, request: web.Request) -> web.StreamResponse:
    """The handler body of every generation endpoint (``state`` is the app's RouterState)."""
    started = time.monotonic()
    endpoint = ENDPOINTS[request.path]
    metrics = state.metrics
    metrics.in_flight.inc()
    outcome, status, room, legs = "client_disconnect", 499, None, ""
    try:
        raw = await request.read()
        try:
            body = parse_json_body(raw)
            validated = validate_request(body, endpoint, served_model_name=state.workers.model_name())
        except InvalidRequest as exc:
            outcome, status = "bad_request", exc.status
            return web.json_response(engine_error_body(exc), status=exc.status)
        picked = state.pick_workers()
        if isinstance(picked, str):
            outcome, status = "no_workers", 503
            return web.json_response(error_body(picked, 503, code="no_healthy_workers"), status=503,
                                     headers={"Retry-After": "1"})
        prefill, decode = picked
        room = secrets.randbits(ROOM_BITS)
        legs = f" prefill={prefill.url} decode={decode.url}"
        body.update(bootstrap_host=prefill.host, bootstrap_port=prefill.bootstrap_port, bootstrap_room=room)
        exchange = Exchange(state, request, body, validated.stream, prefill, decode, room,
                            started + state.config.request_timeout_s)
        try:
            return await exchange.run()
        except Exception:  # a bug: the middleware answers 500; count it as what it is
            exchange.outcome, exchange.status = "internal", 500
            raise
        finally:
            outcome, status = exchange.outcome, exchange.status
    finally:
        metrics.in_flight.dec()
        seconds = time.monotonic() - started
        metrics.record(outcome, seconds)
        if room is not None:
            log.log(logging.ERROR if outcome == "internal" else logging.INFO, "room %d %s: %s (%s)%s %.3fs", room,
                    endpoint, outcome, status, legs, seconds)
