"""One attempt of a request through the router: its two legs (or decode's alone), and the
answer built from them.

An :class:`Exchange` sends the body to both workers at once (plus the bootstrap fields), commits
to decode's answer when it may, ends decode's leg with the cause when prefill fails before it
accepted the room, and closes every leg still open whatever ends it. What follows a failed
exchange (another attempt, decode alone) is the caller's (``attempts.py``). The contract — when
the router commits, who owns a failure, what it waits on, its bounds — is ``docs/router.md``.

A failure the router answers itself is told to the client in words with the request id (what
failed: which role, how), its detail (the worker's address, the exception) to the log and the
request's record (:attr:`Exchange.detail`, ``outcomes.Refusal``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import aiohttp
from aiohttp import web

from splitserve.client_writer import ClientLost, ClientWriter
from splitserve.errors import error_body
from splitserve.router import retry
from splitserve.router.answers import LARGE_ANSWER_BYTES, SMALL_ANSWER_BYTES, read_answer
from splitserve.router.legs import Leg, NoHeaders, describe_error
from splitserve.router.metrics import TokenTimes
from splitserve.router.migrate import WORKER_FAILED_CODES, Lost, StreamTrack
from splitserve.router.outcomes import Refusal, RouterOutcome, client_left, for_client
from splitserve.router.state import RouterState
from splitserve.router.stream import DecodeStream, StreamStalled
from splitserve.router.workers import DECODE, PREFILL, Worker
from splitserve.validation import DEADLINE, MAX_DEADLINE_S, REQUEST_ID
from splitserve.discovery.record import loads_shallow

log = logging.getLogger(__name__)

PASS_HEADERS = ("Content-Type", "Cache-Control", "X-Accel-Buffering", "Retry-After")
ERROR_BODY_S = 10.0  # reading a worker's error body
ECHO_CODES = ("peer_failed", "peer_abort")  # one leg's error that only repeats what the other said
ECHO_STATUS = 502  # the status of an echo (Reason.PEER_FAILED)
ECHO_WAIT_S = 2.0  # how long the router then waits for the other leg's own answer
LINGER_S = 5.0  # a prefill leg still open this long after its exchange finished is closed


class Deadline(Exception):
    """``request_timeout_s`` passed."""


@dataclass(frozen=True)
class Attempt:
    """What one exchange runs: its workers (no prefill: decode alone), its room (None alone), the
    request id the workers get (``attempts.attempt_rid``), the body its legs carry, and the
    request's bounds."""

    n: int
    """0 for the first attempt."""
    prefill: Optional[Worker]
    decode: Worker
    room: Optional[int]
    rid: str
    body: dict
    stream: bool
    deadline: float
    started: float
    """When the client's request arrived (its time to first token counts from there)."""

    def legs(self) -> str:
        """The workers, for the request's log line."""
        p_url = self.prefill.url if self.prefill is not None else "-"
        return f" prefill={p_url} decode={self.decode.url}" + (f" attempt={self.n + 1}" if self.n else "")


class Carried(NamedTuple):
    """What a continuation's exchange takes over from the one whose decode was lost: the client's
    stream (already under way), what it saw (:class:`TokenTimes`), and the request's track."""

    response: web.StreamResponse
    times: TokenTimes
    track: StreamTrack


class Exchange:
    """The two legs of one request and the answer built from them (:meth:`run`); ``carried``: the
    client's stream this exchange continues (a continuation: decode alone, no prefill)."""

    def __init__(self, state: RouterState, request: web.Request, attempt: Attempt,
                 retry_gate: Optional[Callable[..., Optional[str]]] = None, carried: Optional[Carried] = None):
        self.state = state
        self.retry_gate = retry_gate
        self.config = state.config
        self.request = request
        self.attempt = attempt
        self.body, self.stream, self.room, self.rid = attempt.body, attempt.stream, attempt.room, attempt.rid
        self.prefill_worker, self.decode_worker = attempt.prefill, attempt.decode
        self.name = f"room {self.room}" if self.room is not None else f"request {self.rid} (decode alone)"  # logs
        self.deadline = attempt.deadline
        self.times = TokenTimes(attempt.started)  # what the client sees
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
        self.migrating = self.config.max_migrations > 0
        self.track: Optional[StreamTrack] = None  # decode's ids and what the client got (streams with ids)
        if carried is not None:
            self.response, self.times, self.track = carried.response, carried.times, carried.track
            self.status = carried.response.status
            self.track.new_stream()
        elif self.stream and self.migrating and request.path != "/generate":
            self.track = StreamTrack(self.body.get("n") or 1)
        self.lost: Optional[Lost] = None
        """Decode was lost after the client's answer began (or, a whole answer, after the leg was
        sent): whether the request goes on elsewhere is the caller's (``attempts.py``); if not,
        :meth:`end_lost` ends the client's answer."""
        self.client_rid: Optional[str] = request.get(REQUEST_ID)  # the id the client knows (proxy.py)
        self.detail: Optional[str] = None
        """The operator's account of the failure the router answered (the client reads words)."""

    def _refuse(self, refusal: Refusal) -> web.Response:
        """Answer with the router's own ``refusal``, counted as its outcome."""
        self.outcome, self.status = refusal.outcome, refusal.http_status
        self.detail = refusal.logged
        return refusal.response(self.client_rid)

    @staticmethod
    def clock() -> float:
        return asyncio.get_running_loop().time()

    def remaining(self) -> float:
        return max(0.0, self.deadline - self.clock())

    def _deadline_header(self) -> dict:
        """The request's remaining time, for a worker to refuse at once what it could not finish
        in it, and to end no later (``docs/router.md``, *Deadlines*)."""
        return {DEADLINE: f"{min(max(self.remaining(), 0.001), MAX_DEADLINE_S):.3f}"}

    async def run(self) -> web.StreamResponse:
        data = json.dumps(self.body, ensure_ascii=False).encode("utf-8")
        path = self.request.path
        bounds = dict(connect_timeout=min(self.config.worker_connect_timeout_s, self.config.request_timeout_s),
                      header_timeout=self.config.worker_header_timeout_s if self.stream else None,
                      headers={**({REQUEST_ID: self.rid} if self.rid else {}), **self._deadline_header()})
        session = self.state.session
        if self.prefill_worker is not None:  # else decode alone: no prefill leg (split.py)
            self.prefill = Leg(self.prefill_worker, session, path, data, **bounds)
        decode_data = data if self.track is None else \
            json.dumps({**self.body, "stream_ids": True}, ensure_ascii=False).encode("utf-8")
        self.decode = Leg(self.decode_worker, session, path, decode_data, **bounds)
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
                waiting.add(self._decode_stream().read())
            lost = await self._wait_or_lose(waiting)
            if lost is not None:
                return lost
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

    async def _wait(self, tasks: set, bound: Optional[float] = None) -> None:
        """Until one of ``tasks`` is done; :class:`Deadline` when the request's passes first, else
        :class:`StreamStalled` after ``bound`` seconds (if given)."""
        remaining = self.remaining()
        timeout = remaining if bound is None else min(remaining, bound)
        done, _ = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            raise Deadline() if bound is None or bound >= remaining else StreamStalled(
                f"said nothing for the router's stream_stall_s ({bound:g} s)")

    async def _wait_or_lose(self, tasks: set) -> Optional[web.Response]:
        """:meth:`_wait` before the commit; decode is watched meanwhile (when migrating): a stream
        that asked for ids (so decode keeps it alive with comments) is lost once it is silent for
        ``--stream-stall-s``, a whole answer, or a stream still waiting for decode's headers, once
        its worker has left rotation (its health checks failed)."""
        if self.stream and (self.decode.ok or self.track is None):
            bound = self.config.stream_stall_s if self.track is not None and self.decode.ok else None
            try:
                await self._wait(tasks, bound)
            except StreamStalled as exc:
                if self.response is not None:  # a continuation: the client's stream is under way
                    return await self._decode_broke_off("stalled", str(exc))
                return self._whole_lost("stalled", str(exc))
            return None
        if not self.migrating:
            await self._wait(tasks)
            return None
        waited_for = "its headers" if self.stream else "its answer"
        while True:
            try:
                await self._wait(tasks, self.config.health_interval_s)
                return None
            except StreamStalled:
                if not self.decode_worker.healthy:
                    detail = f"left rotation (its health checks failed) while the router waited for {waited_for}"
                    if self.response is not None:  # a continuation: the client's stream is under way
                        return await self._decode_broke_off("unhealthy", detail)
                    return self._whole_lost("unhealthy", detail)

    def _whole_lost(self, reason: str, detail: str) -> web.Response:
        """Decode's leg failed after it was sent, before anything reached the client (a whole
        answer, or a stream before its commit): the caller may send the request whole to another
        decode worker (:attr:`lost`); else the answer returned (the failure) is the client's."""
        self._abort_prefill()
        message = f"the decode worker {self.decode_worker.url} {detail}"
        self.lost = Lost(reason, message, b"")
        return self._refuse(Refusal(RouterOutcome.DECODE_FAILED, self.lost.message, detail=message))

    def _decode_stream(self) -> DecodeStream:
        if self.decode_stream is None:
            self.decode_stream = DecodeStream(self.decode.response, self._wait, self.track, self.config.stream_stall_s)
        return self.decode_stream

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
        """The OpenAI-style ``error.code`` of a leg's error body (read once: ``Leg.body``)."""
        try:
            async with asyncio.timeout(min(self.remaining(), ERROR_BODY_S)):  # not wait_for (router/legs.py)
                payload = await leg.body(SMALL_ANSWER_BYTES)
            code = loads_shallow(payload).get("error", {}).get("code")
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

    async def _decode_failed(self) -> web.StreamResponse:
        if self.response is not None:  # a continuation's leg: the client's stream is under way
            return await self._continuation_refused()
        if await self._prefill_has_the_cause():
            return await self._prefill_failed()  # as when prefill's answer comes first
        self._abort_prefill()  # nobody will come for its KV
        self.outcome = RouterOutcome.DECODE_FAILED
        if not self.stream and self.migrating and retry.cause(self.decode.error) == "gone":
            return self._whole_lost("broken", f"broke off before its answer: {describe_error(self.decode.error)}")
        self._may_retry(self.decode, DECODE)
        return await self._leg_error(self.decode, DECODE)

    async def _continuation_refused(self) -> web.StreamResponse:
        """A continuation's decode leg failed before its stream: lost as its worker's failure (it
        is unreachable, broke, or answered 5xx or 429), or the request's own (a 4xx), which ends
        the client's stream with that error."""
        leg = self.decode
        self.outcome = RouterOutcome.DECODE_FAILED
        if leg.error is not None or leg.response.status >= 500 or leg.response.status == 429:
            failure = describe_error(leg.error) if leg.error is not None else f"answered {leg.response.status}"
            self.lost = Lost("broken", f"the decode worker {leg.worker.url} refused the continuation: {failure}", b"")
            return self.response
        status, code = leg.response.status, await self._error_code(leg)
        leg.abort()
        self.detail = f"the decode worker {leg.worker.url} refused the continuation ({status}, {code})"
        log.warning("%s: %s", self.name, self.detail)
        await self._end_stream_with_error(f"the decode worker that was to continue the answer refused it "
                                          f"({status}, {str(code)[:64]})", status)
        return self.response

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
            detail = f"the {role} worker {leg.worker.url} failed: {describe_error(exc)}"
            log.warning("%s: %s", self.name, detail)
            return self._refuse(Refusal(self.outcome, leg_words(role, exc), status=504 if timed_out else None,
                                        code="worker_timeout" if isinstance(exc, NoHeaders) else None, detail=detail))
        resp = leg.response
        self.status = resp.status
        try:
            async with asyncio.timeout(min(self.remaining(), ERROR_BODY_S)):
                payload = await leg.body(SMALL_ANSWER_BYTES)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            detail = f"the {role} worker {leg.worker.url} answered {resp.status} and then failed: {describe_error(e)}"
            log.warning("%s: %s", self.name, detail)
            return self._refuse(Refusal(self.outcome, f"the {role} worker answered {resp.status} and then broke off "
                                        "its answer", status=resp.status, code="", detail=detail))
        finally:
            leg.abort()  # the body is read (or unreadable): close this connection too
        return web.Response(status=resp.status, body=payload, headers=_pass_headers(resp))

    async def _timed_out(self) -> web.StreamResponse:
        refusal = Refusal(RouterOutcome.TIMEOUT, f"the request took longer than the router's request_timeout_s "
                          f"({self.config.request_timeout_s:g} s)")
        self._close_legs()
        if self.response is None:
            return self._refuse(refusal)
        self.outcome, self.status, self.detail = refusal.outcome, refusal.http_status, refusal.logged
        await self._end_stream_with_error(refusal.message, refusal.http_status)
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
                payload = await read_answer(resp, LARGE_ANSWER_BYTES)
        except asyncio.TimeoutError:
            raise Deadline() from None
        except aiohttp.ClientError as exc:
            if self.migrating:
                return self._whole_lost("broken", f"broke off its answer: {describe_error(exc)}")
            self._abort_prefill()
            self._may_retry(self.decode, DECODE, exc)
            return self._refuse(Refusal(RouterOutcome.DECODE_FAILED, "the decode worker broke off the answer",
                                        detail=f"the decode worker {self.decode.worker.url} broke off its answer: "
                                               f"{describe_error(exc)}"))
        self.decode.release()
        self.outcome, self.status = RouterOutcome.FINISHED, resp.status
        return web.Response(status=resp.status, body=payload, headers=_pass_headers(resp))

    async def _stream_decode(self) -> web.StreamResponse:
        resp = self.decode.response
        decode_in = self._decode_stream()
        if decode_in.broke is not None and self.response is None:  # nothing reached the client: another decode may take it
            self._may_retry(self.decode, DECODE, decode_in.broke)
            if self.retry is not None:
                self._abort_prefill()
                return self._refuse(Refusal(RouterOutcome.DECODE_FAILED, "the decode worker broke off the answer",
                                            detail=f"the decode worker {self.decode.worker.url} broke off its "
                                                   f"stream: {describe_error(decode_in.broke)}"))
        if decode_in.failed:
            self._abort_prefill()  # decode decided first, and failed: nobody will come for prefill's KV
        elif self.prefill is not None and not self.prefill_handed_off:
            self._hand_off_prefill()
        if self.response is None:
            self.status = resp.status
            self.response = web.StreamResponse(status=resp.status, headers=_pass_headers(resp))
            await self.client.prepare(self.response)
        out = self.response
        try:
            async with contextlib.aclosing(decode_in.chunks()) as chunks:
                async for chunk in chunks:
                    if decode_in.watch.saw_error:
                        self._abort_prefill()  # decode failed: nobody will come for prefill's KV
                    await self.client.write(out, chunk)
                    self.times.feed(chunk, self.clock())
        except aiohttp.ClientError as exc:
            return await self._decode_broke_off("broken", describe_error(exc))
        except StreamStalled as exc:
            return await self._decode_broke_off("stalled", str(exc))
        self.decode.release()
        if not decode_in.watch.saw_done:
            return await self._decode_broke_off("broken", "its stream ended without data: [DONE]")
        track = self.track
        if track is not None and track.error_code in WORKER_FAILED_CODES:
            return await self._decode_broke_off("worker_error", f"ended its stream with error {track.error_code}")
        if track is not None:
            await self.client.write(out, track.held)  # the stream's end, held back until now
        self.outcome = RouterOutcome.DECODE_FAILED if decode_in.watch.saw_error else RouterOutcome.FINISHED
        await self.client.finish(out)
        return out

    async def _decode_broke_off(self, reason: str, why: str) -> web.StreamResponse:
        """Decode was lost after the commit. With a track the caller decides whether the stream
        goes on elsewhere (:attr:`lost`; else :meth:`end_lost`); without, it ends here."""
        self.outcome = RouterOutcome.DECODE_FAILED
        message = f"the decode worker {self.decode.worker.url} broke off its stream: {why}"
        self._close_legs()  # the abandoned leg is aborted
        track = self.track
        own = track is not None and track.error_code is not None and track.error_code not in WORKER_FAILED_CODES
        self.lost = Lost(reason, message, track.held if track is not None else b"", own_error=own)
        if self.track is None:
            await self.end_lost()
        return self.response

    async def end_lost(self) -> None:
        """The lost stream is not continued: the client gets decode's own error event and
        ``[DONE]`` if it sent them, else the router's error event."""
        lost = self.lost
        log.warning("%s: %s", self.name, lost.detail)
        self.detail = lost.detail
        if not self.stream or self.response is None:
            return  # a whole answer: the failure returned is the answer
        try:
            if lost.held:
                await self.client.write(self.response, lost.held)
            if lost.reason == "worker_error":  # its own [DONE] was among them
                await self.client.finish(self.response)
                return
        except ClientLost as exc:
            self.outcome = client_left(exc)
            return
        await self._end_stream_with_error(lost.message, 502, RouterOutcome.DECODE_FAILED.error_code)

    async def _end_stream_with_error(self, message: str, status: int, code: Optional[str] = None) -> None:
        """End the client's stream with the router's error event (``message``: words, to which the
        request id is added) and ``[DONE]``."""
        body = error_body(for_client(message, self.client_rid), status, code=code)
        event = "data: " + json.dumps(body, separators=(",", ":")) + "\n\n"
        if self.track is not None:
            event = self.track.end_block().decode() + event
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
                payload = await read_answer(resp, SMALL_ANSWER_BYTES)
            answer = loads_shallow(payload) if resp.status == 200 else {}
            if answer.get("found") or leg.answered or clock() + wait >= until:
                return
            await asyncio.sleep(wait)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError) as exc:
        log.info("%s: /abort_request for room %d failed: %s", leg.worker.describe(), room, describe_error(exc))
    finally:
        leg.abort()


def leg_words(role: str, error: BaseException) -> str:
    """What a client reads of a leg that failed before its headers with ``error``: words."""
    why = retry.cause(error)
    if why == "unreachable":
        return f"the {role} worker could not be reached"
    if isinstance(error, (NoHeaders, asyncio.TimeoutError)):
        return f"the {role} worker did not answer in time"
    return f"the {role} worker broke off the connection" if why == "gone" else f"the {role} worker failed"


def _pass_headers(resp: aiohttp.ClientResponse) -> dict:
    return {k: resp.headers[k] for k in PASS_HEADERS if k in resp.headers}
