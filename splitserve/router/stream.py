"""Decode's SSE stream as an exchange reads it: ahead of the commit, then through to the client.

Before the commit (the prefill leg's status is not known yet) the exchange keeps a read of the
next chunk in progress among the things it waits on, and keeps what arrives (:meth:`keep`), so
that the stream can decide the exchange (:attr:`DecodeStream.decided`): an error event, its end,
a broken connection, or more than :data:`LOOKAHEAD_BYTES`. After the commit :meth:`chunks`
yields what was kept, then the rest, each read bounded by the request's deadline and, after the
commit, by ``--stream-stall-s`` of silence (:class:`StreamStalled`). :class:`SSEWatch` follows the
bytes for ``data: {"error"`` and ``data: [DONE]``, without which a stream that ended was cut short.
With a :class:`~splitserve.router.migrate.StreamTrack` (the leg asked for its ids) the bytes kept
and yielded are the track's: comments dropped (never counted as read-ahead), the error event and
``[DONE]`` held back in the track.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable, Optional

import aiohttp

from splitserve.router.legs import retrieve
from splitserve.router.migrate import StreamTrack

LOOKAHEAD_BYTES = 64 * 1024  # read ahead before the commit, at most (decode is generating past this)


class StreamStalled(Exception):
    """Decode's stream said nothing (not even a comment) for ``--stream-stall-s``."""


class SSEWatch:
    """Notices, in an SSE byte stream cut at arbitrary points, an error event (``data:
    {"error": ...}``, so that a stream the worker ended with an error is not counted as finished)
    and ``data: [DONE]``."""

    def __init__(self):
        self._tail = b""
        self.saw_error = False
        self.saw_done = False

    def feed(self, chunk: bytes) -> None:
        lines = (self._tail + chunk).split(b"\n")
        self._tail = lines.pop()[:64]  # only a line's start matters
        for line in lines:
            line = line.rstrip(b"\r")
            self.saw_error = self.saw_error or line.startswith(b'data: {"error"')
            self.saw_done = self.saw_done or line == b"data: [DONE]"


class DecodeStream:
    """The body of decode's streaming response. ``wait(tasks, bound)`` is the exchange's bounded
    wait (it raises when the request's deadline passes, or :class:`StreamStalled` after ``bound``
    seconds without any done); ``stall_s`` the bound on silence after the commit; ``track`` (or
    None) what the client's bytes are made by."""

    def __init__(self, response: aiohttp.ClientResponse, wait: Callable[..., Awaitable[None]],
                 track: Optional[StreamTrack] = None, stall_s: Optional[float] = None):
        self.response = response
        self.wait = wait
        self.track = track
        self.stall_s = stall_s
        self.watch = SSEWatch()
        self.reading: Optional[asyncio.Future] = None
        self.ahead: list[bytes] = []
        self.ahead_bytes = 0
        self.broke: Optional[BaseException] = None  # how the stream broke off, while read ahead
        self.ended = False  # the body ended while read ahead

    def read(self) -> asyncio.Future:
        """The read of the next chunk now in progress (started if none is)."""
        if self.reading is None:
            self.reading = asyncio.ensure_future(self.response.content.readany())
            self.reading.add_done_callback(retrieve)
        return self.reading

    def keep(self) -> None:
        """If the read in progress is done, keep what it brought (before the commit)."""
        if self.reading is None or not self.reading.done():
            return
        read, self.reading = self.reading, None
        if read.exception() is not None:
            self.broke = read.exception()
        elif not read.result():
            self.ended = True
        else:
            passed = self._pass(read.result())
            if passed:
                self.ahead.append(passed)
                self.ahead_bytes += len(passed)

    def _pass(self, chunk: bytes) -> bytes:
        self.watch.feed(chunk)
        return chunk if self.track is None else self.track.feed(chunk)

    @property
    def decided(self) -> bool:
        """What was read ahead says how the exchange ends: no need to wait for prefill's status."""
        return (self.broke is not None or self.ended or self.watch.saw_error or self.watch.saw_done
                or self.ahead_bytes > LOOKAHEAD_BYTES)

    @property
    def failed(self) -> bool:
        """What was read ahead says decode failed (an error event, a break, an end without [DONE])."""
        return self.broke is not None or self.watch.saw_error or (self.ended and not self.watch.saw_done)

    async def chunks(self) -> AsyncIterator[bytes]:
        """From the commit on: what was read ahead, then the rest. Raises what ``wait`` raises, or
        the ``aiohttp.ClientError`` the stream broke off with."""
        ahead, self.ahead = self.ahead, []
        for chunk in ahead:
            yield chunk
        if self.broke is not None:
            raise self.broke
        while not self.ended:
            read = self.read()
            await self.wait({read}, self.stall_s)
            self.reading = None
            chunk = read.result()
            if not chunk:
                break
            passed = self._pass(chunk)
            if passed:
                yield passed
        rest = self.track.flush() if self.track is not None else b""
        if rest:
            yield rest

    def cancel(self) -> None:
        if self.reading is not None:
            self.reading.cancel()
            self.reading = None
