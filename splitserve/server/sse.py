"""Server-sent events over an aiohttp ``StreamResponse``: ``data: <json>\\n\\n`` per event, then
``data: [DONE]``, as OpenAI and SGLang stream.

A client that goes away shows up as :class:`ClientGone` on the next write (the transport is gone
or closing, or the write raises ``ConnectionResetError``), so the caller can abort the request at
once instead of generating into the void. So does one that stops reading: every write (the
headers, an event, the end) must complete within ``write_timeout`` seconds (the worker's
``--client-write-timeout-s``), else the connection is aborted and :class:`ClientGone` raised, and
the request's pages are freed like on any abort. A write that cannot wait
(``client_writer.cannot_wait``) goes without the timer.
"""

from __future__ import annotations

import asyncio
import json
from typing import Optional

from aiohttp import web

from splitserve.client_writer import cannot_wait


class ClientGone(Exception):
    """The client closed the connection; nothing more can be sent."""


class SSEWriter:
    def __init__(self, request: web.Request, write_timeout: Optional[float] = None):
        self.request = request
        self.write_timeout = write_timeout
        self.response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # no proxy buffering: deltas must arrive as they are made
        })
        self.started = False

    def client_gone(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()

    async def start(self) -> None:
        if not self.started:
            if self.client_gone():
                raise ClientGone()
            try:
                await self._bounded(self.response.prepare(self.request), 1 << 30)  # once: always bounded
            except (ConnectionResetError, ConnectionError) as e:
                raise ClientGone() from e
            self.started = True

    async def _write(self, payload: str) -> None:
        await self.start()
        if self.client_gone():
            raise ClientGone()
        data = payload.encode("utf-8")
        try:
            await self._bounded(self.response.write(data), len(data))
        except (ConnectionResetError, ConnectionError) as e:
            raise ClientGone() from e

    async def send(self, obj: dict, comment: Optional[str] = None) -> None:
        """One event; ``comment``: an SSE comment line (``: <comment>``) written in the same block
        before its ``data:`` line (clients ignore it)."""
        await self.send_all([obj], comment)

    async def send_all(self, objs: list[dict], comment: Optional[str] = None) -> None:
        """Events in one write (``comment`` before the first): what one delta makes, so that a
        reader that saw its comment sees its events too unless the write itself broke."""
        if not objs:
            return
        head = f": {comment}\n" if comment is not None else ""
        await self._write(head + "".join("data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
                                          + "\n\n" for obj in objs))

    async def comment(self, text: str) -> None:
        """A comment alone (``: <text>``, a block of its own): keeps a quiet stream alive."""
        await self._write(f": {text}\n\n")

    async def done(self) -> None:
        """``data: [DONE]`` and the end of the body."""
        await self._write("data: [DONE]\n\n")
        try:
            await self._bounded(self.response.write_eof(), 0)
        except (ConnectionResetError, ConnectionError) as e:
            raise ClientGone() from e

    async def _bounded(self, step, nbytes: int) -> None:
        try:
            if cannot_wait(self.request.transport, nbytes):  # most writes: no timer to arm and cancel
                await step
                return
            async with asyncio.timeout(self.write_timeout):  # not wait_for: no task per chunk
                await step
        except TimeoutError:
            transport = self.request.transport
            if transport is not None:
                transport.abort()  # not close(): that would wait for the unread bytes to be flushed
            raise ClientGone(f"the client read nothing for --client-write-timeout-s ({self.write_timeout:g} s)") \
                from None
