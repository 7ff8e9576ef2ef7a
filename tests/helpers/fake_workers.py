"""Fake workers: a small aiohttp app per worker, in one event loop thread of the test process,
that records what reaches it and answers as told (``reply``, ``sse``, ``hang``...), where a real
worker could not be told to misbehave. Fixtures: ``fake_loop`` (the thread, per module) and
``fakes`` (``fakes(behaviour)`` makes one, all stopped after the test)."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Optional

import pytest
from aiohttp import web

MODEL = "fake-model"
COMPLETION = {"prompt": "Hello", "max_tokens": 4}  # a small request body


class FakeWorker:
    """An HTTP server with a worker's routes, in the fake loop's thread. ``behaviour`` is an async
    function ``(request, body) -> response`` for the generation routes; every request that reaches
    them is kept in ``requests``; a handler cancelled, or failing to write, because its client (the
    router) closed the connection sets ``aborted``. ``reset`` makes it new for the next test that
    shares it (``shared_pair`` in ``tests/test_router.py``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, behaviour=None):
        self.loop = loop
        self.runner: Optional[web.AppRunner] = None
        self.port = 0
        self._round = 0
        self.reset(behaviour)
        self._call(self._start())

    def reset(self, behaviour=None) -> None:
        """A new behaviour and empty records. A handler still running from before keeps the
        records it began with (its ``aborted`` and ``finished`` are not the next test's)."""
        self._round += 1
        self.behaviour = behaviour or reply(200, {"who": "fake"})
        self.health_status = 200
        self.models_hang = False  # /v1/models accepts and never answers (until end_hangs)
        self.requests: list[tuple[str, dict]] = []
        self.aborted = threading.Event()
        self.finished = 0
        self.flushes = 0  # POST /flush_cache received
        self.abort_requests: list[dict] = []  # POST /abort_request bodies received
        self.flush_status = 200
        self.release = asyncio.Event()  # set (from the loop) to end `hang` behaviours

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        app = web.Application()
        for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
            app.router.add_post(path, self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/flush_cache", self._flush_cache)
        app.router.add_post("/abort_request", self._abort_request)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def _health(self, request):
        return web.json_response({"status": "ok", "id": f"fake-{self.port}", "incarnation": "fake1"},
                                 status=self.health_status)

    async def _models(self, request):
        if self.models_hang:
            await self.release.wait()
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _abort_request(self, request):
        self.abort_requests.append(await request.json())
        return web.json_response({"found": True})

    async def _flush_cache(self, request):
        self.flushes += 1
        return web.json_response({"flushed_pages": 3}, status=self.flush_status)

    async def _generate(self, request):
        body = await request.json()
        self.requests.append((request.path, body))
        began, aborted = self._round, self.aborted
        try:
            resp = await self.behaviour(self, request, body)
            if self._round == began:
                self.finished += 1
            return resp
        except (asyncio.CancelledError, ConnectionError):  # the router closed the connection
            aborted.set()
            raise

    def stop_listening(self) -> None:
        """Close the listener and connections: the port now refuses connections."""
        self._call(self.runner.cleanup())

    def end_hangs(self) -> None:
        self.loop.call_soon_threadsafe(self.release.set)

    def rooms(self) -> list[int]:
        return [body["bootstrap_room"] for _, body in self.requests]


def reply(status: int, body: dict, headers: Optional[dict] = None, delay: float = 0.0):
    async def behaviour(fake, request, _body):
        await asyncio.sleep(delay)
        return web.json_response(body, status=status, headers=headers)
    return behaviour


def hang():
    async def behaviour(fake, request, _body):
        await fake.release.wait()
        return web.json_response({"who": "released"})
    return behaviour


def sse(events: list[dict], then_hang: bool = False, delay: float = 0.0):
    async def behaviour(fake, request, _body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        for event in events:
            await asyncio.sleep(delay)
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        if then_hang:
            await fake.release.wait()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    return behaviour


def error_then_hang(status: int):
    """Error headers, then the start of a body whose rest never comes (until ``end_hangs``)."""
    async def behaviour(fake, request, _body):
        resp = web.StreamResponse(status=status, headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await resp.write(b'{"error": ')
        await fake.release.wait()
        return resp
    return behaviour


def drop_connection():
    async def behaviour(fake, request, _body):
        request.transport.close()
        await asyncio.sleep(1)
        return web.Response()
    return behaviour


@pytest.fixture(scope="module")
def fake_loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-workers", daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


@pytest.fixture
def fakes(fake_loop):
    """``fakes(behaviour)`` makes a fake worker; all are stopped after the test."""
    made: list[FakeWorker] = []

    def make(behaviour=None) -> FakeWorker:
        fake = FakeWorker(fake_loop, behaviour)
        made.append(fake)
        return fake

    yield make
    for fake in made:
        fake.end_hangs()
        try:
            fake.stop_listening()
        except Exception:
            pass
