"""The router's view of its workers: addresses, health, and requests in flight.

A :class:`Worker` is one prefill or decode worker as the router sees it. Its fields are changed
only on the router's event loop (the health checker and the request handlers), so no locks.

Health: :class:`HealthChecker` GETs ``/health`` on every worker every ``health_interval_s``
(all workers at once, each check bounded by a timeout). ``health_failures`` consecutive failures
take a worker out of rotation; one success brings it back. A worker starts out of rotation until
its first successful check, so the router never sends a request to a worker it has not seen up.
When a worker comes (back) up, the checker also asks its ``/v1/models`` for the served model's
name, which is how the router learns what clients may put in ``model``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Iterable, Optional
from urllib.parse import urlsplit

import aiohttp

from splitserve.config import RouterConfig, WorkerAddress

log = logging.getLogger(__name__)

PREFILL, DECODE = "prefill", "decode"


@dataclass(eq=False)
class Worker:
    role: str  # "prefill" | "decode"
    url: str  # base URL, no trailing slash
    bootstrap_port: Optional[int] = None  # prefill only
    healthy: bool = False
    failures: int = 0  # consecutive failed health checks
    in_flight: int = 0  # request legs now open to this worker
    model: Optional[str] = None  # served model name, from its /v1/models
    last_error: str = "not checked yet"

    @property
    def host(self) -> str:
        """The host part of the URL (what the router sends as ``bootstrap_host``)."""
        return urlsplit(self.url).hostname or ""

    def describe(self) -> str:
        extra = f" bootstrap port {self.bootstrap_port}" if self.role == PREFILL else ""
        return f"{self.role} worker {self.url}{extra}"


@dataclass(eq=False)
class WorkerSet:
    """All workers of one router, by role."""

    prefill: list[Worker] = field(default_factory=list)
    decode: list[Worker] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: RouterConfig) -> "WorkerSet":
        def make(role: str, addr: WorkerAddress) -> Worker:
            return Worker(role, addr.url.rstrip("/"), addr.bootstrap_port if role == PREFILL else None)

        return cls([make(PREFILL, a) for a in config.prefill], [make(DECODE, a) for a in config.decode])

    def all(self) -> list[Worker]:
        return self.prefill + self.decode

    def healthy(self, role: str) -> list[Worker]:
        return [w for w in (self.prefill if role == PREFILL else self.decode) if w.healthy]

    def ready(self) -> bool:
        """A usable pair is up: a healthy prefill and a healthy decode worker."""
        return bool(self.healthy(PREFILL)) and bool(self.healthy(DECODE))

    def missing(self) -> Optional[str]:
        """Why there is no usable pair (None when there is), naming each role without a healthy worker."""
        gone = [f"no healthy {role} worker: {describe_all(ws)}" for role, ws in
                ((PREFILL, self.prefill), (DECODE, self.decode)) if not self.healthy(role)]
        return "; ".join(gone) or None

    def model_name(self) -> Optional[str]:
        """The served model's name as the healthy decode workers report it (else any worker's)."""
        for w in self.healthy(DECODE) + self.decode + self.prefill:
            if w.model:
                return w.model
        return None


class HealthChecker:
    """Checks every worker periodically; ``run()`` is the loop, ``check_all()`` one round."""

    def __init__(self, workers: WorkerSet, session: aiohttp.ClientSession, interval_s: float,
                 failures_to_remove: int):
        self.workers = workers
        self.session = session
        self.interval_s = interval_s
        self.failures_to_remove = max(1, failures_to_remove)
        self.timeout = aiohttp.ClientTimeout(total=max(0.5, min(5.0, interval_s)))

    async def run(self) -> None:
        while True:
            try:
                await self.check_all()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one round must not end health checking for good
                log.exception("health check round failed")
            await asyncio.sleep(self.interval_s)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.workers.all()))

    async def check(self, worker: Worker) -> None:
        error = await self._probe(worker)
        if error is None:
            if not worker.healthy:
                log.info("%s is healthy, in rotation", worker.describe())
                worker.model = await self._model_name(worker) or worker.model
            worker.healthy, worker.failures, worker.last_error = True, 0, ""
            return
        worker.failures += 1
        worker.last_error = error
        if worker.healthy and worker.failures >= self.failures_to_remove:
            worker.healthy = False
            log.warning("%s failed %d health checks (%s), out of rotation", worker.describe(), worker.failures,
                        error)

    async def _probe(self, worker: Worker) -> Optional[str]:
        try:
            async with self.session.get(worker.url + "/health", timeout=self.timeout) as resp:
                await resp.read()
                return None if resp.status == 200 else f"/health answered {resp.status}"
        except asyncio.TimeoutError:
            return "/health timed out"
        except aiohttp.ClientError as exc:
            return f"/health failed: {type(exc).__name__}: {exc}"

    async def _model_name(self, worker: Worker) -> Optional[str]:
        try:
            async with self.session.get(worker.url + "/v1/models", timeout=self.timeout) as resp:
                if resp.status != 200:
                    return None
                data = (await resp.json()).get("data") or []
                name = data[0].get("id") if data and isinstance(data[0], dict) else None
                return name if isinstance(name, str) else None
        except (asyncio.TimeoutError, aiohttp.ClientError, ValueError, AttributeError):
            return None


def describe_all(workers: Iterable[Worker]) -> str:
    return ", ".join(f"{w.url} ({'up' if w.healthy else 'down: ' + w.last_error})" for w in workers)
