"""Small helpers shared by the worker's and the router's HTTP servers: the URL they serve, and
the cap on the connections they hold (``docs/security.md``)."""

from __future__ import annotations

import asyncio
import json
from typing import Callable

from aiohttp import web

from splitserve.errors import error_body


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


async def read_body(request: web.Request, timeout: float, limit: int) -> bytes:
    """The whole request body within ``timeout`` seconds (else 408) and within ``limit`` bytes (the
    app's ``client_max_size``; else 413), each answer naming its option."""
    try:  # not wait_for: on Python 3.11 it drops a cancellation that comes as the body completes
        async with asyncio.timeout(timeout):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise body_too_large(limit) from None
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
