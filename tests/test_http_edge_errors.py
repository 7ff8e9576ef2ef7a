"""Requests that aiohttp's HTTP parser refuses before any app sees them — a header or request line
over its 8190-byte limit, a malformed request line, too many headers, a malformed Content-Length or
chunk size — and a body over ``--max-body-bytes``: a real router and a real worker (the session's
tiny-model server, with the router in front of it) each answer them with an OpenAI error body
(``invalid_request_error``, a code naming what was wrong) and the same status aiohttp gives, never
its plain text (which echoes the client's bytes and names the library). Raw sockets: a client
library would refuse to send most of these.
"""

from __future__ import annotations

import json
import socket

import pytest

from cluster import RouterProcess
from splitserve.config import ServerConfig

ROUTER_MAX_BODY = 4096
MAX_BODY = {"router": ROUTER_MAX_BODY, "worker": ServerConfig().max_body_bytes}  # the worker's default
JUNK = b"q" * 9000  # over aiohttp's 8190-byte line limit


@pytest.fixture(scope="module")
def servers(server):
    """{"worker": its URL, "router": its URL}: the session's worker, and a router in front of it
    with ``--max-body-bytes`` 4096 (no request reaches the worker through it)."""
    router = RouterProcess([(server.url, 1)], [server.url], "--max-body-bytes", str(ROUTER_MAX_BODY),
                           wait_healthy=False)
    try:
        yield {"worker": server.url, "router": router.start().url}
    finally:
        router.stop()


def exchange(url: str, data: bytes) -> tuple[int, dict, bytes]:
    """Send ``data`` on a new connection; the answer's status, headers (lower-case names) and body
    (read to its Content-Length, or to the connection's end)."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            sock.sendall(data)
        except OSError:  # answered and closed before it read all of it: the answer is still there
            pass
        received = b""
        while b"\r\n\r\n" not in received or len(received.partition(b"\r\n\r\n")[2]) < _length(received):
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


def _length(received: bytes) -> int:
    for line in received.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 1 << 30


def post(path: str, headers: bytes, body: bytes = b"") -> bytes:
    return b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + headers + \
        b"\r\n" + body


CASES = {
    "a header line over 8190 bytes": (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + JUNK + b"\r\n\r\n", 400,
                                      "header_too_large"),
    "a request line over 8190 bytes": (b"GET /" + JUNK + b" HTTP/1.1\r\nHost: x\r\n\r\n", 400, "header_too_large"),
    "a malformed request line": (b"NOT HTTP AT ALL " + b"q" * 10 + b"\r\n\r\n", 400, "malformed_request_line"),
    "too many headers": (b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-Q%d: q\r\n" % i for i in range(200))
                         + b"\r\n", 400, "malformed_request"),
    "a malformed Content-Length": (post("/v1/completions", b"Content-Length: qqq\r\n", b"{}"), 400,
                                   "malformed_request"),
    "a malformed chunk size": (post("/v1/completions", b"Transfer-Encoding: chunked\r\n", b"qq\r\nqqq\r\n0\r\n\r\n"),
                               400, "malformed_request"),
    "a body over --max-body-bytes": (lambda limit: post("/v1/completions", b"Content-Length: %d\r\n" % (limit + 1),
                                                         b"q" * (limit + 1)), 413, "request_too_large"),
}


@pytest.mark.parametrize("target", ["router", "worker"])
@pytest.mark.parametrize("case", CASES)
def test_a_request_aiohttp_refuses_gets_an_openai_error_body(servers, target, case):
    data, status, code = CASES[case]
    data = data(MAX_BODY[target]) if callable(data) else data
    got, headers, body = exchange(servers[target], data)
    assert got == status and headers.get("content-type", "").startswith("application/json"), (got, headers, body)
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and error["code"] == code and error["message"], error
    assert b"qqq" not in body and b"aiohttp" not in body, body  # neither the client's bytes nor the library


def test_the_pinned_aiohttp_has_the_error_hook_the_servers_override():
    """``http_util.JsonErrors`` overrides aiohttp's ``RequestHandler.handle_error``, for which aiohttp
    has no supported hook: another aiohttp whose method takes other parameters would leave its
    plain-text answers (with a warning at start), so a version bump is checked here first."""
    import inspect

    from aiohttp import web

    from splitserve.http_util import HANDLE_ERROR_PARAMETERS, JsonErrors

    assert tuple(inspect.signature(web.RequestHandler.handle_error).parameters) == HANDLE_ERROR_PARAMETERS
    assert JsonErrors.__slots__ == () and issubclass(JsonErrors, web.RequestHandler)
    from splitserve.http_util import _AIOHTTP_EXPECT  # answer_expect_in_json's stand-in takes its place

    assert tuple(inspect.signature(_AIOHTTP_EXPECT).parameters) == ("request",)


EXPECTS = {"a script": b"<script>alert(1)</script>", "bytes that are not UTF-8": b"\xff\xfeqqq"}


@pytest.mark.parametrize("target", ["router", "worker"])
@pytest.mark.parametrize("path", ["/v1/completions", "/no-such-path"])
@pytest.mark.parametrize("expect", EXPECTS)
def test_an_expect_header_other_than_100_continue_is_a_json_417_that_repeats_nothing(servers, target, path, expect):
    """aiohttp answers ``Expect`` before any middleware, on every path (a 404's too): a value other
    than ``100-continue`` is a 417 whose OpenAI body repeats nothing of it (aiohttp's echoed it in
    plain text, and a value that is not UTF-8 was a 500)."""
    got, headers, body = exchange(servers[target], post(path, b"Content-Length: 2\r\nExpect: " + EXPECTS[expect]
                                                        + b"\r\n", b"{}"))
    assert got == 417 and headers.get("content-type", "").startswith("application/json"), (got, headers, body)
    assert json.loads(body)["error"]["code"] == "expectation_failed", body
    assert b"script" not in body and b"qqq" not in body, body


@pytest.mark.parametrize("target", ["router", "worker"])
def test_expect_100_continue_is_still_answered(servers, target):
    """A client that waits for ``100 Continue`` before its body still gets it."""
    host, port = servers[target].rsplit("/", 1)[-1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(post("/v1/completions", b"Content-Length: 2\r\nExpect: 100-continue\r\n"))
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(4096)
            assert chunk, received
            received += chunk
    assert received.startswith(b"HTTP/1.1 100 Continue\r\n"), received
