"""The router's membership API (admin key): ``POST /workers``, ``DELETE /workers/{id}``.

Shaped after SGLang's model gateway (``POST /workers`` with ``url``, ``worker_type`` and
``bootstrap_port``, answered 202 with the ``worker_id``; ``DELETE /workers/{worker_id}``), with
splitserve's identity rules (``workers.py``); the fields and every answer are ``docs/router.md``'s
table. ``POST /workers`` asks the worker's ``/health`` at once (bounded): it must answer with an
identity, the ``id`` (and ``incarnation``) given if given, and prove itself to a router with keys
(``worker_trust.py``); it is then pinned to that id and takes part in routing from its first
healthy check. ``DELETE /workers/{id}`` drains every incarnation with that id and remembers the id
as removed (``WorkerSet.removed``, bounded), so discovery adds it again only once ``POST /workers``
names it. Every field is validated like the network input it is (``discovery/record.py``): the URL
and bootstrap port are what decode workers will dial.
"""

from __future__ import annotations

import logging

from aiohttp import web

from splitserve.config import DEFAULT_BOOTSTRAP_PORT
from splitserve.discovery.proof import new_nonce
from splitserve.discovery.record import (check_id, check_incarnation, check_port, check_url, identity_of,
                                        loads_shallow)
from splitserve.router.state import RouterState
from splitserve.router.workers import API, DECODE, DRAIN_MARGIN_S, PREFILL, Worker
from splitserve.errors import error_body

log = logging.getLogger(__name__)


def _refuse(status: int, message: str, code: str) -> web.Response:
    return web.json_response(error_body(message, status, code=code), status=status)


def parse_worker(body: object) -> dict:
    """The fields of a ``POST /workers`` body, validated; ValueError naming the first wrong one."""
    if not isinstance(body, dict):
        raise ValueError("the body is a JSON object: url, worker_type, bootstrap_port, id, incarnation")
    known = {"url", "worker_type", "role", "bootstrap_port", "id", "incarnation"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise ValueError(f"unknown fields: {', '.join(map(repr, unknown[:5]))} (known: {', '.join(sorted(known))})")
    if "worker_type" in body and "role" in body and body["worker_type"] != body["role"]:
        raise ValueError("worker_type and role differ: give one")
    role = body.get("worker_type", body.get("role"))
    if role not in (PREFILL, DECODE):
        raise ValueError(f"worker_type: prefill or decode, not {role!r}"[:200])
    port = body.get("bootstrap_port")
    if role == PREFILL:
        port = check_port(DEFAULT_BOOTSTRAP_PORT if port is None else port)
    elif port is not None:
        raise ValueError("bootstrap_port: a decode worker has none")
    worker_id = None if body.get("id") is None else check_id(body["id"])
    incarnation = None if body.get("incarnation") is None else check_incarnation(body["incarnation"])
    if incarnation is not None and worker_id is None:
        raise ValueError("incarnation: give the id with it")
    return {"url": check_url(body.get("url")), "role": role, "bootstrap_port": port, "id": worker_id,
            "incarnation": incarnation}


async def add(state: RouterState, request: web.Request) -> web.Response:
    try:
        fields = parse_worker(loads_shallow(await request.read()))
    except ValueError as exc:  # not JSON, nested too deep, or a field that is wrong
        return _refuse(400, f"POST /workers: {exc}", "invalid_worker")
    workers = state.workers
    for other in workers.all():
        if not other.draining and (other.url == fields["url"] or (fields["id"] and other.id == fields["id"])):
            return _refuse(409, f"already in the set: {other.describe()}", "worker_exists")
    nonce = new_nonce() if state.checker.proof_keys else None
    status, body, error = await state.checker.probe(fields["url"], nonce)
    if error is not None:
        return _refuse(502, f"{fields['url']} cannot be reached: {error}", "worker_unreachable")
    seen = identity_of(body)
    if seen is None:
        return _refuse(409, f"{fields['url']} answers /health without a worker identity: not a splitserve worker",
                       "not_a_worker")
    unproven = state.checker.proof_error(fields["url"], body, nonce)
    if unproven is not None:
        return _refuse(409, unproven, "worker_unproven")
    if fields["id"] is not None and seen[0] != fields["id"] or \
            fields["incarnation"] is not None and seen[1] != fields["incarnation"]:
        return _refuse(409, f"{fields['url']} answers as {seen[0]} incarnation {seen[1]}, not "
                            f"{fields['id']} incarnation {fields['incarnation'] or 'any'}", "identity_mismatch")
    if isinstance(body.get("role"), str) and body["role"] != fields["role"]:
        return _refuse(409, f"{fields['url']} is a {body['role']} worker, not {fields['role']}", "role_mismatch")
    worker = Worker(fields["role"], fields["url"], fields["bootstrap_port"], id=seen[0], incarnation=seen[1],
                    source=API, fixed_incarnation=fields["incarnation"] is not None)
    try:
        workers.add(worker)
    except ValueError as exc:  # raced with another add
        return _refuse(409, str(exc), "worker_exists")
    if workers.removed.discard(worker.id):
        log.info("POST /workers: %s was removed before; it is taken back", worker.id)
    state.spawn(state.checker.check(worker))
    from splitserve.router.debug import worker_view

    return web.json_response({"status": "accepted", "worker_id": worker.id, "worker": worker_view(worker)},
                             status=202)


async def remove(state: RouterState, worker_id: str) -> web.Response:
    found = [w for w in state.workers.find(worker_id)]
    if not found:
        return _refuse(404, f"no worker with id {worker_id!r}"[:300], "worker_not_found")
    bound = state.config.request_timeout_s + DRAIN_MARGIN_S
    state.workers.removed.add(worker_id)  # discovery brings back no incarnation of it
    for worker in found:
        if not worker.draining:  # at once: no leg may be picked for it after this answer
            worker.draining = True
            log.info("DELETE /workers/%s: %s drains, %d legs in flight", worker_id, worker.describe(),
                     worker.in_flight)
            state.spawn(state.workers.drain(worker, bound))
    return web.json_response({"status": "draining", "worker_id": worker_id,
                              "in_flight": sum(w.in_flight for w in found)}, status=202)
