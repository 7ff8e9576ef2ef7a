"""``POST /abort_request``: end one request on this worker for a stated cause (SGLang has the
route; the cause is ours).

The router calls it to end a leg with an explicit cause instead of only closing it, since a closed
leg reads as the client gone (``docs/router.md`` has the fields and what each cause does)::

    {"rid": "...", "reason": "client_abort"}            the client left (as closing the leg says)
    {"bootstrap_room": 42, "reason": "prefill_failed",  decode: its KV will not come
     "detail": "prefill answered 503"}

The answer is ``{"found": true|false}`` (200): a request that is not here (not yet, or already
ended) is not an error, as in SGLang; a ``prefill_failed`` for one not here yet is kept for it (the
router's two legs race), so it computes its prompt as soon as it comes. Bad input is a 400 naming
the field.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from aiohttp import web

from splitserve.engine.io import FLUSH_WAIT_S, InvalidRequest
from splitserve.http_util import read_body
from splitserve.validation import MAX_ROOM, parse_json_body

REASONS = ("client_abort", "prefill_failed")
FIELDS = {"rid", "bootstrap_room", "reason", "detail"}
MAX_DETAIL_CHARS = 256
MAX_RID_CHARS = 256


def parse(body: dict, role: str) -> tuple[Optional[str], Optional[int], str, str]:
    """(rid, room, reason, detail) of a valid body; InvalidRequest (a 400) naming the field else."""
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise InvalidRequest(f"/abort_request does not take {unknown[0]!r} (it takes {', '.join(sorted(FIELDS))})",
                             unknown[0])
    rid, room = body.get("rid"), body.get("bootstrap_room")
    if (rid is None) == (room is None):
        raise InvalidRequest("name the request by rid or by bootstrap_room (one of them)", "rid")
    if rid is not None and not (isinstance(rid, str) and 0 < len(rid) <= MAX_RID_CHARS):
        raise InvalidRequest(f"rid must be a string of 1 to {MAX_RID_CHARS} characters", "rid")
    if room is not None and (isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < MAX_ROOM):
        raise InvalidRequest("bootstrap_room must be an integer in [0, 2**63)", "bootstrap_room")
    reason = body.get("reason", "client_abort")
    if reason not in REASONS:
        raise InvalidRequest(f"reason must be one of {', '.join(REASONS)}", "reason")
    if reason == "prefill_failed" and role != "decode":
        raise InvalidRequest(f"reason prefill_failed is for a decode worker; this is a {role} worker", "reason")
    detail = body.get("detail", "")
    if not isinstance(detail, str) or len(detail) > MAX_DETAIL_CHARS:
        raise InvalidRequest(f"detail must be a string of at most {MAX_DETAIL_CHARS} characters", "detail")
    for text in (rid or "", detail):
        text.encode("utf-8")  # a lone surrogate raises UnicodeEncodeError: a 400
    return rid, room, reason, detail


async def handle(request: web.Request, state, json_error) -> web.Response:
    """The route's body; ``state`` is the app's WorkerState."""
    try:
        raw = await read_body(request, state.config.client_body_timeout_s, state.config.max_body_bytes)
        rid, room, reason, detail = parse(parse_json_body(raw), state.config.role)
    except InvalidRequest as exc:
        return json_error(str(exc), 400, param=exc.param, code="bad_request")
    except UnicodeError:
        return json_error("rid and detail must be valid Unicode (no lone surrogates)", 400, param="detail",
                          code="bad_request")
    try:  # awaited, not waited for in a thread: the simulator (one thread) replays it exactly
        async with asyncio.timeout(FLUSH_WAIT_S):
            found = await asyncio.wrap_future(
                state.engine.abort_request_later(rid, room, reason == "prefill_failed", detail or reason))
    except TimeoutError:
        return json_error(f"the engine loop did not get to the abort within {FLUSH_WAIT_S:g} s (a long step?); "
                          "try again", 503, code="loop_busy", headers={"Retry-After": "1"})
    return web.json_response({"found": bool(found)})
