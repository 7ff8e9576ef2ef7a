"""The loop watchdog: while the engine loop is wedged, the HTTP side answers what it holds."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from splitserve.outcomes import Ending, Reason
from splitserve.server.state import STATE

log = logging.getLogger(__name__)

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
