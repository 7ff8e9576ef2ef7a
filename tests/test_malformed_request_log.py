"""A request aiohttp's parser refuses (a NUL in a header, too many headers, a malformed request
line) on a server whose connections are ``http_util.JsonErrors``: answered 400 with an OpenAI
error body, and logged as one line at debug, never aiohttp's traceback at ERROR (a client could
write one per connection, with its own bytes in it). In-process aiohttp server, raw socket."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import pytest
from aiohttp import web

from splitserve.http_util import json_http_errors

BAD = {
    "a NUL in a header": b"GET / HTTP/1.1\r\nHost: x\r\nX-Q: a\x00qqq\r\n\r\n",
    "too many headers": b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-Q%d: q\r\n" % i for i in range(200)) + b"\r\n",
    "a line of binary junk": b"\x16\x03\x01qqq\x00\xff\r\n\r\n",
}


def _exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def _answers(data: bytes) -> list[bytes]:
    """The answers to ``data``, then to a good request on a new connection."""
    app = web.Application()
    app.router.add_get("/", _ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    json_http_errors(runner)
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        port = runner.addresses[0][1]
        bad = await asyncio.to_thread(_exchange, port, data)
        good = await asyncio.to_thread(_exchange, port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return [bad, good]
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("case", BAD)
def test_a_malformed_request_is_answered_and_logged_without_a_traceback(case, caplog):
    """400 with a JSON body that echoes none of the client's bytes, the server answering the next
    connection, and no record at WARNING or above nor any traceback."""
    with caplog.at_level(logging.DEBUG):
        bad, good = asyncio.run(_answers(BAD[case]))
    head, _, body = bad.partition(b"\r\n\r\n")
    assert b" 400 " in head.split(b"\r\n")[0], bad[:300]
    assert json.loads(body)["error"]["type"] == "invalid_request_error" and b"qqq" not in body
    assert good.startswith(b"HTTP/1.1 200 "), good[:300]
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not loud, [r.getMessage() for r in loud]
    assert any("refused a malformed request" in r.getMessage() for r in caplog.records)
