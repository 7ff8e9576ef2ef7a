"""The router's views for operators: ``GET /workers`` and ``GET /debug/requests/{rid}``.

- ``/workers``: every worker the router knows, its role, identity (id, incarnation), state,
  health (and why not), legs in flight, bootstrap port, model and what it pairs by: what
  ``splitserve top`` starts from.
- ``/debug/requests/{rid}``: one request as the router and both its workers saw it. The router
  keeps a record of each request (``recent.RecentRequests``: live ones, and the last
  ``recent.RECENT_REQUESTS`` ended ones) with the pair of workers it chose; it asks both for their
  timeline of ``rid`` (``/debug/requests/{rid}`` on a worker) at once, each within
  :data:`ASK_TIMEOUT_S`, and joins them: the router's record, each worker's answer, and every
  step of both in the order of their wall-clock times. A request tried again (``retry.py``) has
  one attempt per room in its record, each with its pair and the id its workers know it by
  (``proxy.attempt_rid``); every attempt's pair is asked. A request the router does not remember
  is asked of every worker.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING
from urllib.parse import quote

import aiohttp
from aiohttp import web

from splitserve.router.answers import LARGE_ANSWER_BYTES, read_answer
from splitserve.router.legs import describe_error
from splitserve.router.workers import Worker
from splitserve.errors import error_body
from splitserve.discovery.record import loads_shallow

if TYPE_CHECKING:
    from splitserve.router.state import RouterState

ASK_TIMEOUT_S = 5.0


def worker_view(w: Worker) -> dict:
    return {"role": w.role, "url": w.url, "bootstrap_port": w.bootstrap_port, "healthy": w.healthy,
            "in_flight": w.in_flight, "model": w.model, "failures": w.failures,
            "error": None if w.healthy else w.last_error, "id": w.id, "incarnation": w.incarnation,
            "state": w.state, "source": w.source, "restarts": w.restarts, "model_fingerprint": w.fingerprint,
            "protocol_version": w.protocol_version, "transfer_backend": w.backend}


async def workers(state: RouterState) -> web.Response:
    return web.json_response({"model": state.workers.model_name(), "ready": state.workers.ready(),
                              "workers": [worker_view(w) for w in state.workers.all()]})


async def request_timelines(state: RouterState, rid: str) -> web.Response:
    entry = state.recent.get(rid)
    if entry is not None:  # each attempt's pair, asked for the id that attempt had there
        by_url = {w.url: w for w in state.workers.all()}
        targets = [(by_url[url], a["rid"]) for a in entry["attempts"] for url in (a["prefill"], a["decode"])
                   if url in by_url]
    else:
        targets = [(w, rid) for w in state.workers.all()]
    answers = await asyncio.gather(*(_ask(state.session, w, worker_rid) for w, worker_rid in targets))
    found = [a for a in answers if a.get("timeline") is not None]
    if entry is None and not found:
        message = f"request {rid!r} is neither live nor among the recently ended ones on the router or its workers"
        return web.json_response(error_body(message, 404), status=404)
    steps = sorted(({"role": a["role"], "url": a["url"], **s} for a in found for s in a["timeline"]["steps"]),
                   key=lambda s: s["time"])
    return web.json_response({"rid": rid, "router": entry, "workers": answers, "steps": steps})


async def _ask(session: aiohttp.ClientSession, w: Worker, rid: str) -> dict:
    answer = {"role": w.role, "url": w.url, "rid": rid, "timeline": None, "error": None}
    try:
        async with session.get(f"{w.url}/debug/requests/{quote(rid, safe='')}",
                               timeout=aiohttp.ClientTimeout(total=ASK_TIMEOUT_S)) as resp:
            body = loads_shallow(await read_answer(resp, LARGE_ANSWER_BYTES))
            if resp.status == 200:
                answer["timeline"] = body
            else:
                answer["error"] = f"{resp.status}: {(body.get('error') or {}).get('message', '')}"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError) as exc:
        answer["error"] = describe_error(exc)
    return answer
