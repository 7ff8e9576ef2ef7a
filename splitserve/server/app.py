"""The worker's HTTP front end (aiohttp): its routes and middlewares.

Routes::

    POST /v1/completions, /v1/chat/completions   OpenAI API (streaming with SSE)
    POST /generate                               SGLang's native API
    GET  /v1/models, /health, /metrics           model list, readiness (200/503), Prometheus
    GET  /get_server_info, /get_model_info       what SGLang's gateway asks a worker
    GET  /debug/requests                         every live request (room, state, age, deadline, late, peer)
    GET  /debug/requests/{rid}, /debug/rooms/{room}  one request's timeline on this worker (live or recent)
    POST /flush_cache                            drop the prefix cache's unowned pages
    POST /abort_request                          end one request for a stated cause (server/abort_request.py)
    POST /tokenize, /detokenize                  text or messages to token ids and back (server/tokenization.py)
    POST /role                                   prefill <-> decode, with the model it holds (server/role_switch.py)

:func:`create_app` builds the application around an engine (anything with the ``AsyncEngine``
interface, so tests can hand in a fake). What the handlers share is one
:class:`~splitserve.server.state.WorkerState` on the app; the process around the app (listening,
signals, the drain) is ``server/process.py``, the loop watchdog ``server/watchdog.py``.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Optional

from aiohttp import web

from splitserve.auth import (METRICS, WORKER_ROUTES, access_middlewares, caller_may)
from splitserve.client_writer import send
from splitserve.config import ServerConfig
from splitserve.cpus import current_placement, format_cpu_list
from splitserve.engine.io import FLUSH_WAIT_S, InvalidRequest
from splitserve.http_util import ConnectionCap, answer_expect_in_json, check_client_bounds, read_body
from splitserve.metrics import CONTENT_TYPE, Registry
from splitserve.server import abort_request, role_switch, tokenization
from splitserve.server.generation import RID, engine_error_response, json_error, serve_generation
from splitserve.server.identity_proof import answer as answer_nonce
from splitserve.server.openai_protocol import internal_error_text
from splitserve.server.state import STATE, WorkerState
from splitserve.server.watchdog import loop_watchdog
from splitserve.validation import MAX_ROOM, REQUEST_ID

log = logging.getLogger(__name__)


def create_app(engine, config: ServerConfig, registry: Optional[Registry] = None,
               incarnation: Optional[str] = None) -> web.Application:
    """``incarnation``: this process start's id (drawn when None)."""
    registry = registry or Registry()
    access = access_middlewares(config, registry, WORKER_ROUTES, on_worker=True)
    middlewares = [_bounded_send, _http_middleware, *access]
    check_client_bounds(config)
    answer_expect_in_json()  # before its routes: an Expect header's 417 repeats nothing of it
    app = web.Application(middlewares=middlewares, client_max_size=config.max_body_bytes)
    state = WorkerState(engine, config, registry, incarnation)
    state.connections = ConnectionCap(config.max_connections, registry)
    app[STATE] = state
    app.on_cleanup.append(_on_cleanup)
    app.on_response_prepare.append(_echo_request_id)
    app.cleanup_ctx.append(loop_watchdog)
    for path, endpoint in (("/v1/completions", "completions"), ("/v1/chat/completions", "chat"),
                           ("/generate", "generate")):
        app.router.add_post(path, _generation_handler(endpoint))
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/get_server_info", _server_info)
    app.router.add_get("/get_model_info", _model_info)
    app.router.add_get("/debug/requests", _debug_requests)
    app.router.add_get("/debug/requests/{rid}", _debug_timeline)
    app.router.add_get("/debug/rooms/{room}", _debug_timeline)
    app.router.add_post("/flush_cache", _flush_cache)
    app.router.add_post("/abort_request", _abort_request)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_post("/role", _role)
    return app


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """A generation answer carries its request id (``X-Request-Id``): the client's ``rid``, the
    router's header, or one drawn here."""
    rid = request.get(RID)
    if rid is not None:
        response.headers[REQUEST_ID] = rid


async def _on_cleanup(app: web.Application) -> None:
    app[STATE].tokenize.shutdown()
    app[STATE].grammars.shutdown()


def _generation_handler(endpoint: str):
    async def handler(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        task = asyncio.current_task()
        state.inflight.add(task)
        try:
            return await serve_generation(state, request, endpoint)
        finally:
            state.inflight.discard(task)

    handler.__name__ = f"{endpoint}_handler"
    return handler


@web.middleware
async def _bounded_send(request: web.Request, handler):
    """Every answer not already sent by its handler (all but streams) is sent here, each write
    bounded by ``--client-write-timeout-s`` (aiohttp would wait for a client that does not read)."""
    response = await handler(request)
    await send(request, response, request.app[STATE].config.client_write_timeout_s)
    return response


@web.middleware
async def _http_middleware(request: web.Request, handler):
    """Count every request by route and status; turn errors into OpenAI error bodies."""
    state = request.app[STATE]
    resource = request.match_info.route.resource
    path = resource.canonical if resource is not None else "unmatched"
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        text = exc.text or ""
        message = text if text and not text.startswith(f"{exc.status}:") else \
            f"{exc.reason}: {request.method} {request.path}"
        return json_error(message, exc.status, headers=headers or None)
    except asyncio.CancelledError:
        status = 499  # the client went away
        raise
    except Exception:  # one request's bug is that request's 500, never the worker's end; its text to the log only
        log.exception("error serving %s %s rid=%s", request.method, request.path, request.get(RID))
        rid = request.get(RID)
        return json_error(internal_error_text(rid), 500)
    finally:
        state.metrics.http_requests.labels(path=path, status=str(status)).inc()


# -- small endpoints -------------------------------------------------------------------------------


async def _health(request: web.Request) -> web.Response:
    """200 when ready; 503 while loading or draining, and while the engine loop or one of the
    role's threads is wedged (``--loop-stall-s``: what is wedged only to a caller who may read
    /metrics). Every answer names the worker (id, incarnation, role, epoch), proves it to a
    router that sent a nonce (``identity_proof.py``), and says ``leaving`` once the worker left
    discovery on its way out."""
    state = request.app[STATE]
    engine = state.engine
    who = {**state.identity(), **answer_nonce(request.headers, state.keys, state.identity()),
           **({"leaving": True} if state.leaving else {})}
    problem = getattr(engine, "health_problem", lambda: None)()
    if problem is not None:
        details = {"problem": problem, "loop_age_s": round(engine.loop_age(), 3), "loop_stall_s": engine.loop_stall_s}
        return web.json_response({"status": "stalled", **who, **(details if caller_may(request, METRICS) else {})},
                                 status=503)
    if state.accepting():
        return web.json_response({"status": "ok", **who})
    status = "draining" if state.draining or state.engine.draining else "loading"
    return web.json_response({"status": status, **who}, status=503)


async def _debug_requests(request: web.Request) -> web.Response:
    """Every live request: rid, room, role, state, age_s, state_age_s, deadline_s, late, peer."""
    state = request.app[STATE]
    _require_ready(state)
    return web.json_response(state.engine.debug_requests())  # read as it is now: never waits on the loop


async def _debug_timeline(request: web.Request) -> web.Response:
    """Every state one request passed on this worker, with its times and the events that moved it
    (``splitserve/timeline.py``), live or among the recently ended ones; 404 if it is not known."""
    state = request.app[STATE]
    _require_ready(state)
    rid, room = request.match_info.get("rid"), request.match_info.get("room")
    if room is not None:
        room = _room_number(room)
    found = getattr(state.engine, "timeline", lambda **kw: None)(rid=rid, room=room)
    if found is None:
        what = f"request {rid!r}" if rid is not None else f"room {room}"
        return json_error(f"{what} is neither live nor among the recently ended ones on this worker", 404)
    return web.json_response(found)


_ROOM = re.compile(r"[0-9]{1,%d}" % len(str(MAX_ROOM - 1)))  # ASCII digits: str.isdigit also takes "²"


def _room_number(text: str) -> int:
    """A room from a URL: a decimal number in [0, 2**63), else 400 (never parsed when it is longer
    than the largest room: Python refuses to parse ints of more than 4,300 digits)."""
    if _ROOM.fullmatch(text) and int(text) < MAX_ROOM:
        return int(text)
    shown = text if len(text) <= 32 else text[:32] + "..."
    raise web.HTTPBadRequest(text=f"a room is a decimal number in [0, 2**63), not {shown!r}")


async def _flush_cache(request: web.Request) -> web.Response:
    """Drop every prefix-cache page no request owns (as SGLang's ``/flush_cache``); 503 if the
    engine loop is in a step longer than ``FLUSH_WAIT_S``."""
    state = request.app[STATE]
    _require_ready(state)
    try:
        flushed = await asyncio.get_running_loop().run_in_executor(None, state.engine.flush_cache)
    except TimeoutError:  # the flush still runs when the loop gets to it
        return json_error(f"the engine loop did not get to the flush within {FLUSH_WAIT_S:g} s (a long step?); "
                          "try again", 503, code="loop_busy", headers={"Retry-After": "1"})
    return web.json_response({"flushed_pages": flushed})


async def _abort_request(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _require_ready(state)
    return await abort_request.handle(request, state, json_error)


async def _role(request: web.Request) -> web.Response:
    return await role_switch.handle(request, request.app[STATE])


async def _tokenize(request: web.Request) -> web.Response:
    return await _tokenization(request, "tokenize")


async def _detokenize(request: web.Request) -> web.Response:
    return await _tokenization(request, "detokenize")


async def _tokenization(request: web.Request, which: str) -> web.Response:
    """``/tokenize`` or ``/detokenize`` (``server/tokenization.py``), validated and run in the
    body's tokenize lane; a refusal is a 4xx naming its field."""
    state = request.app[STATE]
    _require_ready(state)
    raw = await read_body(request, state.config.client_body_timeout_s, state.config.max_body_bytes)
    spec = state.engine.spec

    def run(tok, per):
        if which == "tokenize":
            return tokenization.tokenize(raw, tok, served_model_name=state.model_name,
                                         max_context=spec.max_context, chars_per_token=per)
        return tokenization.detokenize(raw, tok, served_model_name=state.model_name,
                                       max_context=spec.max_context, vocab_size=spec.vocab_size)

    try:
        return web.json_response(await state.tokenize.run(len(raw), state.engine.tokenizer, run))
    except InvalidRequest as exc:
        return engine_error_response(exc)


def _require_ready(state: WorkerState) -> None:
    if not state.engine.ready:
        raise web.HTTPServiceUnavailable(reason="the model is still loading", text="the model is still loading")


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _require_ready(state)
    spec = state.engine.spec
    return web.json_response({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": state.started_at, "owned_by": "splitserve",
        "root": spec.path, "max_model_len": spec.max_context}]})


async def _metrics(request: web.Request) -> web.Response:
    text = request.app[STATE].registry.exposition()
    return web.Response(body=text.encode("utf-8"), headers={"Content-Type": CONTENT_TYPE})


async def _model_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _require_ready(state)
    spec = state.engine.spec
    return web.json_response({
        "model_path": spec.path, "tokenizer_path": spec.path, "served_model_name": state.model_name,
        "is_generation": True, "architecture": spec.architecture, "max_context": spec.max_context,
        "vocab_size": spec.vocab_size, "preferred_sampling_params": dict(spec.generation_defaults or {}),
        "has_image_understanding": False, "has_audio_understanding": False,
    })


async def _server_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _require_ready(state)
    engine, spec, cfg = state.engine, state.engine.spec, state.engine.config
    stats = engine.stats()
    placement = current_placement()
    return web.json_response({
        **state.identity(), **state.pairing(),
        "model_path": spec.path, "tokenizer_path": spec.path, "served_model_name": state.model_name,
        "host": state.config.host, "port": state.config.port, "context_length": spec.max_context,
        "dtype": str(spec.dtype).replace("torch.", ""), "device": cfg.device, "page_size": cfg.page_size,
        "kv_cache_dtype": cfg.kv_cache_dtype,
        "max_total_num_tokens": stats.pages_total * cfg.page_size,
        "max_running_requests": cfg.max_running_requests, "max_queued_requests": cfg.max_waiting_requests,
        "chunked_prefill_size": cfg.max_batch_tokens if cfg.chunked_prefill else -1,
        "max_prefill_tokens": cfg.max_batch_tokens, "random_seed": cfg.seed,
        "disaggregation_mode": "null" if state.config.role == "colocated" else state.config.role,
        "skip_tokenizer_init": False, "version": _version(),
        "cpus": format_cpu_list(placement.cpus), "threads": placement.threads,
        "internal_states": [{"pages_free": stats.pages_free, "pages_total": stats.pages_total,
                             "queues": stats.queues, "draining": state.draining}],
    })


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("splitserve")
    except Exception:
        return "0+unknown"
