"""The worker's HTTP front end (aiohttp) and its process lifecycle.

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
interface, so tests can hand in a fake); :func:`run_server` is what ``splitserve serve`` runs:

1. listen first (``/health`` answers 503 while the model loads; a busy port fails at once),
2. load the model in a thread, print the ready line,
3. on SIGTERM or SIGINT drain: refuse new requests with 503, let those in flight finish for up to
   ``drain_timeout_s``, then end the rest with an error (a second signal cuts the wait short),
4. close the listener and return 0.

All state lives in one :class:`WorkerState` stored on the app (no module-level globals). The
runner cancels a handler whose client disconnects (``handler_cancellation=True``), which is how a
non-streaming request waiting for its answer learns that nobody is listening any more.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import re
import signal
import sys
import threading
import time
from typing import Optional

from aiohttp import web

from splitserve.auth import (METRICS, WORKER_ROUTES, access_middlewares, caller_may, check_bootstrap_trust,
                             check_control_plane, parse_allowed_prefill)
from splitserve.client_writer import send
from splitserve.config import EngineConfig, ServerConfig
from splitserve.cpus import current_placement, format_cpu_list, place_process
from splitserve.engine.grammar import GrammarCompiler
from splitserve.engine.io import FLUSH_WAIT_S, InvalidRequest
from splitserve.http_util import ConnectionCap, bound_url, check_client_bounds, read_body
from splitserve.metrics import CONTENT_TYPE, Registry
from splitserve.outcomes import Ending, Reason
from splitserve.server import abort_request, role_switch, tokenization
from splitserve.server.generation import RID, engine_error_response, json_error, serve_generation
from splitserve.server.tokenize_lanes import TokenizeLanes
from splitserve.validation import MAX_ROOM, REQUEST_ID
from splitserve.server.worker_metrics import WorkerMetrics
from splitserve.tls import server_context

log = logging.getLogger(__name__)

END_GRACE_S = 5.0  # after the engine ended the live requests, time for their handlers to answer


class WorkerState:
    """Everything the handlers share: the engine, config, metrics and requests in flight."""

    def __init__(self, engine, config: ServerConfig, registry: Registry, incarnation: Optional[str] = None):
        from splitserve.disagg.bootstrap import new_incarnation
        from splitserve.discovery.record import check_id, default_worker_id

        self.engine = engine
        self.worker_id = check_id(config.worker_id or default_worker_id(
            config.role, config.advertise_host or config.host, config.port), "--worker-id")
        self.incarnation = incarnation or new_incarnation()
        """This process start's id: the one its control plane uses (``make_engine`` is given it)."""
        self.config = config
        self.registry = registry
        self.metrics = WorkerMetrics(registry, engine, config.role)
        self.draining = False
        self.started_at = int(time.time())
        self.inflight: set[asyncio.Task] = set()  # generation handlers now running
        self.tokenize = TokenizeLanes()  # validation and tokenization, off the event loop
        self.grammars = GrammarCompiler()  # response_format, compiled in the lanes
        self.allowed_prefill = parse_allowed_prefill(config.allowed_prefill)  # whose bootstrap fields decode takes
        self.epoch = 0
        """One more at every role switch begun (``POST /role``: a request names the epoch it expects)."""
        self.switch: Optional[asyncio.Future] = None  # the role switch under way
        self.switch_to: Optional[str] = None
        self.register = None
        """``--discovery``: puts this worker's record as it is now in etcd (a started ``Registration``)."""
        self.registration = None  # the record in etcd now, if any
        self.stopping = False  # SIGTERM: draining for good (a role switch under way does not undo it)

    def identity(self) -> dict:
        """Who this worker is (on ``/health`` and ``/get_server_info``): id, incarnation, role, and
        the epoch of its role (``POST /role``)."""
        return {"id": self.worker_id, "incarnation": self.incarnation, "role": self.config.role, "epoch": self.epoch}

    def pairing(self) -> dict:
        """What a router pairs workers by (``/get_server_info``): the model fingerprint, the control
        protocol version, the transfer backend and, for a prefill, its bootstrap port. Empty until
        the role started (a colocated worker has none)."""
        info = getattr(getattr(self.engine, "role", None), "info", None)
        if info is None:
            return {}
        return {"model_fingerprint": info.model, "protocol_version": info.protocol_version,
                "transfer_backend": info.backend,
                "bootstrap_port": self.config.bootstrap_port if self.config.role == "prefill" else None}

    def accepting(self) -> bool:
        return bool(self.engine.ready) and not self.draining and not self.engine.draining

    @property
    def model_name(self) -> str:
        """``--served-model-name``, else the built-in model's name (``tiny``, ``smollm2``), else the
        checkpoint folder's basename (a GGUF file's stem)."""
        from splitserve.models.resolve import BUILTIN_MODELS

        if self.config.served_model_name:
            return self.config.served_model_name
        if getattr(self.engine.config, "model", None) in BUILTIN_MODELS:
            return self.engine.config.model
        return self.engine.spec.name


STATE = web.AppKey("splitserve_worker", WorkerState)


def create_app(engine, config: ServerConfig, registry: Optional[Registry] = None,
               incarnation: Optional[str] = None) -> web.Application:
    """``incarnation``: this process start's id (drawn when None)."""
    registry = registry or Registry()
    access = access_middlewares(config, registry, WORKER_ROUTES, on_worker=True)
    middlewares = [_bounded_send, _http_middleware, *access]
    check_client_bounds(config)
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


WATCHDOG_S = 0.5  # how often the HTTP side looks at the engine loop's age


async def loop_watchdog(app: web.Application):
    """While the engine loop is wedged (``--loop-stall-s``), answer every request it holds from
    here (503, ``loop_stalled``): a client is never left waiting on a loop that does not move. Its
    pages stay where they are; /health fails meanwhile, so the router sends no more.

    A ``cleanup_ctx`` of :func:`create_app`'s app; a host that serves the app without
    ``web.AppRunner`` (the simulator) drives it itself: the first ``__anext__`` starts the watch."""
    state = app[STATE]

    async def watch() -> None:
        stalled = False
        while True:
            await asyncio.sleep(WATCHDOG_S)
            engine = state.engine
            now_stalled = bool(getattr(engine, "loop_stalled", lambda: False)())
            if now_stalled:
                ending = Ending(Reason.LOOP_STALLED, f"the engine loop has made no progress for "
                                                     f"{engine.loop_age():.1f}s (--loop-stall-s {engine.loop_stall_s:g})")
                answered = engine.fail_streams(ending)
                if not stalled or answered:
                    log.error("%s; %d requests answered 503", ending.message, answered)
            elif stalled:
                log.warning("the engine loop moves again")
            stalled = now_stalled

    task = asyncio.ensure_future(watch())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


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
    except Exception as exc:  # one request's bug is that request's 500, never the worker's end
        log.exception("error serving %s %s", request.method, request.path)
        return json_error(f"internal error: {type(exc).__name__}: {exc}", 500)
    finally:
        state.metrics.http_requests.labels(path=path, status=str(status)).inc()


# -- small endpoints -------------------------------------------------------------------------------


async def _health(request: web.Request) -> web.Response:
    """200 when ready; 503 while loading or draining, and while the engine loop or one of the
    role's threads is wedged (``--loop-stall-s``: what is wedged only to a caller who may read
    /metrics)."""
    state = request.app[STATE]
    engine = state.engine
    who = state.identity()
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
        "max_total_num_tokens": stats["pages_total"] * cfg.page_size,
        "max_running_requests": cfg.max_running_requests, "max_queued_requests": cfg.max_waiting_requests,
        "chunked_prefill_size": cfg.max_batch_tokens if cfg.chunked_prefill else -1,
        "max_prefill_tokens": cfg.max_batch_tokens, "random_seed": cfg.seed,
        "disaggregation_mode": "null" if state.config.role == "colocated" else state.config.role,
        "skip_tokenizer_init": False, "version": _version(),
        "cpus": format_cpu_list(placement.cpus), "threads": placement.threads,
        "internal_states": [{"pages_free": stats["pages_free"], "pages_total": stats["pages_total"],
                             "queues": stats["queues"], "draining": state.draining}],
    })


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("splitserve")
    except Exception:
        return "0+unknown"


# -- the process -----------------------------------------------------------------------------------


def run_server(engine_config: EngineConfig, server_config: ServerConfig, deadlines=None) -> int:
    """Serve until SIGTERM/SIGINT, then drain; the exit code (0 after a clean drain, 1 if the
    port cannot be bound or the model fails to load). ``deadlines``: the lifecycle limits of a
    prefill or decode worker (``disagg.lifecycle.Deadlines``; defaults when None). The CPU
    placement (``--cpus``, ``--threads``) is applied first, before any thread of ours starts; a bad
    one exits 2. A SIGTERM/SIGINT before the worker is ready exits 0 at once (``_exit_now``)."""
    for sig in (signal.SIGTERM, signal.SIGINT):  # until the event loop takes them over
        signal.signal(sig, lambda signum, _frame: _exit_now(f"received {signal.Signals(signum).name} while starting"))
    try:
        check_client_bounds(server_config)
        check_bootstrap_trust(server_config)
        check_control_plane(server_config)
        ssl_context = server_context(server_config.ssl_certfile, server_config.ssl_keyfile, server_config.ssl_ca_certs)
        if server_config.discovery:  # likewise a bad --discovery
            _check_discovery(server_config)
        if server_config.cluster_secret_file:  # read now: a bad file stops the worker at once
            from splitserve.disagg.control.curve import ClusterSecret

            ClusterSecret.load(server_config.cluster_secret_file, warn=False)
    except ValueError as exc:
        print(f"splitserve serve: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        placement = place_process(server_config.cpus, server_config.threads)
    except ValueError as exc:
        print(f"splitserve serve: {exc}", file=sys.stderr, flush=True)
        return 2
    log.info("CPU placement: %s", placement.describe())
    from splitserve.disagg.bootstrap import new_incarnation

    incarnation = new_incarnation()
    engine = make_engine(engine_config, server_config, deadlines, incarnation)
    return asyncio.run(_serve(engine, server_config, ssl_context, incarnation))


def make_engine(engine_config: EngineConfig, server_config: ServerConfig, deadlines=None,
                incarnation: Optional[str] = None):
    """The engine for the worker's role: colocated, or a prefill / decode worker of a split pair
    (whose control plane then uses ``incarnation``, the one ``/health`` reports)."""
    if server_config.role == "colocated":
        from splitserve.engine.async_engine import AsyncEngine

        return AsyncEngine(engine_config, loop_stall_s=server_config.loop_stall_s)
    from splitserve.disagg.lifecycle import Deadlines
    from splitserve.disagg.worker import engine_for_role

    return engine_for_role(engine_config, server_config, deadlines or Deadlines(), incarnation)


async def _serve(engine, server_config: ServerConfig, ssl_context=None, incarnation: Optional[str] = None) -> int:
    loop = asyncio.get_running_loop()
    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal(signum: int) -> None:
        log.info("received %s", signal.Signals(signum).name)
        (force if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    app = create_app(engine, server_config, incarnation=incarnation)
    state = app[STATE]
    # keepalive_timeout also closes a connection whose request head has not all come by then
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=END_GRACE_S,
                           keepalive_timeout=server_config.client_header_timeout_s)
    await runner.setup()
    state.connections.install(runner)
    try:
        await web.TCPSite(runner, server_config.host, server_config.port, ssl_context=ssl_context).start()
    except OSError as exc:
        print(f"splitserve: cannot listen on {server_config.host}:{server_config.port}: {exc}", file=sys.stderr,
              flush=True)
        await runner.cleanup()
        return 1

    started = _start_in_thread(engine, loop)
    stop_wait = asyncio.ensure_future(stop.wait())
    await asyncio.wait({started, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    if not started.done():  # a signal while loading: nothing is in flight, just leave
        await runner.cleanup()
        _exit_now("stopping before the model finished loading")
    if started.exception() is not None:
        exc = started.exception()
        log.error("the engine failed to start", exc_info=exc)
        print(f"splitserve: the engine failed to start: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        stop_wait.cancel()
        await runner.cleanup()
        return 1

    print(_ready_line(runner, server_config, state.model_name), flush=True)
    if server_config.discovery:
        state.register = lambda: _register(state, runner, ssl_context is not None)
        state.registration = state.register()
    await stop_wait
    state.stopping = True
    registration, state.registration = state.registration, None  # the current one: a role switch renews it
    if registration is not None:  # routers stop sending first; what they already sent is still served
        await loop.run_in_executor(None, registration.revoke)
        log.info("discovery: serving %.1f s more before draining", server_config.discovery_grace_s)
        try:
            async with asyncio.timeout(server_config.discovery_grace_s):  # not wait_for (see router/legs.py)
                await force.wait()
        except asyncio.TimeoutError:
            pass
    await _drain(state, server_config.drain_timeout_s, force)
    await runner.cleanup()
    log.info("stopped")
    return 0


def _check_discovery(config: ServerConfig) -> None:
    """ValueError for a ``--discovery`` this worker cannot register with."""
    from splitserve.discovery.etcd import Credentials, parse_target

    parse_target(config.discovery)
    Credentials.of(config)
    if config.role not in ("prefill", "decode"):
        raise ValueError("--discovery registers prefill and decode workers (--role prefill|decode)")
    if not config.discovery_ttl_s >= 2 or not config.discovery_grace_s >= 0:
        raise ValueError("--discovery-ttl-s must be at least 2 and --discovery-grace-s at least 0")
    if (config.advertise_host or config.host) in ("0.0.0.0", "::", ""):
        raise ValueError(f"--discovery: routers cannot reach {config.host}; give --advertise-host (on "
                         "Kubernetes the pod's IP, status.podIP)")


def _register(state: WorkerState, runner: web.AppRunner, tls: bool):
    """Put this worker's record in etcd under a lease kept alive by a thread (``discovery/etcd.py``)."""
    from splitserve.discovery.etcd import Credentials, Registration, parse_target
    from splitserve.discovery.record import WorkerRecord

    config, pairing = state.config, state.pairing()
    port = runner.addresses[0][1] if runner.addresses else config.port
    host = config.advertise_host or config.host
    url = f"{'https' if tls else 'http'}://{'[%s]' % host if ':' in host else host}:{port}"
    record = WorkerRecord(state.worker_id, state.incarnation, config.role, url, pairing["bootstrap_port"],
                          pairing["model_fingerprint"], pairing["protocol_version"], pairing["transfer_backend"])
    return Registration(parse_target(config.discovery), record, config.discovery_ttl_s,
                        Credentials.of(config)).start()


def _exit_now(why: str) -> None:
    """Exit 0 without the interpreter's finalization: nothing is in flight yet, and the thread that
    loads the model may be inside native code (torch's thread pool, NIXL's threads), whose static
    destructors, run under it at a normal exit, end the process in ``std::terminate`` (``terminate
    called without an active exception``, SIGABRT)."""
    log.info("%s: exiting", why)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(0)


def _start_in_thread(engine, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
    """Run the blocking ``engine.start`` in a daemon thread (a signal during a long load can then
    end the process without waiting for it)."""
    future = loop.create_future()

    def settle(exc: Optional[BaseException]) -> None:
        if not future.done():
            future.set_result(None) if exc is None else future.set_exception(exc)

    def target() -> None:
        try:
            takes_loop = "loop" in inspect.signature(engine.start).parameters
            engine.start(loop) if takes_loop else engine.start()
        except BaseException as exc:  # reported to the main loop, which exits 1
            loop.call_soon_threadsafe(settle, exc)
        else:
            loop.call_soon_threadsafe(settle, None)

    threading.Thread(target=target, name="engine-start", daemon=True).start()
    return future


async def _drain(state: WorkerState, timeout_s: float, force: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    state.draining = state.stopping = True
    state.engine.begin_drain()
    log.info("draining: %d requests in flight, waiting up to %.1fs", len(state.inflight), timeout_s)
    deadline = time.monotonic() + timeout_s
    while state.inflight and time.monotonic() < deadline and not force.is_set():
        await asyncio.sleep(0.05)
    if state.inflight:
        log.warning("drain: ending %d requests still in flight", len(state.inflight))
    await loop.run_in_executor(None, state.engine.shutdown)  # ends every live request with an error
    deadline = time.monotonic() + END_GRACE_S
    while state.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for task in list(state.inflight):  # last resort: a handler that did not end with its request
        task.cancel()


def _ready_line(runner: web.AppRunner, config: ServerConfig, model: str) -> str:
    url = bound_url(runner, config.host, config.port, tls=config.ssl_certfile is not None)
    example = ('{"model": "%s", "prompt": "Hello, my name is", "max_tokens": 16}' % model)
    key = " -H 'Authorization: Bearer <your API key>'" if config.api_key else ""
    return (f"splitserve ready: {url} (model {model})  try: curl {url}/v1/completions{key} "
            f"-H 'Content-Type: application/json' -d '{example}'")
