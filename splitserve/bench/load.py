"""Driving a load: a Poisson process at a fixed rate (open loop), or a fixed number of clients that
each send their next request as soon as the last one ended (closed loop), after a warm-up.

- ``rate`` set: requests (random workload) or sessions (agentic) start at the times of a Poisson
  process of that rate (exponential gaps drawn from the workload's seed), at most
  ``max_concurrency`` at once if given; ``rate=inf`` starts them all at once.
- ``rate`` None: ``concurrency`` clients; each takes the next request (or session) when it is free.

``warmup`` requests are sent first, ``concurrency`` (or 4) at a time, and not recorded. Every time
of the run is on one clock (``time.perf_counter``), relative to the first measured send.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from typing import Optional

import aiohttp

from splitserve.bench.client import Target, send
from splitserve.bench.stats import Record
from splitserve.bench.workload import Maker, Spec, Workload


@dataclass(frozen=True)
class Load:
    requests: int = 100
    """Requests (random workload) or sessions (agentic) measured."""
    rate: Optional[float] = None
    """Poisson arrivals per second; None: closed loop at ``concurrency``."""
    concurrency: int = 8
    max_concurrency: Optional[int] = None
    warmup: int = 4
    timeout_s: float = 600.0


@dataclass
class Run:
    load: Load
    records: list[Record] = field(default_factory=list)
    duration_s: float = 0.0
    started_at: float = 0.0  # wall clock (Unix seconds) of the first measured send


async def run(target: Target, workload: Workload, load: Load) -> Run:
    maker = Maker(workload.check())
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=load.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
        if load.warmup:
            warm = Maker(Workload(**{**workload.__dict__, "cancel_fraction": 0.0, "kind": "random"}), seed_offset=10**6)
            specs = [warm.random_request() for _ in range(load.warmup)]
            await _closed(session, target, specs, max(1, min(load.concurrency, 4)), [], lambda: 0.0)
        t0 = time.perf_counter()
        clock = lambda: time.perf_counter() - t0  # noqa: E731
        result = Run(load, started_at=time.time())
        if workload.kind == "random":
            specs = [maker.random_request() for _ in range(load.requests)]
            if load.rate is None:
                await _closed(session, target, specs, load.concurrency, result.records, clock)
            else:
                await _poisson(session, target, specs, load, result.records, clock, maker.rng)
        else:
            sessions = [maker.first_turn(i) for i in range(load.requests)]
            if load.rate is None:
                await _closed(session, target, sessions, load.concurrency, result.records, clock,
                              lambda s: _session(session, target, s, maker, workload, result.records, clock))
            else:
                await _poisson(session, target, sessions, load, result.records, clock, maker.rng,
                               lambda s: _session(session, target, s, maker, workload, result.records, clock))
        result.duration_s = (max(r.ended for r in result.records) if result.records else clock())
    return result


async def _one(session, target: Target, spec: Spec, records: list, clock) -> None:
    record, _ = await send(session, target, spec, clock)
    records.append(record)


async def _session(session, target: Target, first: Spec, maker: Maker, workload: Workload, records: list,
                   clock) -> None:
    spec = first
    while True:
        record, reply = await send(session, target, spec, clock)
        records.append(record)
        if not record.ok or spec.turn + 1 >= workload.turns:
            return
        await asyncio.sleep(workload.think_s)
        spec = maker.next_turn(spec, reply)


async def _closed(session, target, specs: list[Spec], concurrency: int, records: list, clock, job=None) -> None:
    todo = iter(specs)
    job = job or (lambda s: _one(session, target, s, records, clock))

    async def client() -> None:
        for spec in todo:  # shared: each client takes the next when it is free
            await job(spec)

    await asyncio.gather(*(client() for _ in range(max(1, concurrency))))


async def _poisson(session, target, specs: list[Spec], load: Load, records: list, clock, rng: random.Random,
                   job=None) -> None:
    job = job or (lambda s: _one(session, target, s, records, clock))
    limit = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None

    async def limited(spec: Spec) -> None:
        if limit is None:
            return await job(spec)
        async with limit:
            await job(spec)

    tasks, at = [], 0.0
    for spec in specs:
        delay = at - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(limited(spec)))
        at += rng.expovariate(load.rate) if math.isfinite(load.rate) else 0.0
    await asyncio.gather(*tasks)
