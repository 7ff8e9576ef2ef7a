"""Small helpers shared by the worker's and the router's HTTP servers: the URL they serve, the cap
on the connections they hold (``docs/security.md``), and OpenAI error bodies for the requests
aiohttp refuses before any app sees them (:func:`json_http_errors`)."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from typing import Callable, Optional

from aiohttp import hdrs, http_exceptions, web, web_urldispatcher

from splitserve.errors import error_body

log = logging.getLogger(__name__)


def bound_url(runner: web.AppRunner, host: str, port: int, tls: bool = False) -> str:
    """The base URL a client on this host can use: the port actually bound (differs from the
    configured one with ``--port 0``), loopback for a wildcard host, https with ``tls``."""
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            port = addr[1]
            break
    host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    host = f"[{host}]" if ":" in host else host
    return f"{'https' if tls else 'http'}://{host}:{port}"


REFUSED_LINGER_S = 1.0  # a refused connection is closed this long after its 503 (time to read it)


class ConnectionCap:
    """At most ``limit`` connections open at once (``--max-connections``). :meth:`install` after
    ``runner.setup()``: past the limit the newest connection gets a 503 with an OpenAI error body
    and ``Connection: close`` at once, before anything of it is read (it never reaches the app),
    is counted, and is closed :data:`REFUSED_LINGER_S` later; those already open are untouched.
    Metrics on ``registry``: ``splitserve_http_connections`` (open now) and
    ``splitserve_http_connections_refused_total``."""

    def __init__(self, limit: int, registry):
        if limit < 1:
            raise ValueError(f"--max-connections must be at least 1, not {limit}")
        self.limit = limit
        self.admitted: set = set()
        self.refused = registry.counter("splitserve_http_connections_refused_total",
                                        "Connections refused 503 at once: --max-connections were open.")
        registry.derived_gauge("splitserve_http_connections", "Client connections open now.",
                               read=lambda: len(self.admitted))

    def install(self, runner: web.AppRunner) -> None:
        server = runner.server
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler, transport) -> None:
            made(handler, transport)
            if len(self.admitted) < self.limit:
                self.admitted.add(handler)
            else:
                self._refuse(transport)

        def connection_lost(handler, exc) -> None:
            self.admitted.discard(handler)
            lost(handler, exc)

        server.connection_made, server.connection_lost = connection_made, connection_lost

    def _refuse(self, transport: asyncio.Transport) -> None:
        self.refused.inc()
        transport.pause_reading()  # the handler never sees a request on it
        body = json.dumps(error_body(f"this server has {self.limit} connections open (its --max-connections): "
                                     "try again later", 503, code="too_many_connections")).encode()
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                        b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        asyncio.get_running_loop().call_later(REFUSED_LINGER_S, transport.abort)


def body_too_large(limit: int) -> web.HTTPRequestEntityTooLarge:
    """The 413 for a body over ``--max-body-bytes``, naming the option."""
    return web.HTTPRequestEntityTooLarge(
        max_size=limit, actual_size=limit + 1,
        text=f"the request body is larger than this server's --max-body-bytes ({limit} bytes)")


def body_unreadable(request: web.Request) -> web.HTTPBadRequest:
    """The 400 for a body aiohttp could not decode after its headers were taken (a Content-Encoding
    that does not decode, a chunk that breaks the encoding): the client's fault, never a 500. The
    connection is closed after the answer: the rest of that body cannot be read to find the next
    request (aiohttp would try, and log the same error again at ERROR with its traceback)."""
    request.content.feed_eof()  # the body is over: aiohttp reads no more of it after the answer
    request.protocol.close()  # and the connection ends once the answer is sent
    return web.HTTPBadRequest(text="the request's body could not be read: its Content-Encoding or chunked "
                                   "encoding is malformed")


async def read_body(request: web.Request, timeout: float, limit: int) -> bytes:
    """The whole request body within ``timeout`` seconds (else 408) and within ``limit`` bytes (the
    app's ``client_max_size``; else 413), each answer naming its option; a body that cannot be
    decoded is a 400 (``body_unreadable``)."""
    try:  # not wait_for: on Python 3.11 it drops a cancellation that comes as the body completes
        async with asyncio.timeout(timeout):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise body_too_large(limit) from None
    except web.RequestPayloadError:
        raise body_unreadable(request) from None
    except TimeoutError:
        raise web.HTTPRequestTimeout(text=f"the request body did not arrive within this server's "
                                          f"--client-body-timeout-s ({timeout:g} s)") from None


def check_client_bounds(config) -> None:
    """ValueError unless ``config``'s caps and client bounds (those it has) are positive."""
    for name in ("max_body_bytes", "max_connections", "client_header_timeout_s", "client_body_timeout_s",
                 "client_write_timeout_s"):
        value = getattr(config, name, 1)
        if not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, not {value}")


# What a client reads of a request aiohttp's parser refused (first match by class): words and a
# code, never the parser's own text (it echoes the client's bytes, and names the library).
_REFUSALS = (
    (http_exceptions.LineTooLong, "the request line or a header line is longer than this server accepts "
                                  "({limit} bytes)", "header_too_large"),
    (http_exceptions.BadStatusLine, "the request line is malformed (method, target, HTTP version)",
     "malformed_request_line"),
    (http_exceptions.InvalidURLError, "the request's target (its URL) is malformed", "malformed_request_line"),
    (http_exceptions.InvalidHeader, "a header of the request is malformed", "malformed_header"),
    (http_exceptions.PayloadEncodingError, "the request's body is malformed (its chunked encoding, Content-Length "
                                           "or Content-Encoding)", "malformed_body"),
    (http_exceptions.BadHttpMessage, "the request is not well-formed HTTP (a malformed header, too many headers, "
                                     "or a malformed Content-Length or chunked body)", "malformed_request"),
)
_BY_STATUS = {500: "internal error in this server", 504: "the server took too long to answer"}


class JsonErrors(web.RequestHandler):
    """aiohttp's connection handler whose own error answers (a request its parser refused, a
    handler that failed outside every middleware) are OpenAI error bodies, same status, instead of
    aiohttp's plain text. aiohttp has no supported hook for these answers: ``handle_error`` is the
    public method it calls for them, kept whole for a 5xx (its log line with the traceback, its
    refusal when an answer has begun, the connection closed after) with only the body replaced. A
    4xx (a client's malformed request) is logged as one line at debug, not aiohttp's traceback at
    ERROR: any client could write one per connection into the log, with its bytes in the
    exception's text. :func:`json_http_errors` makes a server's connections of this class."""

    __slots__ = ()

    def handle_error(self, request, status: int = 500, exc: Optional[BaseException] = None,
                     message: Optional[str] = None) -> web.StreamResponse:
        if status >= 500:
            super().handle_error(request, status, exc, message)  # logged; raises if an answer was begun
        else:
            self.logger.debug("refused a malformed request from %s (%s, %d)", request.remote,
                              type(exc).__name__, status)
            if request.writer.output_size > 0:  # as aiohttp: an answer has begun, the connection is broken
                raise ConnectionError("an answer was sent already: no error answer can follow it")
        words, code = _BY_STATUS.get(status, "the request could not be read"), None
        for kind, said, named in _REFUSALS:
            if isinstance(exc, kind):
                words, code = said.format(limit=max(self.max_line_size, self.max_field_size)), named
                break
        answer = web.json_response(error_body(words, status, code=code), status=status)
        answer.force_close()
        return answer


HANDLE_ERROR_PARAMETERS = ("self", "request", "status", "exc", "message")
"""``RequestHandler.handle_error``'s parameters in the pinned aiohttp, which :class:`JsonErrors`
overrides: another aiohttp that changes them is refused at start (``tests/test_http_edge_errors.py``)."""


def json_http_errors(runner: web.AppRunner) -> None:
    """After ``runner.setup()``: every connection of ``runner``'s server is a :class:`JsonErrors`.
    aiohttp's server builds a plain ``RequestHandler`` for each connection and offers no class to
    choose; the one place a connection is seen before its first byte is read is
    ``Server.connection_made`` (as :class:`ConnectionCap` uses it), where its class becomes
    :class:`JsonErrors` (the same slots, a method more). An aiohttp whose handler or
    ``handle_error`` differs from the pinned one keeps its plain-text answers, logged once."""
    names = tuple(inspect.signature(web.RequestHandler.handle_error).parameters)
    if names != HANDLE_ERROR_PARAMETERS:
        log.warning("aiohttp's RequestHandler.handle_error takes %s, not %s: its own error answers stay plain "
                    "text", names, HANDLE_ERROR_PARAMETERS)
        return
    server = runner.server
    made = server.connection_made

    def connection_made(handler, transport) -> None:
        if type(handler) is web.RequestHandler:
            handler.__class__ = JsonErrors
        made(handler, transport)

    server.connection_made = connection_made


_AIOHTTP_EXPECT = web_urldispatcher._default_expect_handler  # what expect_continue hands 100-continue to


async def expect_continue(request: web.Request) -> None:
    """An ``Expect`` header's answer, before any middleware: ``100-continue`` as aiohttp answers
    it; any other value a 417 with an OpenAI body that repeats nothing of it (aiohttp's own answer
    echoes the value into plain text, and a value that is not UTF-8 made that a 500)."""
    if request.headers.get(hdrs.EXPECT, "").lower() == "100-continue" or request.version != (1, 1):
        return await _AIOHTTP_EXPECT(request)
    body = error_body("the request's Expect header asks for what this server does not do (only 100-continue)",
                      417, code="expectation_failed")
    raise web.HTTPExpectationFailed(text=json.dumps(body), content_type="application/json")


def answer_expect_in_json() -> None:
    """Every route made after this call, and every 404/405 (made per request), answers ``Expect``
    through :func:`expect_continue`. aiohttp takes a handler per route only, and none for the
    routes it makes for 404 and 405: its module's default is the one place; a pinned aiohttp whose
    default takes other parameters keeps its own (logged once). Each app calls it before adding
    routes (idempotent)."""
    names = tuple(inspect.signature(_AIOHTTP_EXPECT).parameters)
    if names != ("request",):
        log.warning("aiohttp's default Expect handler takes %s: its plain-text 417 stays", names)
        return
    web_urldispatcher._default_expect_handler = expect_continue
