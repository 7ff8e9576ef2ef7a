"""``POST /role``: a prefill worker becomes a decode worker or back, with the model it holds.

Behind the admin key (``auth.WORKER_ROUTES``). The body is ``{"role": "prefill"|"decode", "epoch":
N}``. A worker keeps an **epoch**: 0 at start, one more at every switch it begins, reported on
``/health`` and ``/get_server_info`` beside its id, incarnation and role; a request names the epoch
it expects. The answers (200 switched or already so, 400, 409 for a stale epoch, a switch under
way or a role the worker cannot take, 503, 500 when the new role could not start and the old one
serves again) are listed in ``docs/lifecycle.md``, *A role switch*, with what the switch does to
each state of each role.

The switch (:func:`switch`), in order: leave discovery (the lease revoked; for
``--discovery-grace-s`` the worker still serves what routers already sent); drain (new requests get
503, every room leaves by its own bounds, for at most ``--drain-timeout-s``); on the engine loop
(``AsyncEngine.replace_role``) fail what is left, close the old role's control plane (goodbye to
every peer) and transfer agent, give back every page, and build and start the new role on the same
engine and KV pool under a **new incarnation**; write the new role to ``--role-file``
(``server/role_file.py``); serve again and register the new record. It runs in a task of its own:
a client that disconnects does not stop it half way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from aiohttp import web

from splitserve.auth import check_bootstrap_trust
from splitserve.discovery.record import loads_shallow
from splitserve.errors import error_body
from splitserve.http_util import read_body
from splitserve.server.role_file import keep_role

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
MAX_EPOCH = 2**53  # a JSON number every client reads exactly
POLL_S = 0.05


class SwitchFailed(Exception):
    """The new role could not start; the worker is back in its old one (or, if that failed too,
    not ready)."""


def parse(body: object) -> tuple[str, int]:
    """The role and epoch of a ``POST /role`` body; ValueError naming what is wrong."""
    if not isinstance(body, dict):
        raise ValueError('the body is a JSON object: {"role": "prefill"|"decode", "epoch": N}')
    unknown = sorted(set(body) - {"role", "epoch"})
    if unknown:
        raise ValueError(f"unknown fields: {', '.join(map(repr, unknown[:5]))} (known: epoch, role)"[:300])
    role, epoch = body.get("role"), body.get("epoch")
    if role not in ROLES:
        raise ValueError(f"role: prefill or decode, not {role!r}"[:200])
    if not isinstance(epoch, int) or isinstance(epoch, bool) or not 0 <= epoch <= MAX_EPOCH:
        raise ValueError(f"epoch: the worker's epoch as it reports it (an integer from 0), not {epoch!r}"[:200])
    return role, epoch


def _refuse(status: int, message: str, code: str, param=None) -> web.Response:
    return web.json_response(error_body(message, status, code=code, param=param), status=status)


def _now(state) -> dict:
    return {"role": state.config.role, "epoch": state.epoch, "incarnation": state.incarnation}


async def handle(request: web.Request, state) -> web.Response:
    """``POST /role`` (module docstring)."""
    raw = await read_body(request, state.config.client_body_timeout_s, state.config.max_body_bytes)
    try:
        role, epoch = parse(loads_shallow(raw) if raw else None)  # too deep a body: a ValueError too
    except ValueError as exc:  # json's own errors are ValueErrors too
        return _refuse(400, f"POST /role: {exc}", "invalid_role_request")
    if not state.engine.ready:
        return _refuse(503, "the model is still loading", "not_ready")
    if state.stopping:
        return _refuse(503, "the worker is shutting down", "draining")
    if state.config.role not in ROLES:
        return _refuse(409, f"a {state.config.role} worker has no prefill or decode role to switch", "role_unavailable")
    if state.switch is not None:
        return _refuse(409, f"a switch to {state.switch_to} is under way (epoch {state.epoch}); ask again once it "
                            "is done", "role_switch_in_progress")
    if epoch != state.epoch:
        return _refuse(409, f"epoch {epoch} is not this worker's: it is at epoch {state.epoch}, a "
                            f"{state.config.role} worker (incarnation {state.incarnation}); read /health and ask again",
                       "stale_epoch", param="epoch")
    if role == state.config.role:
        return web.json_response({**_now(state), "switched": False})
    target = dataclasses.replace(state.config, role=role)
    try:
        check_bootstrap_trust(target)
    except ValueError as exc:
        return _refuse(409, f"this worker cannot become a {role} worker: {exc}", "role_unavailable")
    previous = _now(state)
    state.epoch += 1  # at once: a second request with the same epoch is stale, whatever happens next
    state.switch_to = role
    state.switch = asyncio.ensure_future(switch(state, target))
    state.switch.add_done_callback(lambda task: task.cancelled() or task.exception())  # also when nobody waits
    try:
        released = await asyncio.shield(state.switch)
    except SwitchFailed as exc:
        return _refuse(500, f"the switch to {role} failed: {exc}", "role_switch_failed")
    return web.json_response({**_now(state), "switched": True, "previous": previous, "pages_released": released})


async def switch(state, target, make_role=None) -> int:
    """Switch ``state``'s worker to ``target`` (its config with the new role); the pages the old
    role still held when it closed (0 after a clean drain). Raises :class:`SwitchFailed`.

    ``make_role(config, deadlines, incarnation)`` builds a role, not started (by default
    ``disagg.worker.role_for``; a test passes one that fails, to reach the path where the old role
    never stopped)."""
    from splitserve.disagg.bootstrap import new_incarnation
    from splitserve.disagg.worker import role_for

    make_role = make_role or role_for
    loop = asyncio.get_running_loop()
    config, engine = state.config, state.engine
    goodbye = f"it becomes a {target.role} worker (epoch {state.epoch})"
    log.info("role switch: %s -> %s (epoch %d) begins", config.role, target.role, state.epoch)
    try:
        old = engine.role
        try:
            await _leave(state, loop)
            await _drain(state, config.drain_timeout_s)
            deadlines = old.deadlines
            incarnation = new_incarnation()
            role = make_role(target, deadlines, incarnation)
            state.metrics.attach(role, target.role)
        except Exception as exc:  # the old role never stopped: it serves again
            log.exception("role switch: could not prepare the %s role; the %s role serves on", target.role,
                          config.role)
            state.metrics.attach(old, config.role)
            _serve(state)
            raise SwitchFailed(f"{type(exc).__name__}: {exc}; the worker serves as a {config.role} on "
                               f"(incarnation {state.incarnation})") from exc
        try:
            released = await loop.run_in_executor(None, engine.replace_role, role, goodbye)
        except Exception as exc:
            log.exception("role switch: the %s role could not start; back to %s", target.role, config.role)
            await _back(state, loop, config, deadlines, f"the switch to {target.role} failed", make_role)
            raise SwitchFailed(f"{type(exc).__name__}: {exc}; the worker serves as a {config.role} again "
                               f"(incarnation {state.incarnation})") from exc
        if released:
            log.warning("role switch: the %s role still held %d pages when it closed (given back)", config.role,
                        released)
        state.config, state.incarnation = target, incarnation
        _record_role(target)
        _serve(state)
        log.info("role switch: a %s worker now, incarnation %s, epoch %d", target.role, incarnation, state.epoch)
        return released
    finally:
        state.switch, state.switch_to = None, None


async def _leave(state, loop) -> None:
    """Out of discovery first (routers stop sending), still serving for the grace period."""
    registration, state.registration = state.registration, None
    if registration is None:
        return
    await loop.run_in_executor(None, registration.revoke)
    grace = state.config.discovery_grace_s
    log.info("role switch: serving %.1f s more before draining", grace)
    await asyncio.sleep(grace)


async def _drain(state, timeout_s: float) -> None:
    """503 for new requests; wait until no handler runs and the role holds nothing (bounded)."""
    state.draining = True
    state.engine.begin_drain()
    role = state.engine.role
    log.info("role switch: draining %d requests, waiting up to %.1f s", len(state.inflight), timeout_s)
    deadline = time.monotonic() + timeout_s
    while (state.inflight or not role.holds_nothing()) and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    if state.inflight or not role.holds_nothing():
        log.warning("role switch: %d requests and %d rooms still here after %.1f s: they end now",
                    len(state.inflight), len(role.rooms), timeout_s)


async def _back(state, loop, config, deadlines, why: str, make_role) -> None:
    """The old role again, under a new incarnation; if even that fails, the worker stays draining
    (``/health`` 503) and says so."""
    from splitserve.disagg.bootstrap import new_incarnation

    incarnation = new_incarnation()
    role = make_role(config, deadlines, incarnation)
    state.metrics.attach(role, config.role)
    try:
        await loop.run_in_executor(None, state.engine.replace_role, role, why)
    except Exception:
        log.exception("role switch: the %s role could not start again either: this worker takes no requests "
                      "until it is restarted", config.role)
        raise SwitchFailed(f"and the {config.role} role could not start again: restart the worker") from None
    state.incarnation = incarnation
    _serve(state)


def _record_role(config) -> None:
    """The new role in ``--role-file``, before the switch is answered: a worker killed right after
    comes back in it. A file that cannot be written is logged, and the switch stands."""
    if config.role_file:
        keep_role(config.role_file, config.role, "role switch")


def _serve(state) -> None:
    """Take requests again, and register the worker as it is now (``--discovery``), unless it was
    told to stop meanwhile (SIGTERM: it drains for good)."""
    if state.stopping:
        return
    state.draining = False
    state.engine.end_drain()
    if state.register is not None:
        state.registration = state.register()
