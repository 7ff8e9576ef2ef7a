"""``splitserve launch``'s look at a worker's ``/health`` (``launch/health_probe.probe``) against
whatever holds the worker's port: an answer that is not HTTP, JSON nested too deep for the parser,
a redirect, or an answer that drips a byte at a time is a failed look with a reason, never an
exception (the supervisor's wait for its first start calls ``probe`` in its own thread) and never
longer than the look's time. Raw-socket servers in this process; bytes and requests are counted,
not times."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from splitserve.launch.health_probe import probe


class Raw:
    """A loopback server that answers each connection with ``answer(conn)`` after reading its request."""

    def __init__(self, answer):
        self.answer, self.requests = answer, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/health"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.requests += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        with conn:
            try:
                conn.recv(65536)
                self.answer(conn)
            except OSError:
                pass


def _http(body: bytes, code: int = 200, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n%s\r\n" % (code, len(body), extra) + body


def _within(call, seconds: float = 30.0):
    """``call()``'s result or exception, from a thread given ``seconds`` (a hang fails the test only)."""
    out = []

    def run():
        try:
            out.append(call())
        except BaseException as exc:  # noqa: BLE001 -- reported below
            out.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert out, "hung"
    return out[0]


@pytest.mark.parametrize("answer, why", [
    (_http(b"[" * 60000), "another process answers there"),  # RecursionError in json.loads
    (_http(b'{"id":' * 20000), "another process answers there"),
    (b"not http at all\r\n\r\n", "no answer (a broken HTTP answer: BadStatusLine)"),
    (b"HTTP/1.1 200 OK\r\nX: " + b"q" * 70000 + b"\r\n\r\n", "no answer (a broken HTTP answer: LineTooLong)"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n", "no answer (a broken HTTP answer"),
])
def test_an_answer_that_breaks_a_parser_is_a_failed_look(answer, why):
    server = Raw(lambda conn: conn.sendall(answer))
    got = _within(lambda: probe(server.url, "w.1", 5.0))
    assert not isinstance(got, BaseException), repr(got)
    assert got.why.startswith(why) and "qqq" not in got.why, got


def test_a_redirect_is_not_followed():
    target = Raw(lambda conn: conn.sendall(_http(b'{"status": "ok", "id": "w.1"}')))
    redirect = Raw(lambda conn: conn.sendall(_http(b"", 302, b"Location: " + target.url.encode() + b"\r\n")))
    assert probe(redirect.url, "w.1", 5.0).why == "answered 302"
    assert target.requests == 0


def test_an_answer_that_drips_is_cut_off_at_the_looks_time():
    """A byte every 0.2 s for 600 bytes: the look ends (failed) long before the drip would."""
    sent = []

    def drip(conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 600\r\n\r\n")
        for _ in range(600):
            conn.sendall(b" ")
            sent.append(1)
            time.sleep(0.2)

    server = Raw(drip)
    got = _within(lambda: probe(server.url, "w.1", 0.5))
    assert not isinstance(got, BaseException) and not got.healthy, got
    assert len(sent) < 600
