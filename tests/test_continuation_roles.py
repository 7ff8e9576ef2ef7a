"""Where a continuation is served: by a decode worker alone (or a colocated one), never by a
prefill (a 503 a router retries elsewhere: it has not seen the worker switch) and never beside
bootstrap fields (a 400 naming the field), refused before the engine sees it."""

from __future__ import annotations

import asyncio
import json

import pytest

CONT = {"id": "cmpl-q", "created": 1, "choices": [{"index": 0, "ids": [5]}]}


def answers(app, bodies: list) -> list:
    from aiohttp.test_utils import TestClient, TestServer

    async def main():
        got = []
        async with TestClient(TestServer(app)) as client:
            for body in bodies:
                r = await client.post("/v1/completions", json=body)
                got.append((r.status, json.loads(await r.text()) if r.status != 200 else None))
        return got
    return asyncio.run(main())


@pytest.mark.parametrize("role, fields, status, code", [
    ("prefill", {}, 503, "not_ready"),
    ("decode", {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 7}, 400, None),
    ("decode", {}, 200, None),
])
def test_a_continuation_is_served_by_decode_alone(byte_tokenizer, role, fields, status, code):
    from helpers.fake_engine import FullFakeEngine

    from splitserve.config import ServerConfig
    from splitserve.server.app import create_app

    engine = FullFakeEngine(byte_tokenizer)
    app = create_app(engine, ServerConfig(role=role, allowed_prefill="127.0.0.1:1", bootstrap_port=9))
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "stream": True, "continuation": CONT, **fields}
    [(got, error)] = answers(app, [body])
    assert got == status, error
    if status == 400:
        assert error["error"]["param"] == "continuation" and "bootstrap" in error["error"]["message"]
    if code:
        assert error["error"]["code"] == code
