"""The router's view of its workers: identity, health, membership, legs (``docs/router.md``, *Membership*).

A :class:`Worker` is one prefill or decode worker as the router sees it. Its fields are changed
only on the router's event loop (the health checker, the membership API and discovery, and the
request handlers), so no locks. Workers are tracked by the id and incarnation they report on
``/health``, not by address: a worker told about with its identity is *pinned* to it (another
identity on its URL takes it out of rotation at once), a static one to the id it first answers
with (the same id with a new incarnation is that worker restarted: :attr:`Worker.restarts`).

:class:`HealthChecker` GETs ``/health`` on every worker every ``health_interval_s`` (all at once,
each bounded), with a fresh nonce when the router holds a key; only a worker whose last answer
proved itself is routable (``worker_trust.py``). ``health_failures`` consecutive failures take a
worker out of rotation, one success brings it back; a worker coming up is asked its served model
(``/v1/models``) and pairing fields (``/get_server_info``, :meth:`Worker.pairs_with`).

:class:`WorkerSet` holds the set: ``add``, ``remove``, ``drain`` (no new legs; removed once no leg
is open), ``move`` (a worker that switched its role) and ``pick_pair`` (a prefill and a decode that
agree on model fingerprint, protocol version and transfer backend). States: ``unchecked`` ->
``healthy`` <-> ``unhealthy``; any -> ``draining`` -> removed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Union
from urllib.parse import urlsplit

import aiohttp

from splitserve.config import RouterConfig, WorkerAddress
from splitserve.discovery.proof import NONCE_HEADER, new_nonce, verify
from splitserve.discovery.record import check_url, identity_of, loads_shallow
from splitserve.hosts import check_host, url_host
from splitserve.router.answers import SMALL_ANSWER_BYTES, read_answer
from splitserve.router.bounded_set import BoundedSet
from splitserve.router.outcomes import Refusal, no_workers

log = logging.getLogger(__name__)

PREFILL, DECODE = "prefill", "decode"
STATIC, API, DISCOVERY = "static", "api", "discovery"
"""Where a worker came from: the command line, ``POST /workers``, or discovery."""
_serial = itertools.count(1)
MAX_REMOVED = 1024  # worker ids removed by an operator that the router remembers
DRAIN_MARGIN_S = 30.0  # past request_timeout_s, a leg's last bound (the prefill linger) has passed


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
    id: Optional[str] = None  # the worker's own id (None until a static worker not given one first answers)
    incarnation: Optional[str] = None  # its process start
    source: str = STATIC
    fixed_incarnation: bool = False  # discovery: only this incarnation is this worker
    draining: bool = False  # no new legs; removed once its legs ended
    restarts: int = 0  # new incarnations seen at this worker's id (static and API workers)
    fingerprint: Optional[str] = None  # model fingerprint, from its record or /get_server_info
    protocol_version: Optional[int] = None
    backend: Optional[str] = None
    proven: bool = False
    """Its last health check's answer proved it holds a key this router holds (``worker_trust.py``):
    only then is it routable and do calls to its address carry the worker key."""
    leaving: bool = False  # its last answer said it left discovery on its way out (discovery.py)
    serial: int = field(default_factory=lambda: next(_serial))
    """The router's own number for this worker object (a new incarnation of a discovered worker is
    a new object; a static worker's restart is the same object with a new :attr:`key`)."""

    @property
    def host(self) -> Optional[str]:
        """What the router sends as ``bootstrap_host``: the host of the URL in the one form the
        workers take (``hosts.check_host``; an IPv6 address in brackets), None if none would."""
        try:
            return check_host(url_host(urlsplit(self.url).hostname or ""))
        except ValueError:
            return None

    @property
    def key(self) -> str:
        """This worker's identity as one string, ``ID/INCARNATION`` (its URL until it is known)."""
        return f"{self.id}/{self.incarnation}" if self.id else self.url

    @property
    def state(self) -> str:
        if self.draining:
            return "draining"
        if self.healthy:
            return "healthy"
        return "unchecked" if self.last_error == "not checked yet" else "unhealthy"

    @property
    def routable(self) -> bool:
        return self.healthy and self.proven and not self.draining

    def pairs_with(self, other: "Worker") -> bool:
        """Whether KV can cross between this worker and ``other``: every pairing field both know agrees."""
        return all(a is None or b is None or a == b for a, b in
                   ((self.fingerprint, other.fingerprint), (self.protocol_version, other.protocol_version),
                    (self.backend, other.backend)))

    def describe(self) -> str:
        extra = f" bootstrap port {self.bootstrap_port}" if self.role == PREFILL else ""
        who = f" ({self.id}, incarnation {self.incarnation})" if self.id else ""
        return f"{self.role} worker {self.url}{extra}{who}"


@dataclass(eq=False)
class WorkerSet:
    """All workers of one router, by role."""

    prefill: list[Worker] = field(default_factory=list)
    decode: list[Worker] = field(default_factory=list)
    on_remove: list[Callable[[Worker], None]] = field(default_factory=list)
    """Called with each worker as it leaves the set (per-worker state is dropped there)."""
    refused_pairings: int = 0
    """Healthy decode workers left out of a pair because they differ from its prefill."""
    removed: BoundedSet = field(default_factory=lambda: BoundedSet(MAX_REMOVED))
    """The ids an operator removed (``DELETE /workers/{id}``): discovery adds none of them again
    until ``POST /workers`` names it (``membership.py``); the oldest forgotten past the bound."""

    @classmethod
    def from_config(cls, config: RouterConfig) -> "WorkerSet":
        def make(role: str, addr: WorkerAddress) -> Worker:
            return Worker(role, one_form(addr.url), addr.bootstrap_port if role == PREFILL else None, id=addr.id)

        return cls([make(PREFILL, a) for a in config.prefill], [make(DECODE, a) for a in config.decode])

    def all(self) -> list[Worker]:
        return self.prefill + self.decode

    def of_role(self, role: str) -> list[Worker]:
        return self.prefill if role == PREFILL else self.decode

    def healthy(self, role: str) -> list[Worker]:
        """The workers of ``role`` that may get a new leg: healthy and not draining."""
        return [w for w in self.of_role(role) if w.routable]

    def find(self, worker_id: str) -> list[Worker]:
        """The workers (every incarnation the set holds) with this id."""
        return [w for w in self.all() if w.id == worker_id]

    def add(self, worker: Worker) -> Worker:
        """Add ``worker``; ValueError when one not draining has its id or its URL already (URLs in
        :func:`one_form`: every way in writes them so)."""
        for other in self.all():
            if other.draining:
                continue
            if worker.id is not None and other.id == worker.id:
                raise ValueError(f"a worker with id {worker.id!r} is already in the set: {other.describe()}")
            if other.url == worker.url:
                raise ValueError(f"a worker at {worker.url} is already in the set: {other.describe()}")
        self.of_role(worker.role).append(worker)
        log.info("%s joined (%s)", worker.describe(), worker.source)
        return worker

    def move(self, worker: Worker, role: str) -> None:
        """``worker`` switched its role (``POST /role`` on it, which takes a new incarnation): it
        moves to the other role's list, its bootstrap port to be learned again (a prefill's, from
        its ``/get_server_info``)."""
        members = self.of_role(worker.role)
        if worker in members:
            members.remove(worker)
        worker.role, worker.bootstrap_port = role, None
        self.of_role(role).append(worker)

    def remove(self, worker: Worker) -> None:
        members = self.of_role(worker.role)
        if worker in members:
            members.remove(worker)
            log.info("%s left the set", worker.describe())
            for callback in self.on_remove:
                callback(worker)

    async def drain(self, worker: Worker, bound_s: float, poll_s: float = 0.1) -> None:
        """No new legs to ``worker``; removed once none is open (or after ``bound_s``: every leg has
        a bound of its own, so this one only guards against a count that went wrong)."""
        if not worker.draining:
            worker.draining = True
            log.info("%s is draining: %d legs in flight", worker.describe(), worker.in_flight)
        deadline = time.monotonic() + bound_s
        while worker.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
        if worker.in_flight > 0:
            log.warning("%s still counts %d legs after %.0f s: removed", worker.describe(), worker.in_flight,
                        bound_s)
        self.remove(worker)

    def ready(self) -> bool:
        """A usable pair is up: a healthy prefill and a healthy decode worker that pair."""
        return any(p.pairs_with(d) for p in self.healthy(PREFILL) for d in self.healthy(DECODE))

    def missing(self, detail: bool = True) -> Optional[str]:
        """Why there is no usable pair (None when there is), naming each role without a healthy
        worker; with ``detail``, each worker's address and state (for the log, not a client)."""
        gone = [f"no healthy {role} worker" + (f": {describe_all(ws)}" if detail else " is available")
                for role, ws in ((PREFILL, self.prefill), (DECODE, self.decode)) if not self.healthy(role)]
        if not gone and not self.ready():
            gone = ["no healthy prefill and decode worker agree on the model fingerprint, protocol version and "
                    "transfer backend" +
                    (f": {describe_pairing(self.healthy(PREFILL) + self.healthy(DECODE))}" if detail else "")]
        return "; ".join(gone) or None

    def candidates(self, role: str, exclude: Optional[dict] = None) -> list[Worker]:
        """The routable workers of ``role`` but those in ``exclude[role]`` (those that failed the
        request being retried)."""
        out = (exclude or {}).get(role, ())
        return [w for w in self.healthy(role) if w not in out]

    def has_pair(self, exclude: Optional[dict] = None) -> bool:
        """Whether a routable prefill and decode worker that pair are left, but those in ``exclude``."""
        decodes = self.candidates(DECODE, exclude)
        return any(p.pairs_with(d) for p in self.candidates(PREFILL, exclude) for d in decodes)

    def pick_pair(self, policies: dict, key: str = "", exclude: Optional[dict] = None) \
            -> Union[tuple[Worker, Worker], Refusal]:
        """A (prefill, decode) pair by the role's policies among the routable workers that pair
        (the prefill first, among those with a decode to pair with; then its decode), none of them
        in ``exclude`` (role -> workers), for a request whose routing key is ``key``; or why there
        is none (a :class:`~splitserve.router.outcomes.Refusal`)."""
        prefills, decodes = self.candidates(PREFILL, exclude), self.candidates(DECODE, exclude)
        for role, workers in ((PREFILL, prefills), (DECODE, decodes)):
            if not workers:
                return no_workers(f"no healthy {role} worker is available",
                                  f"no healthy {role} worker: {describe_all(self.of_role(role))}")
        candidates = [p for p in prefills if any(p.pairs_with(d) for d in decodes)]
        if not candidates:
            return no_workers(self.missing(detail=False) or "no prefill and decode worker pair",
                              self.missing() or "no pair")
        prefill = policies[PREFILL].pick(candidates, key)
        matching = [d for d in decodes if prefill.pairs_with(d)]
        self.refused_pairings += len(decodes) - len(matching)
        return prefill, policies[DECODE].pick(matching, key)

    def model_name(self) -> Optional[str]:
        """The served model's name as the healthy decode workers report it (else any worker's)."""
        for w in self.healthy(DECODE) + self.decode + self.prefill:
            if w.model:
                return w.model
        return None


class HealthChecker:
    """Checks every worker periodically; ``run()`` is the loop, ``check_all()`` one round."""

    def __init__(self, workers: WorkerSet, session: aiohttp.ClientSession, interval_s: float,
                 failures_to_remove: int, proof_keys: Optional[dict] = None):
        self.workers = workers
        self.proof_keys = dict(proof_keys or {})
        """The keys a worker must prove it holds one of (``worker_trust.py``); none: no proof asked."""
        self.session = session
        self.interval_s = interval_s
        self.failures_to_remove = max(1, failures_to_remove)
        self.timeout = aiohttp.ClientTimeout(total=max(0.5, min(5.0, interval_s)))
        self.on_new_incarnation: list[Callable[[Worker], None]] = []
        """Called with a static or API worker whose id came back with a new incarnation."""
        self.on_superseded: list[Callable[[str, str], None]] = []
        """Called with (id, incarnation) of a worker pinned to an incarnation whose address answers,
        proven, with its id and another incarnation: that one has ended (``discovery.py``)."""

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
        nonce = new_nonce() if self.proof_keys else None
        status, body, error = await self.probe(worker.url, nonce)
        if error is not None:
            if self.proof_keys:  # what answers there next proves itself before a prompt or key
                worker.proven = False
        else:
            error = self.proof_error(worker.url, body, nonce) or self._identity_error(worker, body)
            worker.proven = error is None  # it holds our key and is who it should be
            worker.leaving = body.get("leaving") is True  # discovery drains it once its record is gone too
            if error is not None:  # another process on its address: out at once, not after a count
                if worker.healthy:
                    log.warning("%s: %s, out of rotation", worker.describe(), error)
                worker.healthy, worker.failures, worker.last_error = False, worker.failures + 1, error
                return
            if status != 200:
                error = f"/health answered {status}" + (f" ({body['status']})" if isinstance(body.get("status"), str)
                                                        else "")
        if error is None and not worker.healthy:
            worker.model = await self._model_name(worker) or worker.model
            await self._pairing(worker)
            if worker.role == PREFILL and worker.bootstrap_port is None:  # it switched its role (POST /role)
                error = "its bootstrap port is not known yet (/get_server_info did not say it)"
            elif worker.role == PREFILL and worker.host is None:  # else every split request would be a 400
                error = "the host of its URL cannot be sent as bootstrap_host (a name, IPv4 or [IPv6] address)"
            else:
                log.info("%s is healthy, in rotation", worker.describe())
        if error is None:
            worker.healthy, worker.failures, worker.last_error = True, 0, ""
            return
        worker.failures += 1
        worker.last_error = error
        if worker.healthy and worker.failures >= self.failures_to_remove:
            worker.healthy = False
            log.warning("%s failed %d health checks (%s), out of rotation", worker.describe(), worker.failures,
                        error)

    def proof_error(self, url: str, body: dict, nonce: Optional[str]) -> Optional[str]:
        """Why an answer to ``nonce`` does not prove that it comes from a holder of our keys (None
        when it does, or when this router holds no key to ask with)."""
        if nonce is None:
            return None
        seen = identity_of(body)
        if seen is not None and verify(self.proof_keys, body.get("proof"), nonce, *seen):
            return None
        return (f"{url} does not prove it holds this router's cluster secret or worker key (its /health "
                f"answer to our nonce): it gets no request and no key")

    def _identity_error(self, worker: Worker, body: dict) -> Optional[str]:
        """Why the answer is not from ``worker`` (None when it is); learns a static worker's identity."""
        seen = identity_of(body)
        if seen is None:
            return f"{worker.url} answers /health without a worker identity: not a splitserve worker"
        seen_id, seen_incarnation = seen
        if worker.id is None or worker.incarnation is None and seen_id == worker.id:
            worker.id, worker.incarnation = seen
            log.info("%s answers as %s, incarnation %s", worker.url, seen_id, seen_incarnation)
            return None
        if seen_id != worker.id or (worker.fixed_incarnation and seen_incarnation != worker.incarnation):
            if seen_id == worker.id and self.proof_keys:  # proven: its id lives on as another incarnation
                for callback in self.on_superseded:
                    callback(worker.id, worker.incarnation)
            return (f"another process answers at {worker.url}: {seen_id} incarnation {seen_incarnation}, not "
                    f"{worker.id} incarnation {worker.incarnation}")
        role = body.get("role")
        if role in (PREFILL, DECODE) and role != worker.role:
            if worker.source == DISCOVERY:  # its new record brings it back in its new role
                return f"{worker.url} is a {role} worker now, not {worker.role}"
            log.info("%s switched its role: a %s worker now", worker.describe(), role)
            self.workers.move(worker, role)
        if seen_incarnation != worker.incarnation:
            log.info("%s restarted: incarnation %s -> %s", worker.describe(), worker.incarnation, seen_incarnation)
            worker.incarnation = seen_incarnation
            worker.restarts += 1
            worker.healthy = False  # a new process: its model and pairing are asked again
            worker.fingerprint = worker.protocol_version = worker.backend = None
            for callback in self.on_new_incarnation:
                callback(worker)
        return None

    async def probe(self, url: str, nonce: Optional[str] = None) -> tuple[int, dict, Optional[str]]:
        """``/health`` of ``url`` (asked to prove itself for ``nonce``): its status, its JSON body
        (``{}`` when it is none) and why it could not be read (None when it was)."""
        headers = {NONCE_HEADER: nonce} if nonce else None
        try:
            async with self.session.get(url + "/health", timeout=self.timeout, headers=headers,
                                        allow_redirects=False) as resp:
                raw = await read_answer(resp, SMALL_ANSWER_BYTES)  # and by the check's timeout
                try:
                    body = loads_shallow(raw) if len(raw) <= 65536 else {}
                except ValueError:
                    body = {}
                return resp.status, body if isinstance(body, dict) else {}, None
        except asyncio.TimeoutError:
            return 0, {}, "/health timed out"
        except aiohttp.ClientError as exc:
            return 0, {}, f"/health failed: {type(exc).__name__}: {exc}"

    async def _model_name(self, worker: Worker) -> Optional[str]:
        try:
            async with self.session.get(worker.url + "/v1/models", timeout=self.timeout) as resp:
                if resp.status != 200:
                    return None
                data = loads_shallow(await read_answer(resp, SMALL_ANSWER_BYTES)).get("data") or []
                name = data[0].get("id") if data and isinstance(data[0], dict) else None
                return name if isinstance(name, str) else None
        except (asyncio.TimeoutError, aiohttp.ClientError, ValueError, AttributeError):
            return None

    async def _pairing(self, worker: Worker) -> None:
        """The model fingerprint, protocol version and transfer backend from ``/get_server_info``
        (a worker without them, or that does not answer, keeps what its record said, or None)."""
        try:
            async with self.session.get(worker.url + "/get_server_info", timeout=self.timeout) as resp:
                info = loads_shallow(await read_answer(resp, SMALL_ANSWER_BYTES)) if resp.status == 200 else {}
        except (asyncio.TimeoutError, aiohttp.ClientError, ValueError):
            return
        if not isinstance(info, dict):
            return
        fingerprint, version, backend, port = (info.get(k) for k in ("model_fingerprint", "protocol_version",
                                                                    "transfer_backend", "bootstrap_port"))
        if worker.role == PREFILL and worker.bootstrap_port is None and isinstance(port, int) \
                and not isinstance(port, bool) and 0 < port < 65536:  # one that switched its role: its own
            worker.bootstrap_port = port
        if isinstance(fingerprint, str) and len(fingerprint) <= 256:
            worker.fingerprint = fingerprint
        if isinstance(version, int) and not isinstance(version, bool):
            worker.protocol_version = version
        if isinstance(backend, str) and len(backend) <= 16:
            worker.backend = backend


def one_form(url: str) -> str:
    """A worker's URL as discovery and ``POST /workers`` write it (``record.check_url``), so that
    the set compares one spelling per address; one it refuses (a path, say) as given."""
    try:
        return check_url(url)
    except ValueError:
        return url.rstrip("/")


def describe_all(workers: Iterable[Worker]) -> str:
    return ", ".join(f"{w.url} ({'up' if w.routable else 'draining' if w.draining else 'down: ' + w.last_error})"
                     for w in workers)


def describe_pairing(workers: Iterable[Worker]) -> str:
    return ", ".join(f"{w.role} {w.url} ({w.fingerprint}, protocol {w.protocol_version}, {w.backend})"
                     for w in workers)
