"""The router's HTTP front end (aiohttp) and its process: ``splitserve router``.

Routes: the generation endpoints (``/v1/completions``, ``/v1/chat/completions``, ``/generate``, to a
prefill and a decode worker or a decode alone), ``/v1/models``, ``/health``, ``/metrics``,
``/workers`` (``membership.py``), ``/debug/requests/{rid}``, ``/flush_cache``, ``/tokenize`` and
``/detokenize`` (to the least busy healthy worker): the README's API table; keys: ``docs/security.md``.

:func:`create_app` builds the application from a :class:`~splitserve.config.RouterConfig`; all of
its state is one :class:`~splitserve.router.state.RouterState` on the app, including the one
``aiohttp.ClientSession`` every leg and health check uses (no connection limit: the workers' own
queues decide). The session and the health checker live as long as the app; startup runs one
round of health checks before the app serves. :func:`run_router` is what the CLI runs: listen,
say ready (with a curl example) once a usable pair is up, serve until SIGTERM/SIGINT, then give
requests in flight :data:`SHUTDOWN_GRACE_S` before their handlers are cancelled (which closes their
legs); a handler whose client disconnects is cancelled (``handler_cancellation=True``).

Nothing the router does waits without a bound (``docs/router.md``, *Bounds*): the request head by
``client_header_timeout_s``, every write by ``client_write_timeout_s`` (``_bounded_send``), a
request's legs, body and deadline in ``proxy.py``, health checks by their own timeouts.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Optional

import aiohttp
from aiohttp import web

from splitserve.auth import METRICS, ROUTER_ROUTES, access_middlewares, caller_may
from splitserve.client_writer import send
from splitserve.config import RouterConfig
from splitserve.discovery.record import loads_shallow
from splitserve.errors import FLUSH_WAIT_S, error_body
from splitserve.http_util import (ConnectionCap, answer_expect_in_json, bound_url, check_client_bounds, json_http_errors,
                                  read_body)
from splitserve.metrics import CONTENT_TYPE, Registry
from splitserve.router import debug, membership
from splitserve.router.answers import LARGE_ANSWER_BYTES, SMALL_ANSWER_BYTES, read_answer
from splitserve.router.legs import describe_error
from splitserve.router.outcomes import for_client
from splitserve.router.policy import make_policy
from splitserve.router.proxy import ENDPOINTS, forward
from splitserve.router.state import RouterState
from splitserve.router.worker_trust import RouterKeys, worker_key_middleware
from splitserve.router.workers import DECODE, PREFILL, HealthChecker, Worker, WorkerSet
from splitserve.tls import client_context, server_context
from splitserve.validation import REQUEST_ID

log = logging.getLogger(__name__)
WORKER_FLUSH_S = FLUSH_WAIT_S + 10.0  # a worker's /flush_cache waits up to FLUSH_WAIT_S for its engine loop

SHUTDOWN_GRACE_S = 5.0
MODELS_TIMEOUT_S = 10.0  # GET /v1/models from the decode workers, end to end
TOKENIZE_TIMEOUT_S = 30.0  # POST /tokenize or /detokenize to one worker, end to end (a long text takes seconds)
BOUNDS = ("request_timeout_s", "client_header_timeout_s", "client_body_timeout_s", "client_write_timeout_s",
          "worker_connect_timeout_s", "worker_header_timeout_s", "health_interval_s", "stream_stall_s")


ROUTER = web.AppKey("splitserve_router", RouterState)


def create_app(config: RouterConfig, registry: Optional[Registry] = None) -> web.Application:
    make_policy(config.policy)  # an unknown policy fails here, with the list of known ones
    if (not config.prefill or not config.decode) and config.discovery is None:
        raise ValueError("the router needs at least one prefill and one decode worker, or --discovery")
    keys, said = RouterKeys.of(config), []
    if config.discovery is not None:  # given empty is a mistake to name, not discovery left off
        from splitserve.discovery.backends import check

        said = check(config.discovery, config.discovery_access)  # an unknown scheme or bad URL: ValueError
    for warning in [*said, *keys.warnings(config)]:
        if warning:
            log.warning("%s", warning)
    for name in BOUNDS:
        value = getattr(config, name)
        if not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds, not {value}")
    for name in ("cache_block_chars", "cache_balance_rel", "cache_index_blocks"):
        if not getattr(config, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, not {getattr(config, name)}")
    if min(config.max_retries, config.retry_budget_ratio, config.retry_budget_min, config.max_migrations) < 0:
        raise ValueError("--max-retries, --retry-budget-ratio, --retry-budget-min and --max-migrations must be at "
                         "least 0")
    if config.pd_threshold_tokens < 0 or not config.pd_chars_per_token > 0:
        raise ValueError("--pd-threshold-tokens must be at least 0 and --pd-chars-per-token positive")
    if not config.retry_budget_window_s > 0:
        raise ValueError(f"--retry-budget-window-s must be positive, not {config.retry_budget_window_s}")
    if not 0 <= config.cache_threshold <= 1 or config.cache_balance_abs < 0:
        raise ValueError("--cache-threshold must be in [0, 1] and --cache-balance-abs at least 0")
    registry = registry or Registry()
    access = access_middlewares(config, registry, ROUTER_ROUTES, on_worker=False)
    middlewares = [_bounded_send, _error_middleware, *access]
    check_client_bounds(config)
    answer_expect_in_json()  # before its routes: an Expect header's 417 repeats nothing of it
    app = web.Application(middlewares=middlewares, client_max_size=config.max_body_bytes)
    app[ROUTER] = RouterState(config, registry, keys)
    app[ROUTER].connections = ConnectionCap(config.max_connections, registry)
    app[ROUTER].worker_ssl = client_context(config.worker_ca_certs, config.worker_ssl_certfile,
                                            config.worker_ssl_keyfile)  # for https:// workers
    app.on_response_prepare.append(_echo_request_id)
    app.cleanup_ctx.append(_session_and_health_checks)
    for path in ENDPOINTS:
        app.router.add_post(path, _generation)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/flush_cache", _flush_cache)
    app.router.add_post("/tokenize", _tokenization)
    app.router.add_post("/detokenize", _tokenization)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/workers", lambda request: debug.workers(request.app[ROUTER]))
    app.router.add_post("/workers", _add_worker)
    app.router.add_delete("/workers/{id}", _remove_worker)
    app.router.add_get("/debug/requests/{rid}",
                       lambda request: debug.request_timelines(request.app[ROUTER], request.match_info["rid"]))
    return app


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Every generation answer carries the request's one id (``X-Request-Id``), also sent to both workers."""
    rid = request.get(REQUEST_ID)
    if rid is not None:
        response.headers[REQUEST_ID] = rid


async def _session_and_health_checks(app: web.Application):
    state = app[ROUTER]
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ssl=state.worker_ssl or True)
    # the workers' key only on calls to a worker that proved itself; a client's own header is never passed on
    middleware = worker_key_middleware(state.workers, state.keys.worker_key)
    state.session = aiohttp.ClientSession(connector=connector, middlewares=(middleware,))
    checker = state.checker = HealthChecker(state.workers, state.session, state.config.health_interval_s,
                                            state.config.health_failures, state.keys.proof)
    await checker.check_all()
    checks = asyncio.ensure_future(_checks_after_first(checker))
    if state.config.discovery:
        state.discovery.start(asyncio.get_running_loop(), state.keys.seal)
    try:
        yield
    finally:
        await asyncio.get_running_loop().run_in_executor(None, state.discovery.stop)
        checks.cancel()
        for task in list(state.background):
            task.cancel()
        await asyncio.gather(checks, *state.background, return_exceptions=True)
        await state.session.close()


async def _checks_after_first(checker: HealthChecker) -> None:
    await asyncio.sleep(checker.interval_s)
    await checker.run()


@web.middleware
async def _bounded_send(request: web.Request, handler):
    """Every answer not already sent by its handler is sent here, each write bounded by
    ``client_write_timeout_s`` (aiohttp would otherwise wait for a client that does not read)."""
    response = await handler(request)
    await send(request, response, request.app[ROUTER].config.client_write_timeout_s)
    return response


@web.middleware
async def _error_middleware(request: web.Request, handler):
    """Every error the router itself answers is an OpenAI error body."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        text = exc.text or ""
        message = text if text and not text.startswith(f"{exc.status}:") else \
            f"{exc.reason}: {request.method} {request.path}"
        return web.json_response(error_body(message, exc.status), status=exc.status, headers=headers or None)
    except asyncio.CancelledError:
        raise
    except Exception:  # the exception to the log; the client reads words and its request id
        log.exception("error serving %s %s rid=%s", request.method, request.path, request.get(REQUEST_ID))
        return web.json_response(error_body(for_client("internal error in the router", request.get(REQUEST_ID)),
                                            500), status=500)


async def _generation(request: web.Request) -> web.StreamResponse:
    return await forward(request.app[ROUTER], request)


async def _add_worker(request: web.Request) -> web.Response:
    return await membership.add(request.app[ROUTER], request)


async def _remove_worker(request: web.Request) -> web.Response:
    return await membership.remove(request.app[ROUTER], request.match_info["id"])


async def _flush_cache(request: web.Request) -> web.Response:
    """Ask every worker to drop the unowned pages of its prefix cache; each one's answer."""
    state = request.app[ROUTER]

    async def flush(worker: Worker) -> dict:
        try:
            async with state.session.post(worker.url + "/flush_cache",
                                          timeout=aiohttp.ClientTimeout(total=WORKER_FLUSH_S)) as resp:
                body = loads_shallow(await read_answer(resp, SMALL_ANSWER_BYTES))
                result = {**(body if isinstance(body, dict) else {}), "url": worker.url, "status": resp.status}
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            result = {"url": worker.url, "status": 502, "error": describe_error(exc)}
        if result["status"] != 200:
            log.warning("flush_cache: %s answered %s: %s", worker.describe(), result["status"],
                        result.get("error", result))
        return result

    results = await asyncio.gather(*(flush(w) for w in state.workers.all()))
    ok = all(r["status"] == 200 for r in results)
    return web.json_response({"workers": list(results)}, status=200 if ok else 502)


async def _models(request: web.Request) -> web.Response:
    """Every healthy decode worker is asked at once; the first 2xx answer is passed on (they all
    serve the same model), so one that does not answer costs nothing while another does. Else the
    last answer or failure, within ``MODELS_TIMEOUT_S``."""
    state = request.app[ROUTER]
    healthy = state.workers.healthy(DECODE)
    missing = state.workers.missing()
    if missing is not None:  # no usable pair: a generation would be refused, so the model is not served
        return web.json_response(error_body(state.workers.missing(detail=False), 503, code="no_healthy_workers"),
                                 status=503, headers={"Retry-After": "1"})
    asks = [asyncio.ensure_future(_models_of(state.session, w)) for w in healthy]
    answer = None
    try:
        for next_answer in asyncio.as_completed(asks, timeout=MODELS_TIMEOUT_S):
            answer = await next_answer
            if 200 <= answer.status < 300:
                return answer
    except asyncio.TimeoutError:
        if answer is None:
            message = f"no decode worker answered /v1/models within {MODELS_TIMEOUT_S:g} s"
            return web.json_response(error_body(message, 504, code="worker_timeout"), status=504)
    finally:
        for ask in asks:
            ask.cancel()
    return answer


async def _tokenization(request: web.Request) -> web.Response:
    """``/tokenize`` or ``/detokenize``: the body (bounded as a generation's) to the least busy
    healthy worker of either role, which validates it; its answer, or a 502/504 naming it. Every
    worker of a router serves the one model, so any of them answers alike."""
    state = request.app[ROUTER]
    raw = await read_body(request, state.config.client_body_timeout_s, state.config.max_body_bytes)
    workers = state.workers.healthy(DECODE) + state.workers.healthy(PREFILL)
    if not workers:
        message = "no healthy worker to tokenize with"
        return web.json_response(error_body(message, 503, code="no_healthy_workers"), status=503,
                                 headers={"Retry-After": "1"})
    worker = min(workers, key=lambda w: w.in_flight)
    try:
        async with state.session.post(worker.url + request.path, data=raw,
                                      headers={"Content-Type": "application/json"},
                                      timeout=aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT_S)) as resp:
            body = await read_answer(resp, LARGE_ANSWER_BYTES)
            return web.Response(status=resp.status, body=body,
                                headers={"Content-Type": resp.headers.get("Content-Type", "application/json")})
    except asyncio.TimeoutError:
        log.warning("%s: %s: no answer within %g s", worker.describe(), request.path, TOKENIZE_TIMEOUT_S)
        message = f"the worker did not answer {request.path} within {TOKENIZE_TIMEOUT_S:g} s"
        return web.json_response(error_body(message, 504, code="worker_timeout"), status=504)
    except aiohttp.ClientError as exc:
        log.warning("%s: %s failed: %s", worker.describe(), request.path, describe_error(exc))
        return web.json_response(error_body(f"the worker failed to answer {request.path}", 502,
                                            code="worker_unreachable"), status=502)


async def _models_of(session: aiohttp.ClientSession, worker: Worker) -> web.Response:
    """One worker's ``/v1/models`` answer, or a 502 naming it (the caller bounds the time)."""
    try:
        async with session.get(worker.url + "/v1/models") as resp:
            body = await read_answer(resp, SMALL_ANSWER_BYTES)
            headers = {"Content-Type": resp.headers.get("Content-Type", "application/json")}
            return web.Response(status=resp.status, body=body, headers=headers)
    except aiohttp.ClientError as exc:
        log.warning("%s: /v1/models failed: %s", worker.describe(), describe_error(exc))
        return web.json_response(error_body("the decode worker failed to answer /v1/models", 502,
                                            code="worker_unreachable"), status=502)


async def _health(request: web.Request) -> web.Response:
    """The status (200 ok / 503 unavailable) to anyone; the model and every worker's URL, load and
    last error only to a caller who may read /metrics (anyone on a router without keys)."""
    workers = request.app[ROUTER].workers

    def view(w: Worker) -> dict:
        return {"url": w.url, "healthy": w.healthy, "in_flight": w.in_flight,
                **({"error": w.last_error} if not w.healthy else {})}

    body = {"status": "ok" if workers.ready() else "unavailable"}
    if caller_may(request, METRICS):
        body.update(model=workers.model_name(), prefill=[view(w) for w in workers.prefill],
                    decode=[view(w) for w in workers.decode])
    return web.json_response(body, status=200 if workers.ready() else 503)


async def _metrics(request: web.Request) -> web.Response:
    text = request.app[ROUTER].registry.exposition()
    return web.Response(body=text.encode("utf-8"), headers={"Content-Type": CONTENT_TYPE})


# -- the process -----------------------------------------------------------------------------------


def run_router(config: RouterConfig) -> int:
    """Serve until SIGTERM/SIGINT; the exit code (0 after a clean stop, 1 if it cannot listen,
    2 for a bad configuration)."""
    try:
        app = create_app(config)
        ssl_context = server_context(config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs)
    except ValueError as exc:
        print(f"splitserve router: {exc}", file=sys.stderr, flush=True)
        return 2
    return asyncio.run(_serve(app, config, ssl_context))


async def _serve(app: web.Application, config: RouterConfig, ssl_context=None) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # keepalive_timeout also closes a connection whose request head has not all come by then
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S,
                           keepalive_timeout=config.client_header_timeout_s)
    await runner.setup()
    json_http_errors(runner)  # a request aiohttp refuses before the app sees it: an OpenAI error body too
    app[ROUTER].connections.install(runner)
    try:
        await web.TCPSite(runner, config.host, config.port, ssl_context=ssl_context).start()
    except OSError as exc:
        print(f"splitserve router: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr, flush=True)
        await runner.cleanup()
        return 1
    announce = asyncio.ensure_future(_announce_readiness(runner, config, app[ROUTER].workers))
    await stop.wait()
    announce.cancel()
    in_flight = sum(w.in_flight for w in app[ROUTER].workers.decode)
    log.info("stopping: %d requests in flight get up to %.0f s to finish", in_flight, SHUTDOWN_GRACE_S)
    await runner.cleanup()
    log.info("stopped")
    return 0


READY_POLL_S = 0.2  # how often the router looks whether a usable pair came (or went)


async def _announce_readiness(runner: web.AppRunner, config: RouterConfig, workers: WorkerSet) -> None:
    """Say that the router is ready (with a curl to try) when a usable pair is up, and only then:
    at start, else as soon as one comes; and again after a spell without one (logged)."""
    ready = workers.ready()
    print(ready_line(runner, config, workers) if ready else waiting_line(runner, config, workers), flush=True)
    while True:
        await asyncio.sleep(READY_POLL_S)
        now = workers.ready()
        if now and not ready:
            print(ready_line(runner, config, workers), flush=True)
        elif ready and not now:
            log.warning("not ready: %s", workers.missing())
        ready = now


def _up(workers: WorkerSet) -> dict[str, str]:
    return {role: f"{len(workers.healthy(role))}/{len(ws)}" for role, ws in
            ((PREFILL, workers.prefill), (DECODE, workers.decode))}


def waiting_line(runner: web.AppRunner, config: RouterConfig, workers: WorkerSet) -> str:
    url = bound_url(runner, config.host, config.port, tls=config.ssl_certfile is not None)
    up = _up(workers)
    return (f"splitserve router listening: {url} (policy {config.policy}; prefill {up[PREFILL]} up, decode "
            f"{up[DECODE]} up); not ready until a prefill and a decode worker are up")


def ready_line(runner: web.AppRunner, config: RouterConfig, workers: WorkerSet) -> str:
    url = bound_url(runner, config.host, config.port, tls=config.ssl_certfile is not None)
    up = _up(workers)
    model = workers.model_name()
    example = ('{"model": "%s", "prompt": "Hello, my name is", "max_tokens": 16}' % model if model else
               '{"prompt": "Hello, my name is", "max_tokens": 16}')
    key = " -H 'Authorization: Bearer <your API key>'" if config.api_key else ""
    return (f"splitserve router ready: {url} (policy {config.policy}; prefill {up[PREFILL]} up, "
            f"decode {up[DECODE]} up)  try: curl {url}/v1/completions{key} -H 'Content-Type: application/json' "
            f"-d '{example}'")
