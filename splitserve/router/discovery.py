"""The router's side of etcd discovery (``--discovery``): the workers registered under the prefix
join the worker set, and leave it (drained) when their record goes.

:class:`Discovery` owns a :class:`~splitserve.discovery.etcd.Watcher` (its own threads) and applies
every list it makes on the router's event loop (:meth:`Discovery.apply`):

- a record whose id the set does not hold: a new worker, pinned to the record's id *and*
  incarnation (``workers.py``), its pairing fields taken from the record, checked at once;
- a record with a new incarnation for a known id: the old incarnation drains (it has ended) and the
  new one joins;
- a discovered worker without a record any more (its lease was revoked at SIGTERM, or expired:
  crashed or partitioned): it drains and leaves, so it is out of rotation within the TTL plus one
  list (:data:`~splitserve.discovery.etcd.RELIST_S`);
- a record naming the id or the URL of a worker given on the command line or by ``POST /workers`` is
  left alone (that worker is already served; said once);
- a failed list changes nothing: the known workers stay and are health-checked as ever.

Metrics (``docs/metrics.md``): ``splitserve_router_discovery_outage`` (1 while etcd cannot be
listed), ``splitserve_router_discovery_errors_total`` (failed lists),
``splitserve_router_discovery_records_invalid_total`` (values under the prefix that are no valid
record, each counted once per value).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from splitserve.router.workers import DISCOVERY, Worker

log = logging.getLogger(__name__)


class Discovery:
    def __init__(self, state, registry):
        self.state = state
        self.outage: Optional[str] = None
        self.errors = 0
        self.invalid_seen: set = set()
        self._said: set = set()
        self.watcher = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        registry.derived_gauge("splitserve_router_discovery_outage",
                               "1 while the router's --discovery cannot list etcd (the workers known are kept).",
                               read=lambda: int(self.outage is not None))
        registry.derived_counter("splitserve_router_discovery_errors_total",
                                 "Lists of the discovery prefix that failed (etcd unreachable or refusing).",
                                 read=lambda: self.errors)
        registry.derived_counter("splitserve_router_discovery_records_invalid_total",
                                 "Values under the discovery prefix that are no valid worker record (each once).",
                                 read=lambda: len(self.invalid_seen))

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        from splitserve.discovery.etcd import Credentials, Watcher, parse_target

        config = self.state.config
        self.loop = loop
        self.watcher = Watcher(parse_target(config.discovery), self._listed, self._outage,
                               Credentials.of(config)).start()

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()

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
        for key, why in invalid:
            if (key, why) not in self.invalid_seen:
                self.invalid_seen.add((key, why))
                log.warning("discovery: %s is no valid worker record, ignored: %s", key, why)
        workers, state = self.state.workers, self.state
        found = {w.id: w for w in workers.all() if w.source == DISCOVERY and not w.draining}
        wanted = {r.id: r for r in records}
        for worker_id, worker in found.items():
            record = wanted.get(worker_id)
            if record is None or record.incarnation != worker.incarnation:
                why = "its record is gone" if record is None else f"incarnation {record.incarnation} replaces it"
                log.info("discovery: %s leaves: %s", worker.describe(), why)
                self._drain(worker)
        for record in records:
            current = found.get(record.id)
            if current is not None and current.incarnation == record.incarnation:
                continue
            other = [w for w in workers.all() if not w.draining and (w.id == record.id or w.url == record.url)]
            if other:
                if record.identity not in self._said:
                    self._said.add(record.identity)
                    log.info("discovery: %s (%s) is already served as %s", record.id, record.url,
                             other[0].describe())
                continue
            worker = Worker(record.role, record.url, record.bootstrap_port, id=record.id,
                            incarnation=record.incarnation, source=DISCOVERY, fixed_incarnation=True,
                            fingerprint=record.model, protocol_version=record.protocol_version,
                            backend=record.transfer_backend)
            workers.add(worker)
            if state.checker is not None:
                state.spawn(state.checker.check(worker))

    def _drain(self, worker: Worker) -> None:
        from splitserve.router.membership import DRAIN_MARGIN_S

        worker.draining = True  # at once: no leg may be picked for it from here on
        self.state.spawn(self.state.workers.drain(worker, self.state.config.request_timeout_s + DRAIN_MARGIN_S))
