"""Fakes for the tests of what a router trusts a worker with (``test_worker_trust.py``,
``test_discovery_trust.py``): a fake worker that records every call it gets (path and
``Authorization`` header) and proves itself with the keys it is given (none: it cannot), and the
real router app run in this process on a free port."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
from typing import Optional

import aiohttp
from aiohttp import web

from splitserve.discovery.proof import NONCE_HEADER, prove
from splitserve.discovery.record import WorkerRecord

MODEL = "fake-model"


class ProvingWorker:
    """A worker's HTTP surface: ``/health`` with an identity (and a proof, given ``keys``),
    ``/v1/models``, ``/get_server_info``, generation. ``calls``: (path, Authorization or None)."""

    def __init__(self, worker_id: str, role: str = "decode", keys: Optional[dict] = None, leaving: bool = False):
        self.id, self.role, self.keys, self.leaving = worker_id, role, dict(keys or {}), leaving
        self.incarnation = secrets.token_hex(8)
        self.calls: list[tuple[str, Optional[str]]] = []
        self.runner: Optional[web.AppRunner] = None
        self.port = 0
        self.stall_s = 0.0  # /health answers only after this long (a probe that times out)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def record(self, **change) -> WorkerRecord:
        fields = dict(id=self.id, incarnation=self.incarnation, role=self.role, url=self.url,
                      bootstrap_port=8998 if self.role == "prefill" else None, model="fake:fp",
                      protocol_version=1, transfer_backend="nixl")
        return WorkerRecord(**{**fields, **change})

    def generations(self) -> int:
        return sum(path.startswith(("/v1/", "/generate")) and path != "/v1/models" for path, _ in self.calls)

    def keyed_calls(self) -> list[str]:
        return [path for path, auth in self.calls if auth]

    async def start(self) -> "ProvingWorker":
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._any)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        await self.runner.cleanup()

    async def _any(self, request: web.Request) -> web.Response:
        self.calls.append((request.path, request.headers.get("Authorization")))
        if request.path == "/health" and self.stall_s:
            await asyncio.sleep(self.stall_s)
        if request.path == "/health":
            body = {"status": "ok", "id": self.id, "incarnation": self.incarnation, "role": self.role}
            proof = prove(self.keys, request.headers.get(NONCE_HEADER), self.id, self.incarnation)
            body.update({"proof": proof} if proof else {}, **({"leaving": True} if self.leaving else {}))
            return web.json_response(body)
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        if request.path == "/get_server_info":
            return web.json_response({"model_fingerprint": "fake:fp", "protocol_version": 1,
                                      "transfer_backend": "nixl", "bootstrap_port": 8998})
        return web.json_response({"text": "fake", "meta_info": {}})


@contextlib.asynccontextmanager
async def running_router(config):
    """The router app of ``config`` served on a free port: (its URL, its ``RouterState``)."""
    from splitserve.router.app import ROUTER, create_app

    app = create_app(config)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", app[ROUTER]
    finally:
        await runner.cleanup()


async def until(what: str, check, rounds: int = 600, step_s: float = 0.05):
    """Poll ``check`` (sync) until it is true, at most ``rounds`` times."""
    for _ in range(rounds):
        value = check()
        if value:
            return value
        await asyncio.sleep(step_s)
    raise AssertionError(f"never came: {what}")


async def call(method: str, url: str, **kwargs) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url, timeout=aiohttp.ClientTimeout(total=30), **kwargs) as resp:
            return resp.status, await resp.json(content_type=None)


@dataclasses.dataclass
class Secret:
    """A cluster secret in a file, and the keys derived from it."""

    path: str
    proof_key: bytes
    record_key: bytes

    @classmethod
    def new(cls, folder) -> "Secret":
        from splitserve.disagg.control.curve import ClusterSecret
        from splitserve.secret_file import write_secret_file

        path = write_secret_file(str(folder / f"secret-{secrets.token_hex(4)}"))
        loaded = ClusterSecret.load(path)
        return cls(path, loaded.proof_key, loaded.record_key)
