"""A worker's answers are read bounded in bytes, not only in time (``router/answers.py``): an
address that streams an endless ``/health`` body costs the router one bound's worth of memory,
then the check fails and the connection is closed; what fits is read whole."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from splitserve.router.answers import SMALL_ANSWER_BYTES, AnswerTooLarge, read_answer
from splitserve.router.retry import cause
from splitserve.router.workers import HealthChecker, WorkerSet

CHUNK = 64 * 1024


def endless_health(sent: list[int]):
    """A ``/health`` that streams zeros for as long as the reader reads (at most 1 GiB)."""
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        try:
            for _ in range((1 << 30) // CHUNK):
                await resp.write(b"0" * CHUNK)
                sent[0] += CHUNK
        except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
            pass
        return resp
    return handler


async def _probe_endless() -> tuple[tuple, int]:
    sent = [0]
    app = web.Application()
    app.router.add_get("/health", endless_health(sent))
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
        checker = HealthChecker(WorkerSet([], []), session, interval_s=5.0, failures_to_remove=2)
        result = await checker.probe(str(server.make_url("")).rstrip("/"))
        await asyncio.sleep(0.2)  # the server notices the closed connection
        return result, sent[0]


def test_an_endless_health_answer_fails_the_check_after_one_bound_of_bytes():
    (status, body, why), sent = asyncio.run(_probe_endless())
    assert status == 0 and body == {} and "AnswerTooLarge" in why, why
    # the socket buffers hold a few MiB beyond what the router read; the check's 5 s would let GBs through
    assert sent < SMALL_ANSWER_BYTES + (64 << 20), sent


async def _read(body: bytes, limit: int, declared: bool) -> bytes:
    async def handler(request: web.Request) -> web.StreamResponse:
        if declared:
            return web.Response(body=body)
        resp = web.StreamResponse()  # chunked: no Content-Length to refuse by
        await resp.prepare(request)
        await resp.write(body)
        return resp

    app = web.Application()
    app.router.add_get("/", handler)
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
        async with session.get(server.make_url("/")) as resp:
            return await read_answer(resp, limit)


def test_an_answer_within_the_bound_is_read_whole_and_one_past_it_is_refused_either_way():
    for declared in (True, False):
        assert asyncio.run(_read(b"x" * 1000, 1000, declared)) == b"x" * 1000
        try:
            asyncio.run(_read(b"x" * 1001, 1000, declared))
        except AnswerTooLarge as exc:
            assert cause(exc) is None  # not tried on another worker: it would answer as much
        else:
            raise AssertionError("an answer past the bound was read")
