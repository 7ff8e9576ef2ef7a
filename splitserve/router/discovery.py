"""The router's side of discovery (``--discovery``): the workers registered in the store join the
worker set, and leave it (drained) when their record goes (``docs/router.md``, *Membership*, and
``docs/security.md`` have the rules and why).

:class:`Discovery` owns the watcher of the store the URL's scheme names (``discovery/backends.py``),
which runs in threads of its own, and applies every list it makes on the router's event loop
(:meth:`Discovery.apply`). Every value is opened with the router's seal first
(``discovery/signing.py``). A new id joins as a worker pinned to the record's id and incarnation; a
new incarnation for a known id joins once the old one left; a record naming an incarnation seen
ended (:meth:`Discovery.ended`) never joins; a worker whose record is gone is checked at once and
drains if it is not routable or says ``leaving``, else only after :data:`ABSENT_GRACE_S`, at most
one a list; ids an operator removed, and workers given on the command line or by ``POST
/workers``, are left alone; a failed list changes nothing.

Everything kept per record is bounded (:data:`MEMORY`, :data:`MAX_DISCOVERED`). Metrics
(``docs/metrics.md``): ``splitserve_router_discovery_outage``, ``_errors_total``,
``_records_invalid_total`` and ``_invalid_records``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any, Callable, Coroutine, Mapping, Optional, Protocol

from splitserve.config import RouterConfig
from splitserve.discovery import backends as stores
from splitserve.log_sparsely import worth_logging
from splitserve.metrics import Registry
from splitserve.router.bounded_set import BoundedSet
from splitserve.router.workers import DISCOVERY, DRAIN_MARGIN_S, HealthChecker, Worker, WorkerSet

log = logging.getLogger(__name__)

ABSENT_GRACE_S = 30.0  # past every worker's next keepalive (TTL/3) and a relist: its record is not coming back
MEMORY = 1024  # refused values, and things said once, remembered
MAX_DISCOVERED = 1024  # workers taken from discovery records at once


class DiscoveryHost(Protocol):
    """What :class:`Discovery` uses of the router's state (``router/state.RouterState``; a test's
    stand-in needs no more): of ``config`` only ``discovery``, ``discovery_access`` and
    ``request_timeout_s``; ``checker`` None while the router does not health-check."""

    config: RouterConfig
    workers: WorkerSet
    checker: Optional[HealthChecker]

    def spawn(self, coro: Coroutine[Any, Any, None]) -> Any: ...


class Discovery:
    def __init__(self, state: DiscoveryHost, registry: Registry, absent_grace_s: float = ABSENT_GRACE_S,
                 clock: Callable[[], float] = time.monotonic, backends: Mapping = stores.BACKENDS):
        self.state, self.backends = state, backends  # backends: the stores by URL scheme
        self.outage: Optional[str] = None
        self.errors = 0
        self.lists = 0  # lists applied
        self.invalid = 0  # values refused, each counted once: when first listed under its key
        self.invalid_now = 0  # values refused in the last list
        self.invalid_seen: dict[str, bytes] = {}  # key -> digest of why its value was refused (last list)
        self._said = BoundedSet(MEMORY)
        self.absent_since: dict[str, float] = {}  # discovered worker id -> when its record was first missed
        self.superseded = BoundedSet(MEMORY)  # (id, incarnation) seen ended: its id answered, proven, as another
        self.drained: dict[str, str] = {}  # id -> the incarnation drained last (at most MEMORY ids)
        self.absent_grace_s, self.clock = absent_grace_s, clock
        self.watcher = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        registry.derived_gauge("splitserve_router_discovery_outage",
                               "1 while the router's --discovery cannot list etcd (the workers known are kept).",
                               read=lambda: int(self.outage is not None))
        registry.derived_counter("splitserve_router_discovery_errors_total",
                                 "Lists of the discovery prefix that failed (etcd unreachable or refusing).",
                                 read=lambda: self.errors)
        registry.derived_counter("splitserve_router_discovery_records_invalid_total",
                                 "Values under the discovery prefix that are no valid worker record, unsigned or "
                                 "badly signed ones included (each once, when it first appears under its key).",
                                 read=lambda: self.invalid)
        registry.derived_gauge("splitserve_router_discovery_invalid_records",
                               "Values under the discovery prefix in the last list that are no valid worker record.",
                               read=lambda: self.invalid_now)

    def start(self, loop: asyncio.AbstractEventLoop, seal) -> None:
        """Watch the store, opening every value with ``seal`` (``discovery/signing.py``)."""
        config = self.state.config
        self.loop = loop
        if self.state.checker is not None:
            self.state.checker.on_superseded.append(self.ended)
        self.watcher = stores.watch(config.discovery, config.discovery_access, seal, self._listed, self._outage,
                                    self.backends)

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()

    def ended(self, worker_id: str, incarnation: str) -> None:
        """``incarnation`` of ``worker_id`` has ended (its address answered, proven, as another):
        a record of it is a member's old record, and never replaces a routable worker."""
        self.superseded.add((worker_id, incarnation))

    # called from the watcher's thread
    def _listed(self, records, invalid) -> None:
        self.loop.call_soon_threadsafe(self.apply, records, invalid)

    def _outage(self, why: Optional[str]) -> None:
        self.loop.call_soon_threadsafe(self._set_outage, why)

    def _set_outage(self, why: Optional[str]) -> None:
        if why is not None:
            self.errors += 1
        self.outage = why

    # on the router's loop
    def apply(self, records, invalid=()) -> None:
        self.lists += 1
        self._refused(invalid)
        found = {w.id: w for w in self.state.workers.all() if w.source == DISCOVERY and not w.draining}
        for worker in found.values():  # a drained incarnation whose id now serves, proven, as another: ended
            if worker.routable and self.drained.get(worker.id, worker.incarnation) != worker.incarnation:
                self.ended(worker.id, self.drained.pop(worker.id))
        wanted = {r.id: r for r in records}
        self._leave(found, wanted)
        for record in records:
            if record.identity in self.superseded:  # an ended incarnation's record, put back: never joins
                self._say(("ended", record.identity), "discovery: the record of %s names incarnation %s, which "
                          "has ended; not used", record.id, record.incarnation)
                continue
            current = found.get(record.id)
            if current is None or current.incarnation != record.incarnation:
                self._join(record)

    def _refused(self, invalid) -> None:
        """Count each refused value once, when it first appears under its key, and log the first
        few of them and then one in many (``log_sparsely``). Only the
        last list's keys are remembered, at most :data:`MEMORY` of them (past that, a value is
        neither counted nor logged, and one line says how many were not looked at)."""
        seen, now = self.invalid_seen, {}
        for key, why in invalid[:MEMORY]:
            now[key] = hashlib.blake2b(why.encode(), digest_size=16).digest()
            if seen.get(key) != now[key]:
                self.invalid += 1
                if worth_logging(self.invalid):  # a flood of junk keys is counted, not logged line by line
                    log.warning("discovery: %s is no valid worker record, ignored (%d so far): %s", key,
                                self.invalid, why)
        if len(invalid) > MEMORY and len(seen) < MEMORY:
            log.warning("discovery: %d values under the prefix are no valid record; only the first %d are "
                        "counted and logged", len(invalid), MEMORY)
        self.invalid_seen, self.invalid_now = now, len(invalid)

    def _leave(self, found: dict, wanted: dict) -> None:
        """Drain the workers whose record is absent (gone, or naming another incarnation) and that
        are not routable; a routable one only past the grace, one per list (the module says why)."""
        now = self.clock()
        for worker_id in [i for i in self.absent_since if i not in found or self._holds(found[i], wanted.get(i))]:
            del self.absent_since[worker_id]
        overdue = []
        for worker_id, worker in found.items():
            record = wanted.get(worker_id)
            if self._holds(worker, record):
                continue
            first = worker_id not in self.absent_since
            since = self.absent_since.setdefault(worker_id, now)
            if not worker.routable or worker.leaving:
                gone = "is gone" if record is None else f"names incarnation {record.incarnation}"
                self._drain(worker, f"its record {gone} and it is {'leaving' if worker.leaving else 'not in rotation'}")
            elif now - since >= self.absent_grace_s:
                overdue.append((since, worker))
            elif first and self.state.checker is not None:  # its answer may say it left: then it drains now
                self.state.spawn(self._confirm(worker))
        if overdue:
            since, worker = min(overdue, key=lambda item: item[0])
            self._drain(worker, f"its record is gone for {now - since:.0f} s (one such worker per list)")

    def _holds(self, worker: Worker, record) -> bool:
        """Whether ``record`` keeps ``worker``: it names its incarnation, or one that has ended while
        the worker is routable (a member's old record put back is no evidence the worker left)."""
        return record is not None and (record.incarnation == worker.incarnation or
                                       worker.routable and record.identity in self.superseded)

    async def _confirm(self, worker: Worker) -> None:
        """Check a worker whose record just went; drain it if it is not routable (still absent)."""
        await self.state.checker.check(worker)
        if worker.id in self.absent_since and (not worker.routable or worker.leaving) and not worker.draining:
            self._drain(worker, "its record is gone or names another incarnation, and it is not in rotation")

    def _join(self, record) -> None:
        workers, state = self.state.workers, self.state
        if record.id in workers.removed:
            self._say(("removed", record.id), "discovery: %s was removed (DELETE /workers/%s); its record is left "
                      "alone until POST /workers names it", record.id, record.id)
            return
        other = [w for w in workers.all() if not w.draining and (w.id == record.id or w.url == record.url)]
        if any(w.source == DISCOVERY and w.id == record.id for w in other):
            return  # its old incarnation is still here: this one joins once it left (_leave)
        if other:
            self._say(("served", record.identity), "discovery: %s (%s) is already served as %s", record.id,
                      record.url, other[0].describe())
            return
        if sum(w.source == DISCOVERY for w in workers.all()) >= MAX_DISCOVERED:
            self._say(("full", record.identity), "discovery: %s left out: the router holds %d discovered workers "
                      "already", record.id, MAX_DISCOVERED)
            return
        worker = Worker(record.role, record.url, record.bootstrap_port, id=record.id,
                        incarnation=record.incarnation, source=DISCOVERY, fixed_incarnation=True,
                        fingerprint=record.model, protocol_version=record.protocol_version,
                        backend=record.transfer_backend)
        workers.add(worker)
        if state.checker is not None:
            state.spawn(state.checker.check(worker))

    def _say(self, what: tuple, message: str, *args) -> None:
        if self._said.add(what):
            log.info(message, *args)

    def _drain(self, worker: Worker, why: str) -> None:
        log.info("discovery: %s leaves: %s", worker.describe(), why)
        self.absent_since.pop(worker.id, None)
        self.drained.pop(worker.id, None)
        self.drained[worker.id] = worker.incarnation
        if len(self.drained) > MEMORY:
            del self.drained[next(iter(self.drained))]
        worker.draining = True  # at once: no leg may be picked for it from here on
        self.state.spawn(self.state.workers.drain(worker, self.state.config.request_timeout_s + DRAIN_MARGIN_S))
