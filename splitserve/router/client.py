"""The client side of a request through the router, bounded: reading its body, writing its answer.

A client is never trusted to keep its side moving. Every way the router waits on it has a bound
(options of ``splitserve router``, documented in ``docs/router.md``):

- ``client_header_timeout_s``: aiohttp's keep-alive timer, which closes a connection that has not
  sent a whole request head that long after connecting or after its previous answer (set on the
  runner in ``app.py``);
- ``client_body_timeout_s``: :func:`read_body`, the whole body or :class:`ClientLost` (408);
- ``client_write_timeout_s``: :class:`ClientWriter`, each write (headers, a chunk, the end) or
  :class:`ClientLost`. A client that stopped reading fills the kernel's buffers and then aiohttp's,
  after which a write waits for it; past the bound the connection is aborted (not closed: closing
  would wait, with no end, for the unread bytes to be flushed).

A client that goes away shows up as a failed write here, or as the cancellation of the handler
(the runner cancels it when the connection is lost), which the exchange treats as its end.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from aiohttp import web

from splitserve.http_util import body_too_large
from splitserve.router.outcomes import RouterOutcome


class ClientLost(Exception):
    """The client went away (``client_disconnect``) or did not keep up (``client_timeout``); the
    connection is closed and nothing more can be sent."""

    def __init__(self, outcome: RouterOutcome, message: str):
        super().__init__(message)
        self.outcome = outcome


async def read_body(request: web.Request, timeout: float, limit: int) -> bytes:
    """The whole request body within ``timeout`` seconds, else :class:`ClientLost` (the caller
    answers 408). A body over the app's size limit (``--max-body-bytes``) is a 413 naming it."""
    try:  # not wait_for: on Python 3.11 it drops a cancellation (the client gone) that comes as the body completes
        async with asyncio.timeout(timeout):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise body_too_large(limit) from None
    except TimeoutError:
        raise ClientLost(RouterOutcome.CLIENT_TIMEOUT, f"the request body did not arrive within the router's "
                                           f"client_body_timeout_s ({timeout:g} s)") from None


class ClientWriter:
    """Writes one response to the client, every write bounded by ``timeout`` seconds."""

    def __init__(self, request: web.Request, timeout: float):
        self.request = request
        self.timeout = timeout

    async def prepare(self, response: web.StreamResponse) -> None:
        await self._bounded(response.prepare(self.request))

    async def write(self, response: web.StreamResponse, chunk: bytes) -> None:
        await self._bounded(response.write(chunk))

    async def finish(self, response: web.StreamResponse) -> None:
        """Send whatever of ``response`` is not sent yet (all of a plain ``web.Response``) and its end."""
        if not response.prepared:
            await self.prepare(response)
        await self._bounded(response.write_eof())

    async def _bounded(self, step) -> None:
        transport = self.request.transport
        if transport is None or transport.is_closing():
            step.close()
            raise ClientLost(RouterOutcome.CLIENT_DISCONNECT, "the client closed the connection")
        try:
            async with asyncio.timeout(self.timeout):  # not wait_for: no task per chunk
                await step
        except TimeoutError:
            self.drop()
            raise ClientLost(RouterOutcome.CLIENT_TIMEOUT, f"the client read nothing for the router's "
                                               f"client_write_timeout_s ({self.timeout:g} s)") from None
        except ConnectionError as exc:
            raise ClientLost(RouterOutcome.CLIENT_DISCONNECT, f"the client closed the connection: {exc}") from None

    def drop(self) -> None:
        """Abort the connection now, discarding what it could not send."""
        transport: Optional[asyncio.Transport] = self.request.transport
        if transport is not None:
            transport.abort()


async def send(request: web.Request, response: web.StreamResponse, timeout: float) -> Optional[RouterOutcome]:
    """Send ``response`` now, bounded, unless it is already under way (a stream); None, or the
    outcome (``client_disconnect`` / ``client_timeout``) if the client did not take it."""
    if response.prepared:
        return None
    try:
        await ClientWriter(request, timeout).finish(response)
    except ClientLost as exc:
        return exc.outcome
    return None
