"""Serving one generation request (``/v1/completions``, ``/v1/chat/completions``, ``/generate``).

The path of a request: refuse it at once if the worker is not accepting (503); read and validate
the body off the event loop, in the lane for its size (``tokenize_lanes.py``: tokenizing a long
prompt must stall neither other streams nor short requests); submit it
to the engine (which may refuse: 429 with ``Retry-After``, 503, 400); then either wait for the
whole answer or stream it as server-sent events.

Every request ends in exactly one of three ways, counted once in ``splitserve_requests_total`` and
logged in one line: ``finished`` (reason stop/length), ``aborted`` (the client went away), or
``failed`` (reason from the error). Whatever way the handler is left (normal return, client
disconnect seen as a failed write or as the handler's cancellation, or a bug) the ``finally``
aborts the engine request if it has not finished, so its KV pages are freed.

An errored request never looks like a success: without streaming it answers with the error's HTTP
status and an OpenAI error body; when streaming has begun it sends ``data: {"error": ...}`` and
then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from aiohttp import web

from splitserve.auth import bootstrap_refusal, router_fields_refusal
from splitserve.engine.continuation import replay
from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.engine.io import EngineError, InvalidRequest, NotReady, RequestOutput
from splitserve.hosts import allow_host
from splitserve.http_util import read_body
from splitserve.outcomes import Reason
from splitserve.server import openai_protocol as proto
from splitserve.server import tool_calls
from splitserve.server.sse import ClientGone, SSEWriter
from splitserve.validation import (
    DEADLINE, REQUEST_ID, RequestContext, ValidatedRequest, check_deadline, check_request_id, one_header,
    validate_request,
)

RID = web.RequestKey("rid", str)
"""Where a generation request keeps its id for the answer's ``X-Request-Id`` header (``app.py``)."""

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
KEEPALIVE_S = 5.0
"""With ``stream_ids`` (the router's), a stream quiet this long gets a ``: keepalive`` comment."""
RELEASE_TIMEOUT_S = 5.0
FINISHED_BY = {"stop": Reason.STOP, "length": Reason.LENGTH, "prefill_done": Reason.TRANSFERRED}


@dataclass
class Result:
    """How the request ended, as counted: ``outcome`` (finished | aborted | failed) and the
    reason's name, both from :class:`~splitserve.outcomes.Reason`."""

    outcome: str = "failed"
    reason: str = Reason.INTERNAL_ERROR.value

    def ended(self, reason: Reason) -> None:
        self.outcome, self.reason = reason.outcome.value.lower(), reason.value

    def refused_by_http(self, status: int) -> None:
        """An HTTP error raised before the engine saw the request (e.g. 413 for a body too large)."""
        self.ended(Reason.BAD_REQUEST if 400 <= status < 500 else Reason.INTERNAL_ERROR)


def json_error(message: str, status: int, param: Optional[str] = None, code: Optional[str] = None,
               headers: Optional[dict] = None) -> web.Response:
    return web.json_response(proto.error_body(message, status, param, code), status=status, headers=headers)


def engine_error_response(exc: EngineError) -> web.Response:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status in (429, 503) else None
    return web.json_response(proto.engine_error_body(exc), status=exc.status, headers=headers)


def _own_hosts(config) -> set[str]:
    """The hosts a request may name this worker by, as ``hosts.allow_host`` writes them."""
    return {allow_host(h) for h in (config.host, config.advertise_host, "127.0.0.1", "localhost", "::1") if h}


async def serve_generation(state, request: web.Request, endpoint: str) -> web.StreamResponse:
    """The handler body for one generation endpoint; ``state`` is the app's WorkerState."""
    started = time.monotonic()
    result = Result()
    acc = proto.Accumulator()
    rid = None
    submitted = False  # the engine took the request (a prefill/decode worker's lifecycle counts it)
    state.metrics.http_inflight.inc()
    try:
        if not state.accepting():
            exc = NotReady("the server is draining" if state.draining else "the server is not ready")
            result.ended(exc.reason)
            return engine_error_response(exc)
        try:
            raw = await read_body(request, state.config.client_body_timeout_s, state.config.max_body_bytes)
            engine = state.engine
            spec = engine.spec
            known = RequestContext(served_model_name=state.model_name, max_context=spec.max_context,
                                   vocab_size=spec.vocab_size, generation_defaults=spec.generation_defaults,
                                   grammars=state.grammars)
            req: ValidatedRequest = await state.tokenize.validate(  # in its lane, the grammar off it (tokenize_lanes.py)
                len(raw), engine.tokenizer, lambda tok, per: validate_request(
                    raw, endpoint, dataclasses.replace(known, tokenizer=tok, chars_per_token=per)), state.grammars)
            refusal = _bootstrap_refusal(state, request, req)
            if refusal is not None:  # whom decode would dial and hand its KV pool: docs/security.md
                result.ended(Reason.BAD_REQUEST)
                return json_error(refusal, 403, param="bootstrap_host", code="bootstrap_not_allowed")
            refusal = router_fields_refusal(request, req.stream_ids, req.continuation is not None)
            if refusal is not None:
                result.ended(Reason.BAD_REQUEST)
                return json_error(refusal, 403, param="continuation" if req.continuation else "stream_ids",
                                  code="router_field_not_allowed")
            rid = req.rid or check_request_id(one_header(request.headers, REQUEST_ID), REQUEST_ID) or uuid.uuid4().hex
            rid = req.continuation.rid if req.continuation is not None else rid  # the answer's id goes on
            request[RID] = rid  # echoed in the answer's X-Request-Id header (app.py)
            deadline_s = check_deadline(one_header(request.headers, DEADLINE))  # the router's: it only shortens ours
            stream = engine.submit(dataclasses.replace(req.generate_request(rid), deadline_s=deadline_s))
            submitted = True
        except EngineError as exc:
            result.ended(exc.reason)
            if exc.status >= 500:
                log.warning("request %s refused: %s", rid, exc)
            return engine_error_response(exc)
        if req.stream:
            return await _stream(state, request, endpoint, req, rid, stream, acc, result, started)
        return await _unary(state, endpoint, req, rid, stream, acc, result, started)
    except asyncio.CancelledError:
        result.ended(Reason.CLIENT_ABORT)
        raise
    except web.HTTPException as exc:  # e.g. 413 from reading an oversized body
        result.refused_by_http(exc.status)
        raise
    finally:
        state.metrics.http_inflight.dec()
        seconds = time.monotonic() - started
        ttft = acc.first_token_at - started if acc.first_token_at is not None else None
        state.metrics.record(endpoint, result.outcome, result.reason, seconds, acc.prompt_tokens,
                             acc.total_completion_tokens, ttft, submitted=submitted, gaps=acc.token_gaps)
        if rid is not None:  # one line per request that passed validation (the others are counted only)
            timeline = getattr(state.engine, "timeline_short", lambda rid: "-")(rid)
            log.info("request %s %s: %s (%s) prompt=%d completion=%d %.3fs timeline: %s", rid, endpoint,
                     result.outcome, result.reason, acc.prompt_tokens, acc.total_completion_tokens, seconds, timeline)


def _bootstrap_refusal(state, request: web.Request, req: ValidatedRequest) -> Optional[str]:
    """Why this caller may not send these bootstrap fields (a 403), or None; NotReady for a leg
    meant for the role this worker no longer has (a router that has not seen a switch yet), and
    InvalidRequest for a split request's fields given in part."""
    refusal = bootstrap_refusal(request, req.bootstrap_host, req.bootstrap_port, req.bootstrap_room,
                                state.config.role, state.allowed_prefill)
    if refusal is not None:
        return refusal
    if (state.config.role == "prefill" and req.bootstrap_port is not None
            and req.bootstrap_port != state.config.bootstrap_port):
        # a decode leg from a router that has not yet seen this worker switch to prefill (POST
        # /role): taken as a prefill room it would wait for a registration that never comes
        raise NotReady(f"this worker is a prefill now (bootstrap port {state.config.bootstrap_port}); the "
                       f"request names bootstrap port {req.bootstrap_port}: a decode leg")
    if (state.config.role == "decode" and state.epoch > 0 and req.bootstrap_port == state.config.bootstrap_port
            and req.bootstrap_host is not None and allow_host(req.bootstrap_host) in _own_hosts(state.config)):
        # the mirror: a prefill leg naming this worker's own bootstrap port, from a router that has
        # not yet seen it switch back to decode (only a worker that was a prefill, epoch > 0)
        raise NotReady(f"this worker is a decode now; the request names its own bootstrap port "
                       f"{req.bootstrap_port}: a prefill leg")
    given = [f for f in ("bootstrap_host", "bootstrap_port", "bootstrap_room") if getattr(req, f) is not None]
    if req.continuation is not None:
        _continuation_refusal(state.config.role, given)
    if state.config.role == "decode" and 0 < len(given) < 3:  # alone has none: a split request has all
        raise InvalidRequest(f"{', '.join(given)} without the other bootstrap fields: a split request names "
                             "bootstrap_host, bootstrap_port and bootstrap_room, one served by decode alone "
                             "none of them", param="bootstrap_room")
    return None


def _continuation_refusal(role: Optional[str], bootstrap: list) -> None:
    """A continuation is served by a decode (or colocated) worker alone: NotReady on a prefill
    (a router that has not seen this worker switch), InvalidRequest beside bootstrap fields."""
    if role == "prefill":
        raise NotReady("this worker is a prefill; a continuation is served by a decode")
    if bootstrap:
        raise InvalidRequest(f"continuation is served by decode alone: not with {', '.join(bootstrap)}",
                             param="continuation")


async def _consume(stream: AsyncIterator[Optional[RequestOutput]], acc: proto.Accumulator, sse=None):
    """Yield the engine's deltas, adding each to ``acc``, up to the last one; a None from
    :func:`_keepalive` becomes a ``: keepalive`` comment on ``sse``."""
    async for out in stream:
        if out is None:
            await sse.comment("keepalive")
            continue
        acc.add(out)
        yield out
        if out.finished:
            return


async def _keepalive(stream: AsyncIterator[RequestOutput], every: float) -> AsyncIterator[Optional[RequestOutput]]:
    """``stream``'s deltas, with a None whenever ``every`` seconds pass without one (a router
    bounds a stream's silence: a request queued or prefilling is not silent)."""
    it = aiter(stream)
    pending: Optional[asyncio.Task] = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                out = task.result()
            except StopAsyncIteration:
                return
            yield out
    finally:
        if pending is not None:
            pending.cancel()


async def _release(state, rid: str, stream, acc: proto.Accumulator) -> None:
    """Called whenever a handler is left: if the request has not ended, abort it and read its
    stream to the end (the abort's error delta), so the engine drops it even if we never started
    iterating; then close the stream."""
    if not acc.done:
        state.engine.abort(rid)

        async def to_the_end():
            async for out in stream:
                if out.finished:
                    return

        try:
            async with asyncio.timeout(RELEASE_TIMEOUT_S):  # not wait_for: it can lose a cancellation
                await to_the_end()
        except (asyncio.TimeoutError, RuntimeError, StopAsyncIteration):
            log.warning("request %s: no end from the engine %.0fs after its abort", rid, RELEASE_TIMEOUT_S)
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except RuntimeError:  # already running or closed
            pass


def _error_of(acc: proto.Accumulator) -> dict:
    if acc.error is None:
        return proto.error_body("the engine ended the request without an answer", 500)
    return proto.ended_error_body(acc.error)


def _finish(result: Result, acc: proto.Accumulator) -> Optional[int]:
    """Set the outcome from the accumulated answer; the HTTP status of a failure, else None."""
    if acc.error is not None:
        result.ended(acc.error.reason or Reason.INTERNAL_ERROR)
        return acc.error.status
    if not acc.done or acc.finish_reason is None:  # the stream ended without a last delta: a bug, never a success
        result.ended(Reason.INTERNAL_ERROR)
        return 500
    result.ended(FINISHED_BY.get(acc.finish_reason, Reason.STOP))
    return None


@functools.lru_cache(maxsize=4)
def token_strings(tokenizer) -> proto.TokenStrings:
    """The token texts of a worker's tokenizer, for logprobs (one cache per tokenizer)."""
    return proto.TokenStrings(tokenizer)


def _echo(state, req: ValidatedRequest) -> Optional[tuple[str, list[int]]]:
    """What an ``echo`` answer starts with: the prompt's text (as sent, or its ids decoded) and ids."""
    if not req.echo:
        return None
    text = req.prompt_text if req.prompt_text is not None else state.engine.tokenizer.decode(list(req.prompt_ids))
    return text, list(req.prompt_ids)


def _prompt_of(req: ValidatedRequest) -> Optional[tuple[list[int], int]]:
    """``/generate``: the prompt's ids and ``logprob_start_len`` when its logprobs were asked for."""
    return (list(req.prompt_ids), req.logprob_start_len) if req.logprob_start_len >= 0 else None


def _strings(state, req: ValidatedRequest) -> Optional[proto.TokenStrings]:
    """Token texts for the answer's logprobs; None when the request asked for none (or, on
    ``/generate``, for no texts in them)."""
    if req.sampling.logprobs is None or (req.endpoint == "generate" and not req.return_text_in_logprobs):
        return None
    return token_strings(state.engine.tokenizer)


def _tool_names(req: ValidatedRequest) -> Optional[frozenset]:
    """The functions whose calls a chat answer is parsed for; None: no parsing."""
    return req.tools.names if req.tools is not None and req.tools.parses else None


async def _unary(state, endpoint: str, req: ValidatedRequest, rid: str, stream, acc: proto.Accumulator,
                 result: Result, started: float) -> web.Response:
    try:
        async for _ in _consume(stream, acc):
            pass
    finally:
        await _release(state, rid, stream, acc)
    status = _finish(result, acc)
    if status is not None:
        return web.json_response(_error_of(acc), status=status)
    model, created = state.model_name, int(time.time())
    strings = _strings(state, req)
    if endpoint == "completions":
        body = proto.completion_response(rid, model, created, acc, strings, _echo(state, req))
    elif endpoint == "chat":
        body = proto.chat_response(rid, model, created, acc, strings, _tool_names(req))
    else:
        body = proto.generate_responses(rid, acc, started, req.sampling.logprobs is not None, strings,
                                        _prompt_of(req), req.sampling.n)
    return web.json_response(body)


class _Chunks:
    """The SSE events of one streamed request, built from the engine's deltas: per choice, the
    tokens whose logprobs were sent (the rest ride with its next chunk with text), the text offset
    of its next token's logprobs (completions), its echo (sent with its first chunk) and its
    tool-call parser (chat with tools)."""

    def __init__(self, state, endpoint: str, req: ValidatedRequest, rid: str, acc: proto.Accumulator,
                 started: float):
        self.endpoint, self.req, self.rid, self.acc, self.started = endpoint, req, rid, acc, started
        self.model, self.created = state.model_name, int(time.time())
        self.strings = _strings(state, req)
        n = self.n = req.sampling.n
        self.sent, self.offset = [0] * n, [0] * n
        self.echo = [_echo(state, req)] * n
        names = _tool_names(req) if endpoint == "chat" else None
        self.parsers = [tool_calls.ToolCallParser(names) for _ in range(n)] if names is not None else None
        self.listed = [0] * n  # per choice: its tokens named in an ``: ids`` line
        if req.continuation is not None:
            self._resume(state.engine.tokenizer, req.continuation)

    def _resume(self, tokenizer, cont) -> None:
        """A continuation: the client has the answer up to the given ids, so nothing is echoed, the
        chunks carry the client's ``created``, each choice's logprobs' text offset and tool-call
        parser start where the client's stream left them; usage counts the finished choices."""
        self.created, self.echo = cont.created, [None] * self.n
        req, acc = self.req, self.acc
        acc.prompt_tokens, acc.carried = len(req.prompt_ids), cont.finished_tokens
        if all(index for index, _ in cont.choices):
            acc.finish_reason = "stop"  # choice 0 ended on the lost worker: this answer has no more of it
        for index, ids in cont.choices:
            if self.strings is not None and self.endpoint == "completions":
                shown = (list(req.prompt_ids) if req.echo else []) + list(ids)
                self.offset[index] = sum(len(self.strings.text(t)) for t in shown)
            if self.parsers is not None:
                detok = IncrementalDetokenizer(tokenizer, list(req.prompt_ids), req.sampling.stop, req.stop_matcher)
                for text in replay(detok, ids):
                    if text:
                        self.parsers[index].feed(text)

    def ids_line(self, index: int) -> Optional[str]:
        """With ``stream_ids``: the comment naming the tokens of choice ``index`` not named yet
        (sent with the event that carries their text), else None."""
        if not self.req.stream_ids:
            return None
        ids = self.acc.choice(index).token_ids[self.listed[index]:]
        self.listed[index] += len(ids)
        return f"ids {index} " + " ".join(map(str, ids)) if ids else None

    def first(self) -> list[dict]:
        """Before any delta: chat's role chunk of each choice (a continuation's client has it)."""
        if self.endpoint != "chat" or self.req.continuation is not None:
            return []
        return [proto.chat_chunk(self.rid, self.model, self.created, {"role": "assistant", "content": ""}, None,
                                 index=i) for i in range(self.n)]

    def of(self, out: RequestOutput) -> list[dict]:
        """The events one delta makes (none when it carries nothing to send yet)."""
        if self.endpoint == "generate":
            if out.token_ids or out.text or out.finished or out.finish_reason is not None:
                return [proto.generate_chunk(self.rid, self.acc, self.started, self.req.sampling.logprobs is not None,
                                             self.strings, _prompt_of(self.req),
                                             index=out.index if self.n > 1 else None)]
            return []
        if not (out.text or out.finish_reason is not None or self.echo[out.index] is not None):
            return []
        i, c = out.index, self.acc.choice(out.index)
        reason = c.finish_reason if out.finish_reason is not None or out.finished else None
        logprobs, text = None, out.text
        ids, lps = c.token_ids[self.sent[i]:], list(c.logprobs[self.sent[i]:])
        self.sent[i] = len(c.token_ids)
        if self.echo[i] is not None:  # the choice's first chunk starts with the prompt
            text, ids, lps = self.echo[i][0] + text, self.echo[i][1] + ids, list(self.acc.prompt_logprobs) + lps
            self.echo[i] = None
        if self.strings is not None:
            if self.endpoint == "chat":
                logprobs = proto.chat_logprobs(self.strings, ids, lps)
            else:
                logprobs = proto.completion_logprobs(self.strings, ids, lps, self.offset[i])
                self.offset[i] += sum(len(t) for t in logprobs["tokens"])
        if self.endpoint != "chat":
            return [proto.completion_chunk(self.rid, self.model, self.created, text, reason, logprobs, index=i)]
        return self._chat(i, text, reason, logprobs)

    def _chat(self, i: int, text: str, reason: Optional[str], logprobs: Optional[dict]) -> list[dict]:
        """Chat: the text becomes content, and with tools, tool-call deltas."""
        if self.parsers is None:
            delta = {"content": text} if text else {}
            return [proto.chat_chunk(self.rid, self.model, self.created, delta, reason, logprobs, index=i)]
        parser = self.parsers[i]
        deltas = parser.feed(text) if text else []
        if reason is not None:
            deltas += parser.finish()
            reason = tool_calls.finish_reason(reason, parser)
        if not deltas and (reason is not None or logprobs is not None):
            deltas = [{}]
        return [proto.chat_chunk(self.rid, self.model, self.created, delta, reason if k == len(deltas) - 1 else None,
                                 logprobs if k == 0 else None, index=i) for k, delta in enumerate(deltas)]


async def _stream(state, request: web.Request, endpoint: str, req: ValidatedRequest, rid: str, stream,
                  acc: proto.Accumulator, result: Result, started: float) -> web.StreamResponse:
    sse = SSEWriter(request, state.config.client_write_timeout_s)
    chunks = _Chunks(state, endpoint, req, rid, acc, started)
    model, created = chunks.model, chunks.created
    fault = getattr(getattr(getattr(state.engine, "role", None), "faults", None), "tokens", None)
    try:
        await sse.start()
        for event in chunks.first():
            await sse.send(event)
        quiet = _keepalive(stream, KEEPALIVE_S) if req.stream_ids else stream
        async for out in _consume(quiet, acc, sse):
            if out.finished and out.error is not None:
                break
            events = chunks.of(out)
            await sse.send_all(events, chunks.ids_line(out.index) if events else None)
            if fault is not None and events:  # --inject-faults kill|pause_after_tokens: off unless set
                fault.streamed(rid, len(acc.choice(out.index).token_ids))
        status = _finish(result, acc)
        if status is not None:
            await sse.send(_error_of(acc))
        elif req.include_usage:
            await sse.send(proto.usage_chunk(endpoint, rid, model, created, acc))
        await sse.done()
    except ClientGone as exc:
        result.ended(Reason.CLIENT_ABORT)
        if exc.args:  # it stopped reading (rather than closed the connection)
            log.info("request %s: %s; aborted", rid, exc)
    except asyncio.CancelledError:
        raise
    except Exception:  # a bug while streaming fails this request only
        log.exception("request %s: error while streaming", rid)
        result.ended(Reason.INTERNAL_ERROR)
        try:
            await sse.send(proto.error_body(proto.internal_error_text(rid), 500, code=Reason.INTERNAL_ERROR.value))
            await sse.done()
        except ClientGone:
            pass
    finally:
        await _release(state, rid, stream, acc)
    return sse.response
