"""Simulated HTTP: the router's client session to the workers, and the requests the real aiohttp
handlers are called with, on both sides.

The handlers are the real ones: the router's ``forward`` (``router/proxy.py``) and the worker's
``serve_generation``, ``/health`` and ``/v1/models`` (``server/``). What is simulated is the wire
between them: :class:`Session` stands for the router's ``aiohttp.ClientSession`` (``post`` /
``get`` start the worker's handler on a :func:`request` of its own and resolve with a
:class:`Response` when it sends its headers; the body follows chunk by chunk, each after the
link's latency); closing a response early closes the connection and cancels the worker's handler,
as aiohttp's ``handler_cancellation`` does; a killed worker's connections break
(``ServerDisconnectedError``, or a payload error mid-body). :func:`serve` is what aiohttp's server
does with one request (the app's own handler, then the answer sent); :func:`findings` is an
innermost middleware that reports an exception escaping a handler; :class:`Sink` is what a handler
writes its response into.

HTTP is reliable here apart from kills: the seed's partitions cut the control and transfer
links between workers, not the router's connections.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from typing import Callable, Optional
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from aiohttp.http import HttpVersion11, RawRequestMessage
from aiohttp.web_urldispatcher import UrlMappingMatchInfo
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from splitserve.sim.asyncio_internals import handle, with_match_info

LATENCY_S = 0.0003


class Transport:
    """A connection's end as a handler sees it (``request.transport``)."""

    def __init__(self, on_close: Optional[Callable[[], None]] = None):
        self.closing = False
        self._on_close = on_close

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            if self._on_close is not None:
                self._on_close()

    abort = close

    def get_extra_info(self, name, default=None):
        return default


class _Protocol:
    ssl_context = None
    peername = None
    sockname = None

    def __init__(self, transport: Transport):
        self.transport = transport

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class _Payload:
    """A request body that has all arrived."""

    def __init__(self, body: bytes):
        self._parts = [body] if body else []

    async def readany(self) -> bytes:
        return self._parts.pop() if self._parts else b""

    def set_read_chunk_size(self, n: int) -> None:
        pass

    def at_eof(self) -> bool:
        return not self._parts

    is_eof = at_eof


_JSON = CIMultiDictProxy(CIMultiDict({"Content-Type": "application/json"}))
_APP = web.Application()


def request(method: str, path: str, body: bytes, writer: "Sink", transport: Transport, loop,
            app: Optional[web.Application] = None) -> web.Request:
    """A ``web.Request`` as aiohttp hands it to a handler (built the way ``aiohttp.test_utils``
    builds its mocked requests, without the mocks)."""
    message = RawRequestMessage(method, path, HttpVersion11, _JSON, (), False, None, False, False, URL(path))
    req = web.Request(message, _Payload(body), _Protocol(transport), writer, None, loop)
    match_info = UrlMappingMatchInfo({}, None)
    match_info.add_app(app or _APP)
    return with_match_info(req, match_info)


def findings(report: Callable[[str], None]):
    """A middleware that reports an exception escaping a handler, then lets it go on up."""

    @web.middleware
    async def middleware(req: web.Request, handler):
        try:
            return await handler(req)
        except (web.HTTPException, asyncio.CancelledError):
            raise
        except Exception as exc:
            report(f"{req.method} {req.path}: the handler raised {type(exc).__name__}: {exc}")
            raise

    return middleware


def prepare_app(app: web.Application, report: Callable[[str], None]) -> web.Application:
    """Ready a real app to be served here: :func:`findings` innermost, then frozen (as
    ``web.AppRunner`` freezes it; its signals cannot be sent before)."""
    app.middlewares.append(findings(report))
    app.freeze()
    return app


async def serve(app: web.Application, req: web.Request) -> None:
    """One request through ``app`` as aiohttp's server takes it (``web_protocol``): the app's
    handler, then the answer prepared and ended unless the handler sent it. A cancellation (the
    connection went away, the process died) ends it quietly."""
    try:
        resp = await handle(app, req)
        if not resp.prepared:
            await resp.prepare(req)
        await resp.write_eof()
    except asyncio.CancelledError:
        pass


class Sink:
    """aiohttp's payload writer for one response: hands headers, chunks and the end to callbacks."""

    buffer_size = 0
    output_size = 0
    length = 0

    def __init__(self, on_headers: Callable[[int, dict], None], on_data: Callable[[bytes], None],
                 on_eof: Callable[[], None]):
        self._on_headers, self._on_data, self._on_eof = on_headers, on_data, on_eof
        self.blocked: Optional[asyncio.Future] = None  # a write waits on it (a client that stopped reading)
        self.stalled = False

    async def write_headers(self, status_line: str, headers) -> None:
        await self._wait()
        self._on_headers(int(status_line.split(" ", 2)[1]), dict(headers))

    def send_headers(self, *args, **kw) -> None:
        pass

    async def write(self, chunk, *args, **kw) -> None:
        await self._wait()
        if chunk:
            self._on_data(bytes(chunk))

    async def write_eof(self, chunk: bytes = b"") -> None:
        await self._wait()
        if chunk:
            self._on_data(bytes(chunk))
        self._on_eof()

    async def drain(self) -> None:
        await self._wait()

    async def _wait(self) -> None:
        if self.stalled:  # never resolved: the writer waits until it gives up (its own timeout)
            if self.blocked is None or self.blocked.done():
                self.blocked = asyncio.get_running_loop().create_future()
            await self.blocked

    def enable_compression(self, *args, **kw) -> None:
        pass

    def enable_chunking(self) -> None:
        pass

    def set_eof(self) -> None:
        pass


class Body:
    """A response body as the router reads it (``response.content``)."""

    def __init__(self):
        self._chunks: deque[bytes] = deque()
        self._eof = False
        self._exc: Optional[BaseException] = None
        self._waiter: Optional[asyncio.Future] = None

    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._wake()

    def end(self) -> None:
        self._eof = True
        self._wake()

    def fail(self, exc: BaseException) -> None:
        if not self._eof:
            self._exc = exc
            self._wake()

    @property
    def done(self) -> bool:
        return self._eof and not self._chunks

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        self._waiter = None

    async def readany(self) -> bytes:
        while not self._chunks:
            if self._exc is not None:
                raise self._exc
            if self._eof:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._chunks.popleft()


class Response:
    """What the router's leg holds once a worker's headers came (``aiohttp.ClientResponse``'s surface)."""

    def __init__(self, conn: "Connection", status: int, headers: dict):
        self._conn = conn
        self.status = status
        self.headers = CIMultiDictProxy(CIMultiDict(headers))
        self.content = Body()
        self._body: Optional[bytes] = None

    @property
    def content_length(self) -> Optional[int]:
        value = self.headers.get("Content-Length")
        return int(value) if value is not None and value.isdigit() else None

    async def read(self) -> bytes:
        if self._body is None:
            parts = []
            while chunk := await self.content.readany():
                parts.append(chunk)
            self._body = b"".join(parts)
        return self._body

    async def json(self):
        return json.loads(await self.read())

    def release(self) -> None:
        self._conn.released()

    def close(self) -> None:
        self._conn.close()


class Connection:
    """One HTTP request from the router to a worker, while it lasts."""

    def __init__(self, worker, loop):
        self.worker = worker
        self.loop = loop
        self.server_transport = Transport()
        self.response: Optional[Response] = None
        self.headers: Optional[asyncio.Future] = loop.create_future()
        self.handler: Optional[asyncio.Task] = None
        self.closed = False
        self._last = [0.0]  # arrival time of the last thing sent to the router (in order)

    def _later(self, fn: Callable[[], None]) -> None:
        # a stopped worker's bytes leave when it goes on (the fault's end), in order
        at = self._last[0] = max(self.loop.time() + LATENCY_S, self._last[0], self.worker.stopped_until + LATENCY_S)
        self.loop.call_at(at, fn)

    def writer(self) -> Sink:
        return Sink(lambda status, headers: self._later(lambda: self._headers(status, headers)),
                    lambda data: self._later(lambda: self.response and self.response.content.feed(data)),
                    lambda: self._later(lambda: self.response and self.response.content.end()))

    def _headers(self, status: int, headers: dict) -> None:
        if self.closed or self.headers.done():
            return
        self.response = Response(self, status, headers)
        self.headers.set_result(self.response)

    def close(self) -> None:
        """The router closed it (a leg aborted): the worker sees its client go away."""
        if self.closed:
            return
        self.closed = True
        self.worker.connections.discard(self)
        self.loop.call_at(max(self.loop.time(), self.worker.stopped_until) + LATENCY_S, self._client_gone)

    def released(self) -> None:
        self.closed = True
        self.worker.connections.discard(self)

    def _client_gone(self) -> None:
        self.server_transport.closing = True
        if self.handler is not None and not self.handler.done():
            self.handler.cancel()

    def broken(self) -> None:
        """The worker's process died."""
        self.closed = True
        if not self.headers.done():
            self.headers.set_exception(aiohttp.ServerDisconnectedError())
        elif self.response is not None:
            self.response.content.fail(aiohttp.ClientPayloadError("Response payload is not completed: "
                                                                  "the server closed the connection"))
        if self.handler is not None and not self.handler.done():
            self.handler.cancel()


class _Call:
    """``session.get(...)``: awaitable, and an async context manager like aiohttp's."""

    def __init__(self, coro):
        self._coro = coro
        self._resp: Optional[Response] = None

    def __await__(self):
        return self._coro.__await__()

    async def __aenter__(self) -> Response:
        self._resp = await self._coro
        return self._resp

    async def __aexit__(self, *exc) -> None:
        if self._resp is not None:
            self._resp.release()


class Session:
    """The router's ``aiohttp.ClientSession`` (module docstring). ``workers(address)``: the live
    simulated worker at ``host:port``, or None; ``rewrite(body)``: what a POST's body becomes on
    the wire (a plant's seam; as sent by default); ``opened(method, url)`` is called as each
    request goes out, in its caller's context (the simulator follows each client's legs)."""

    def __init__(self, loop, workers: Callable[[str], object], rewrite: Callable[[bytes], bytes] = lambda b: b):
        self.loop = loop
        self.workers = workers
        self.rewrite = rewrite
        self.opened: Callable[[str, str], None] = lambda method, url: None

    def post(self, url: str, data: bytes = b"", headers=None, timeout=None, allow_redirects=True):
        return _Call(self._request("POST", url, self.rewrite(data), timeout))

    def get(self, url: str, timeout=None, headers=None, allow_redirects=True):
        return _Call(self._request("GET", url, b"", timeout))

    async def _request(self, method: str, url: str, data: bytes, timeout) -> Response:
        total = getattr(timeout, "total", None)
        if total:
            return await asyncio.wait_for(self._open(method, url, data), total)
        return await self._open(method, url, data)

    async def _open(self, method: str, url: str, data: bytes) -> Response:
        parts = urlsplit(url)
        self.opened(method, url)
        await asyncio.sleep(LATENCY_S)
        worker = self.workers(parts.netloc)
        if worker is None:
            raise aiohttp.ClientConnectionError(f"Cannot connect to host {parts.netloc}: connection refused")
        stopped = worker.stopped_until - self.loop.time()
        if stopped > 0:  # SIGSTOPped: the kernel took the connection, the process reads it when it goes on
            await asyncio.sleep(stopped)
            worker = self.workers(parts.netloc)
            if worker is None:
                raise aiohttp.ServerDisconnectedError()
        conn = Connection(worker, self.loop)
        worker.connections.add(conn)
        req = request(method, parts.path, data, conn.writer(), conn.server_transport, self.loop, worker.app)
        conn.handler = asyncio.ensure_future(worker.handle(req))
        try:
            return await asyncio.shield(conn.headers)
        except asyncio.CancelledError:
            conn.close()
            raise
