"""Writing one response to an HTTP client, every write bounded: what the worker's and the router's
apps answer through, so that a client that stopped reading never holds a handler.

``client_write_timeout_s`` bounds each write (headers, a chunk, the end). A client that stopped
reading fills the kernel's buffers and then aiohttp's, after which a write waits for it; past the
bound the connection is aborted (not closed: closing would wait, with no end, for the unread bytes
to be flushed). A client that goes away shows up as a failed write here (:class:`ClientLost`), or as
the cancellation of the handler (the runner cancels it when the connection is lost).

Most writes cannot wait at all, and :func:`cannot_wait` tells which, so that they skip the timer
(one armed and cancelled per streamed token is a cost on the path of every token): aiohttp's write
hands the bytes to the transport and waits only in ``drain()``, and only while the transport has
paused its protocol, which asyncio does when the transport's buffer goes above its high-water
mark and undoes once it is back at or below the low-water mark.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from aiohttp import web


HEADROOM = 1024  # bytes aiohttp may add to a chunk (its chunked-encoding frame, a response's head)


def cannot_wait(transport: Optional[asyncio.BaseTransport], nbytes: int) -> bool:
    """Writing ``nbytes`` through aiohttp on ``transport`` now completes without waiting: the
    protocol is not paused (the buffer is at or below the low-water mark) and stays so (the
    buffer with these bytes stays at or below the high-water mark)."""
    if not isinstance(transport, asyncio.WriteTransport):
        return False
    try:
        low, high = transport.get_write_buffer_limits()
        size = transport.get_write_buffer_size()
    except (AttributeError, NotImplementedError, RuntimeError):
        return False
    return size <= low and size + nbytes + HEADROOM <= high


class ClientLost(Exception):
    """The client went away, or did not keep up (``timed_out``); the connection is closed and
    nothing more can be sent."""

    def __init__(self, message: str, timed_out: bool):
        super().__init__(message)
        self.timed_out = timed_out


class ClientWriter:
    """Writes one response to the client, every write bounded by ``timeout`` seconds."""

    def __init__(self, request: web.Request, timeout: float):
        self.request = request
        self.timeout = timeout

    async def prepare(self, response: web.StreamResponse) -> None:
        await self._bounded(response.prepare(self.request), 1 << 30)  # once a response: always bounded

    async def write(self, response: web.StreamResponse, chunk: bytes) -> None:
        await self._bounded(response.write(chunk), len(chunk))

    async def finish(self, response: web.StreamResponse) -> None:
        """Send whatever of ``response`` is not sent yet (all of a plain ``web.Response``) and its end."""
        if not response.prepared:
            await self.prepare(response)
        body = getattr(response, "body", None)  # a plain web.Response writes its whole body here
        await self._bounded(response.write_eof(), len(body) if isinstance(body, (bytes, bytearray)) else 1 << 30)

    async def _bounded(self, step, nbytes: int) -> None:
        transport = self.request.transport
        if transport is None or transport.is_closing():
            step.close()
            raise ClientLost("the client closed the connection", timed_out=False)
        try:
            if cannot_wait(transport, nbytes):
                await step
                return
            async with asyncio.timeout(self.timeout):  # not wait_for: no task per chunk
                await step
        except TimeoutError:
            self.drop()
            raise ClientLost(f"the client read nothing for client_write_timeout_s ({self.timeout:g} s)",
                             timed_out=True) from None
        except ConnectionError as exc:
            raise ClientLost(f"the client closed the connection: {exc}", timed_out=False) from None

    def drop(self) -> None:
        """Abort the connection now, discarding what it could not send."""
        transport: Optional[asyncio.Transport] = self.request.transport
        if transport is not None:
            transport.abort()


async def send(request: web.Request, response: web.StreamResponse, timeout: float) -> Optional[ClientLost]:
    """Send ``response`` now, bounded, unless it is already under way (a stream); None, or how the
    client was lost if it did not take it."""
    if response.prepared:
        return None
    try:
        await ClientWriter(request, timeout).finish(response)
    except ClientLost as exc:
        return exc
    return None
