"""Single-valued request headers sent more than once: ``X-Request-Id`` and
``X-Splitserve-Deadline-S`` are a 400 naming the header (``validation/headers.py``), two
``Authorization`` headers open nothing a key is needed for (401), and the router passes no
client's deadline on: each leg carries the one it builds itself.
"""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import ClientSession, web
from multidict import CIMultiDict, CIMultiDictProxy

from cluster import RouterProcess
from helpers.fake_workers import COMPLETION, MODEL, fake_loop, fakes  # noqa: F401 (fixtures)
from helpers.raw_headers import post_json
from splitserve.auth import CLIENT, OPEN, Access, access_middleware, bearer
from splitserve.engine.io import InvalidRequest
from splitserve.validation import DEADLINE, REQUEST_ID, one_header

KEY = "client-key-0123456789"


def headers(*pairs: tuple[str, str]) -> CIMultiDictProxy:
    return CIMultiDictProxy(CIMultiDict(pairs))


def test_a_header_is_read_once_and_refused_twice_naming_it():
    assert one_header(headers(), DEADLINE) is None
    assert one_header(headers((DEADLINE.lower(), "5")), DEADLINE) == "5"  # names are case-insensitive
    for pair in (("5", "5"), ("5", "0.001")):
        with pytest.raises(InvalidRequest) as caught:
            one_header(headers(*((DEADLINE, v) for v in pair)), DEADLINE)
        assert caught.value.status == 400 and caught.value.param == DEADLINE


async def _statuses(cases: list[list[tuple[str, str]]]) -> list[int]:
    """The status of ``GET /client`` on a keyed app for each list of headers."""
    app = web.Application(middlewares=[access_middleware(Access({CLIENT: KEY.encode()}, on_worker=False),
                                                         {"/client": CLIENT, "/open": OPEN}, lambda why: None)])
    async def ok(request):
        return web.json_response({"ok": True})

    app.router.add_get("/client", ok)
    app.router.add_get("/open", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with ClientSession() as session:
            out = []
            for path, sent in cases:
                async with session.get(f"http://127.0.0.1:{port}{path}", headers=CIMultiDict(sent)) as resp:
                    out.append((resp.status, (await resp.json()).get("error", {}).get("message")))
            return out
    finally:
        await runner.cleanup()


def test_two_authorization_headers_open_nothing_that_needs_a_key():
    right, wrong = bearer(KEY)["Authorization"], "Bearer not-the-key"
    twice = [("Authorization", right), ("Authorization", wrong)]
    got = asyncio.run(_statuses([("/client", [("Authorization", right)]),
                                 ("/client", twice), ("/client", twice[::-1]),
                                 ("/client", [("Authorization", right)] * 2),
                                 ("/open", twice)]))
    assert got[0] == (200, None)
    for status, message in got[1:4]:
        assert status == 401 and "one Authorization header" in message
    assert got[4] == (200, None)  # a route that needs no key does not care


def test_the_router_refuses_a_doubled_request_id_and_passes_no_client_deadline_on(fakes):  # noqa: F811
    seen: list[list[str]] = []

    async def record(fake, request, body):
        seen.append(request.headers.getall(DEADLINE, []))
        return web.json_response({"who": "decode"})

    prefill, decode = fakes(record), fakes(record)
    router = RouterProcess([(prefill.url, 1)], [decode.url], wait_healthy=False).start()
    try:
        body = {**COMPLETION, "model": MODEL}
        status, refused = post_json(router.url, "/v1/completions", body, [(REQUEST_ID, "a"), (REQUEST_ID, "b")])
        assert status == 400 and refused["error"]["param"] == REQUEST_ID, refused
        assert not seen, "refused before any worker was asked"
        status, answer = post_json(router.url, "/v1/completions", body, [(DEADLINE, "0.001"), (DEADLINE, "0.002")])
        assert status == 200 and answer == {"who": "decode"}, answer
        assert len(seen) == 2  # both legs: one deadline each, the router's own (600 s by default)
        for values in seen:
            assert len(values) == 1 and float(values[0]) > 1, seen
    finally:
        router.stop()
