"""A worker process's life, what ``splitserve serve`` runs (:func:`run_server`):

1. check the configuration and place the process on its CPUs; a bad one exits 2;
2. build the engine for the worker's role (:func:`make_engine`: colocated, or a prefill or decode
   worker of a split pair);
3. listen first (``/health`` answers 503 while the model loads; a busy port fails at once), load
   the model in a thread, print the ready line, register in discovery (``--discovery``);
4. on SIGTERM or SIGINT leave discovery, serve for the grace period, then drain: refuse new
   requests with 503, let those in flight finish for up to ``drain_timeout_s``, then end the rest
   with an error (a second signal cuts the wait short);
5. close the listener and return 0.

The runner cancels a handler whose client disconnects (``handler_cancellation=True``), which is how a
non-streaming request waiting for its answer learns that nobody is listening any more.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
import sys
import threading
import time
from typing import Optional

from aiohttp import web

from splitserve.auth import check_bootstrap_trust, check_control_plane
from splitserve.config import EngineConfig, ServerConfig
from splitserve.cpus import place_process
from splitserve.discovery.record import KV_CACHE_DTYPES
from splitserve.engine.step_pace import StepPace
from splitserve.http_util import bound_url, check_client_bounds, json_http_errors
from splitserve.server.app import create_app
from splitserve.hosts import check_bind_host
from splitserve.server.registration import check_discovery, register
from splitserve.server.state import STATE, WorkerState, check_identity
from splitserve.tls import server_context

log = logging.getLogger(__name__)

END_GRACE_S = 5.0  # after the engine ended the live requests, time for their handlers to answer


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
        if engine_config.kv_cache_dtype not in KV_CACHE_DTYPES:  # here, not after the model loaded
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"not {engine_config.kv_cache_dtype!r}")
        StepPace(engine_config.prompt_chunk_cost)  # a ratio it refuses: exit 2 naming it, before the model loads
        check_bind_host(server_config.host, "--host")  # [::1] or a zone id: exit 2 saying which form
        check_bootstrap_trust(server_config)
        check_control_plane(server_config)
        ssl_context = server_context(server_config.ssl_certfile, server_config.ssl_keyfile, server_config.ssl_ca_certs)
        if server_config.discovery is not None:  # likewise a bad (or empty) --discovery
            check_discovery(server_config)
        check_identity(server_config)
        if server_config.cluster_secret_file:  # read now: a bad file stops the worker at once
            from splitserve.disagg.control.curve import ClusterSecret

            ClusterSecret.load(server_config.cluster_secret_file, warn=False)
        if server_config.role_file:
            from splitserve.server.role_file import keep_role

            keep_role(server_config.role_file, server_config.role, "start")
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
    json_http_errors(runner)  # a request aiohttp refuses before the app sees it: an OpenAI error body too
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
    if server_config.discovery is not None:
        state.register = lambda: register(state, runner, ssl_context is not None)
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
