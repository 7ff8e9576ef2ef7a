"""A request body that aiohttp cannot decode once its headers were taken (``Content-Encoding: gzip``
or ``deflate`` over bytes that are neither) is the client's fault: a 400 with an OpenAI error body,
the connection closed after it, nothing logged at ERROR, and the server serving the next request.
The worker is checked end to end (the session's tiny server); the router's body reader
(``router/client.read_body``) on an in-process aiohttp server."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import pytest
from aiohttp import web

from splitserve.router import client as router_client

BODY = b'{"model": "tiny", "prompt": "hi", "max_tokens": 1}'


def _post(encoding: str, body: bytes = b"not-compressed-at-all") -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Encoding: " + encoding.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)


def _exchange(host: str, port: int, data: bytes) -> bytes:
    """All the server sends on one connection for ``data``, to the connection's end."""
    with socket.create_connection((host, port), timeout=20) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def _error_of(received: bytes) -> dict:
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), received[:300]
    return json.loads(body)["error"]


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_worker_refuses_a_body_it_cannot_decode_with_400(server, encoding):
    """400 (not 500 'internal error'), the connection ends after it, the worker serves on."""
    host, port = server.url.rsplit("/", 1)[-1].split(":")
    error = _error_of(_exchange(host, int(port), _post(encoding)))
    assert error["type"] == "invalid_request_error" and "Content-Encoding" in error["message"], error
    answer = _exchange(host, int(port), b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                       b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]


async def _router_reader_answers(data: bytes) -> bytes:
    async def handler(request: web.Request) -> web.Response:
        try:
            body = await router_client.read_body(request, 10, 1 << 20)
        except web.HTTPException as exc:
            return web.json_response({"error": {"message": exc.text}}, status=exc.status)
        return web.Response(text=str(len(body)))

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        return await asyncio.to_thread(_exchange, "127.0.0.1", port, data)
    finally:
        await runner.cleanup()


def test_the_routers_body_reader_refuses_an_undecodable_body_with_400(caplog):
    """The router's read_body turns aiohttp's payload error into a 400, and aiohttp logs no ERROR
    after the answer (it would, reading the rest of the broken body)."""
    with caplog.at_level(logging.DEBUG):
        received = asyncio.run(_router_reader_answers(_post("gzip")))
    assert "Content-Encoding" in _error_of(received)["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
