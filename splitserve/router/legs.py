"""One leg of an exchange: one POST to one worker, its bounds, and the ways it ends.

A :class:`Leg` is started at once; its ``task`` resolves when the worker's response headers
arrive, or fails: the connection could not be opened within ``worker_connect_timeout_s``, it
broke, or (a streaming request only) the headers did not come within ``worker_header_timeout_s``
(:class:`NoHeaders`). A worker answers the headers of a streaming request as soon as it accepts or
refuses it, so the bound can be short; without streaming they come with the whole answer, and
only ``request_timeout_s`` bounds them.

A leg ends in one of two ways, each counted once off the worker's ``in_flight``: ``release()``
after its body was read to the end (the connection goes back to the pool), or ``abort()``, which
closes the connection: the worker sees its client go away and aborts the request.
:meth:`Leg.drain` reads a leg to its end in the background, bounded, and :meth:`Leg.abort_after`
puts a later bound on a drain already running.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import aiohttp

from splitserve.router.answers import read_answer
from splitserve.router.workers import Worker

log = logging.getLogger(__name__)


class NoHeaders(Exception):
    """A streaming leg's response headers did not come within ``worker_header_timeout_s``."""


class Leg:
    """One POST to one worker, started at once; ``task`` resolves when its headers arrive."""

    def __init__(self, worker: Worker, session: aiohttp.ClientSession, path: str, data: bytes, *,
                 connect_timeout: float, header_timeout: Optional[float], headers: Optional[dict] = None):
        self.worker = worker
        self.response: Optional[aiohttp.ClientResponse] = None
        self._counted = True
        self.aborted = False
        self._body: Optional[asyncio.Future] = None  # the body, read once (:meth:`body`)
        worker.in_flight += 1
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, connect=connect_timeout)
        headers = {"Content-Type": "application/json", **(headers or {})}
        self.task = asyncio.ensure_future(self._post(session, worker.url + path, data, headers, timeout,
                                                     header_timeout))
        self.task.add_done_callback(retrieve)

    async def _post(self, session, url: str, data: bytes, headers: dict, timeout, header_timeout: Optional[float]):
        post = session.post(url, data=data, headers=headers, timeout=timeout, allow_redirects=False)
        try:
            # asyncio.timeout, never wait_for: on Python 3.11 wait_for drops a cancellation that
            # arrives in the turn its inner future completes, and the task then goes on as if not cancelled
            async with asyncio.timeout(header_timeout):
                resp = await post
        except aiohttp.ServerTimeoutError:  # the connect timeout, inside the post
            raise
        except asyncio.TimeoutError:
            raise NoHeaders(f"sent no response headers within the router's worker_header_timeout_s "
                            f"({header_timeout:g} s)") from None
        self.response = resp
        return resp

    async def body(self, limit: int) -> bytes:
        """The response's whole body, at most ``limit`` bytes (``answers.read_answer``), read once
        and kept: a second reader gets what the first got, or the same error (the caller bounds
        the time)."""
        if self._body is None:
            self._body = asyncio.ensure_future(read_answer(self.response, limit))
            self._body.add_done_callback(retrieve)
        return await asyncio.shield(self._body)

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

    @property
    def open(self) -> bool:
        """Neither released nor aborted yet."""
        return self._counted

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
            async with asyncio.timeout(timeout):
                await self._read_all()
        except asyncio.CancelledError:
            self.abort()
            raise
        except Exception as exc:
            if not self.aborted:  # not closed on purpose by the exchange
                log.info("%s: leg ended without its full answer: %s", self.worker.describe(), describe_error(exc))
            self.abort()
        else:
            self.release()

    def abort_after(self, seconds: float) -> None:
        """Abort the leg ``seconds`` from now unless it has ended by then."""
        def expire() -> None:
            if self._counted:
                log.info("%s: leg still open %.0f s after its exchange ended: closed", self.worker.describe(),
                         seconds)
                self.abort()

        if self._counted:
            asyncio.get_running_loop().call_later(seconds, expire)

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


def retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # marks it retrieved: a failed leg is reported by the exchange, not by asyncio


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, NoHeaders):
        return str(exc)
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return "could not connect within the router's worker_connect_timeout_s"
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
