"""Bad input on the disaggregated path: every request ends with a clear error to the client within
a bounded time, and no worker keeps a KV page or a live lifecycle entry for it.

One set of processes for the whole module (``split`` below):

- prefill ``P`` with a small KV pool (``--max-total-tokens 1024``) and short deadlines
  (``--prealloc-s 2 --bootstrap-s 3``);
- decode ``D`` with short deadlines (``--prealloc-s 3 --bootstrap-s 4 --kv-wait-s 5``);
- decode ``X`` with ``--page-size 32`` (an incompatible peer of ``P``, page size 16) and a smaller
  pool still (``--max-total-tokens 512``);
- router ``R`` in front of ``P`` and ``D``, router ``RX`` in front of ``P`` and ``X``.

Cases: a decode worker whose prefill does not exist (nothing listens on the bootstrap port), a
prefill worker whose decode never registers the room, an incompatible peer, a prefill worker that
refuses a prompt too long for its pool (but fine for decode) and a decode worker that refuses one
(fine for prefill), requests without bootstrap fields
sent straight to a worker; then ``/metrics`` and ``/debug/requests`` on every worker: all pages
free, live queues empty, the failures counted; and the pair still serves a normal request.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from cluster import (Cluster, RouterProcess, free_port, generate, metric, metrics, pages_back_to_total,
                     post_generate, start_routers, stop_routers)
from helpers.client_text import assert_in_words, logged_ending
from helpers.sse import sse_events
from helpers.waiting import wait_for

P_PREALLOC_S, P_BOOTSTRAP_S = 2, 3
D_PREALLOC_S, D_BOOTSTRAP_S, D_KV_WAIT_S = 3, 4, 5
P_POOL_TOKENS = 1024
X_POOL_TOKENS = 512
SLACK_S = 10.0  # on top of a deadline, for two busy cores
GREEDY = {"temperature": 0}

# (worker name, outcome, reason) -> failures this module's tests caused, checked at the end: rooms
# the lifecycle ended (its reasons), and requests refused before they became a room (HTTP 400)
ENDED: Counter = Counter()
REFUSED: Counter = Counter()


class Split:
    """The module's processes (see the module docstring)."""

    def __init__(self):
        self.cluster = Cluster(
            prefill=1, decode=2, backend="nixl", router=False,
            prefill_args=["--max-total-tokens", str(P_POOL_TOKENS), "--prealloc-s", str(P_PREALLOC_S),
                          "--bootstrap-s", str(P_BOOTSTRAP_S)],
            decode_args=[["--prealloc-s", str(D_PREALLOC_S), "--bootstrap-s", str(D_BOOTSTRAP_S),
                          "--kv-wait-s", str(D_KV_WAIT_S)],
                         ["--page-size", "32", "--max-total-tokens", str(X_POOL_TOKENS)]])
        self.routers: list[RouterProcess] = []

    def start(self) -> "Split":
        try:
            self.cluster.start()
            self.P, (self.D, self.X) = self.cluster.prefill[0], self.cluster.decode
            self.R, self.RX = self._router(self.D), self._router(self.X)
            start_routers(self.R, self.RX)  # side by side
        except BaseException:
            self.stop()
            raise
        return self

    def _router(self, decode) -> RouterProcess:
        router = RouterProcess([(self.P.url, self.P.bootstrap_port)], [decode.url])
        self.routers.append(router)
        return router

    @property
    def workers(self) -> dict:
        return {"P": self.P, "D": self.D, "X": self.X}

    def stop(self) -> None:
        stop_routers(*self.routers)
        self.cluster.stop()

    def output(self) -> str:
        return self.cluster.output() + "\n" + "\n".join(r.output_tail() for r in self.routers)


@pytest.fixture(scope="module")
def split():
    s = Split().start()
    try:
        yield s
    finally:
        s.stop()


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(10, 2047) for _ in range(n)]


def room() -> int:
    return random.getrandbits(63)


def error_body_of(resp: requests.Response, stream: bool) -> dict:
    """The OpenAI-style error object: from the JSON error body, or for a stream from the
    ``data: {"error"}`` event that must come before ``[DONE]`` (the status of a stream may be 200)."""
    if not stream or not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
        error = resp.json()["error"]
        assert error["message"], resp.text
        return error
    events = sse_events(resp.text)
    assert events and events[-1] == "[DONE]", f"a stream ended without [DONE]: {resp.text[-1000:]}"
    errors = [e["error"] for e in events[:-1] if "error" in e]
    assert errors, f"a failed stream carried no error event: {resp.text[-1000:]}"
    assert "output_ids" not in errors[-1]
    return errors[-1]


def error_of(resp: requests.Response, stream: bool) -> tuple[int, str]:
    """(HTTP status, error message) of a failed request (see ``error_body_of``)."""
    return resp.status_code, error_body_of(resp, stream)["message"]


def timed_post(*args, **kwargs) -> tuple[requests.Response, float]:
    started = time.monotonic()
    resp = post_generate(*args, **kwargs)
    return resp, time.monotonic() - started


# -- a decode worker whose prefill is not there --------------------------------------------------------


def test_decode_with_no_prefill_listening_fails_with_bootstrap_timeout(split):
    """Straight to ``D`` with bootstrap fields naming a port where nothing listens: ``D`` cannot
    get the prefill's info, and its PREALLOC deadline ends the request with ``bootstrap_timeout``
    (plain: a 5xx JSON error; streamed: an error event before ``[DONE]``)."""
    dead = free_port()

    def send(stream: bool):
        extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": dead, "bootstrap_room": room()}
        return timed_post(split.D.url, prompt(40), 8, stream, extra=extra, **GREEDY)

    with ThreadPoolExecutor(2) as pool:  # both at once: one deadline's wait
        plain, streamed = pool.submit(send, False), pool.submit(send, True)
        (resp, seconds), (sresp, sseconds) = plain.result(), streamed.result()
    ENDED[("D", "failed", "bootstrap_timeout")] += 2
    assert 500 <= resp.status_code < 600, resp.text
    _, message = error_of(resp, False)
    assert "bootstrap_timeout" in message, message
    _, smessage = error_of(sresp, True)
    assert "bootstrap_timeout" in smessage, smessage
    for s in (seconds, sseconds):
        assert s <= D_PREALLOC_S + SLACK_S, f"the error took {s:.1f}s (PREALLOC deadline {D_PREALLOC_S}s)"
    pages_back_to_total(split.D)


# -- a prefill worker whose decode never comes ---------------------------------------------------------


def test_prefill_with_unknown_room_fails_with_bootstrap_timeout(split):
    """Straight to ``P`` with a room no decode worker registers: ``P``'s BOOTSTRAPPING deadline
    ends it with ``bootstrap_timeout``."""
    extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": split.P.bootstrap_port, "bootstrap_room": room()}
    resp, seconds = timed_post(split.P.url, prompt(40), 8, extra=extra, **GREEDY)
    ENDED[("P", "failed", "bootstrap_timeout")] += 1
    assert 500 <= resp.status_code < 600, resp.text
    _, message = error_of(resp, False)
    assert "bootstrap_timeout" in message, message
    assert seconds <= P_BOOTSTRAP_S + SLACK_S, f"the error took {seconds:.1f}s (BOOTSTRAPPING {P_BOOTSTRAP_S}s)"
    pages_back_to_total(split.P)


# -- an incompatible peer ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_incompatible_peer_named_by_field(split, stream):
    """Through ``RX`` (``P`` has 16-token pages, ``X`` 32): ``X`` checks ``P``'s bootstrap info
    before it sends anything and fails the request with ``incompatible_peer`` naming
    ``page_size`` in its log; the client reads the reason in words with its request id, never
    ``P``'s address; both workers end the room."""
    resp, seconds = timed_post(split.RX.url, prompt(40, seed=1), 8, stream, **GREEDY)
    ENDED[("X", "failed", "incompatible_peer")] += 1
    status, message = error_of(resp, stream)
    if not stream:
        assert 500 <= status < 600, resp.text
    error = error_body_of(resp, stream)  # machine-readable, not internal_error
    assert_in_words(error, "incompatible_peer", split.P.port, split.P.bootstrap_port, split.X.port)
    rid = resp.headers["X-Request-Id"]
    assert f"(request id {rid})" in message, message
    line = logged_ending(split.X, rid, "incompatible_peer")
    assert "page_size (ours 32, peer's 16)" in line and f":{split.P.bootstrap_port}#" in line, line
    assert seconds <= SLACK_S
    pages_back_to_total(split.X)
    pages_back_to_total(split.P)


# -- a prefill worker that refuses -------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_prefill_refusal_reaches_the_client_and_decode_lets_go(split, stream):
    """A prompt longer than ``P``'s whole pool (1,024 tokens) but fine for ``D``: ``P`` answers
    400, the router passes that answer on and closes its decode leg; ``D`` aborts the room and
    frees everything it reserved."""
    resp, seconds = timed_post(split.R.url, prompt(P_POOL_TOKENS + 200, seed=2), 8, stream, **GREEDY)
    REFUSED[("P", "failed", "bad_request")] += 1
    assert resp.status_code == 400, resp.text  # prefill refuses before any stream starts
    body = resp.json()["error"]
    assert str(P_POOL_TOKENS) in body["message"], body
    assert seconds <= SLACK_S
    pages_back_to_total(split.D)
    pages_back_to_total(split.P)
    # the decode leg was closed by the router: D saw its client go away (or never got the request),
    # and its handler ends (after its pages are back, on a busy machine a moment later)
    wait_for("D's handler of the closed leg ended",
             lambda: metric(metrics(split.D), "splitserve_http_inflight_requests") == 0, 30)


def test_decode_refusal_reaches_the_client_and_prefill_lets_go(split):
    """The mirror case through ``RX``: a prompt that fits ``P`` but not ``X``'s pool. ``X`` answers
    400 (before it even looks at its peer), the router passes it on and closes the prefill leg;
    ``P`` ends the room it was bootstrapping."""
    resp, seconds = timed_post(split.RX.url, prompt(X_POOL_TOKENS + 100, seed=4), 8, **GREEDY)
    REFUSED[("X", "failed", "bad_request")] += 1
    assert resp.status_code == 400, resp.text
    assert str(X_POOL_TOKENS) in resp.json()["error"]["message"], resp.text
    assert seconds <= SLACK_S
    pages_back_to_total(split.P)
    pages_back_to_total(split.X)


# -- no bootstrap fields -----------------------------------------------------------------------------


@pytest.mark.parametrize("path, body", [
    ("/generate", {"input_ids": [10, 11, 12], "sampling_params": {"max_new_tokens": 4}}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 4}),
], ids=["generate", "completions"])
def test_no_bootstrap_fields_is_a_400_naming_bootstrap_room_on_prefill(split, path, body):
    """A prefill worker cannot serve a request alone (decode can: tests/test_decode_alone.py)."""
    who = "P"
    worker = split.workers[who]
    resp = requests.post(worker.url + path, json=body, timeout=30)
    REFUSED[(who, "failed", "bad_request")] += 1
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "bootstrap_room" and "bootstrap_room" in error["message"], error


def test_partial_bootstrap_fields_are_refused(split):
    """A room without host and port cannot be served either: the worker must say so, not wait."""
    resp = post_generate(split.D.url, [10, 11, 12], 4, extra={"bootstrap_room": room()}, timeout=30)
    REFUSED[("D", "failed", "bad_request")] += 1
    assert resp.status_code == 400, resp.text
    assert "bootstrap" in resp.json()["error"]["message"]


# -- afterwards ----------------------------------------------------------------------------------------


def assert_counted(split, expected: Counter) -> None:
    for (name, outcome, reason), n in expected.items():
        worker = split.workers[name]
        samples = metrics(worker)
        got = metric(samples, "splitserve_requests_total", role=worker.role, outcome=outcome, reason=reason)
        counted = {tuple(sorted(dict(ls).items())): v for (m, ls), v in samples.items()
                   if m == "splitserve_requests_total"}
        assert got >= n, f"{name}: splitserve_requests_total{{outcome={outcome},reason={reason}}} is {got}, " \
                         f"want >= {n}; all: {counted}"


def test_afterwards_nothing_leaked_and_endings_counted(split):
    """Every worker: free pages == total, live queue gauges 0, ``/debug/requests`` empty, nothing
    in flight; ``splitserve_requests_total`` counted each room the tests above ended, with the
    lifecycle's reason (``bootstrap_timeout``, ``incompatible_peer``); then the ``P`` + ``D`` pair
    still serves a normal request."""
    for name, worker in split.workers.items():
        samples = pages_back_to_total(worker)
        assert requests.get(worker.url + "/debug/requests", timeout=10).json() == [], name
        assert metric(samples, "splitserve_http_inflight_requests") == 0, name
    assert_counted(split, ENDED)
    assert len(generate(split.R.url, prompt(100, seed=3), 8, **GREEDY)) == 8
    for worker in (split.P, split.D):
        pages_back_to_total(worker)


def test_refused_requests_are_counted(split):
    """The 400s above (no bootstrap fields, a prompt too long for the worker's pool) are counted as
    ``failed`` / ``bad_request`` on the worker that refused them."""
    if not REFUSED:
        pytest.skip("needs the refusal tests above to have run first")
    assert_counted(split, REFUSED)


# -- a bootstrap address nobody answers on is forgotten ------------------------------------------------


class GarbageListener:
    """A TCP port that answers every connection with an HTTP 400 and closes it (what a worker's
    HTTP port, given by mistake as ``bootstrap_port``, does to a ZMQ peer); counts connections."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.connections: list[float] = []
        threading.Thread(target=self._serve, name="garbage-listener", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            self.connections.append(time.monotonic())
            try:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self.sock.close()


def open_fds(pid: int, http_port: int) -> int:
    """Open fds of ``pid`` minus the HTTP connections clients hold open to it (keep-alive sockets
    of the test and the routers come and go and are not the worker's doing)."""
    out = subprocess.run(["ss", "-tanp"], capture_output=True, text=True).stdout
    http = sum(1 for line in out.splitlines()
               if f"pid={pid}," in line and line.split()[3].endswith(f":{http_port}") and line.startswith("ESTAB"))
    return len(os.listdir(f"/proc/{pid}/fd")) - http


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("ss") is None,
                    reason="counts /proc/<pid>/fd and reads `ss`")
def test_decode_forgets_bootstrap_addresses_that_never_answered(split):
    """Requests to ``D`` naming ten dead bootstrap ports and one port that answers garbage all end
    with ``bootstrap_timeout``; afterwards ``D`` must let go of those addresses: its open file
    descriptors return to where they were, and it stops connecting to the garbage port."""
    D = split.D

    def burst(ports):
        with ThreadPoolExecutor(len(ports)) as pool:
            return list(pool.map(lambda port: post_generate(
                D.url, [10, 11, 12], 4, extra={"bootstrap_host": "127.0.0.1", "bootstrap_port": port,
                                               "bootstrap_room": room()}, timeout=60), ports))

    # a first burst creates what the worker makes once (HTTP and tokenizer threads, keep-alive
    # sockets); growth is measured from there, so only per-address leaks can show
    warmup = burst([free_port() for _ in range(11)])
    ENDED[("D", "failed", "bootstrap_timeout")] += len(warmup)
    time.sleep(1.0)
    before = open_fds(D.pid, D.port)
    garbage = GarbageListener()
    try:
        ports = [free_port() for _ in range(10)] + [garbage.port]
        resps = burst(ports)
        ENDED[("D", "failed", "bootstrap_timeout")] += len(ports)
        for resp in resps:
            assert resp.status_code == 504 and "bootstrap_timeout" in resp.text, resp.text
        ended = time.monotonic()
        deadline = ended + 10.0
        while True:
            fds, quiet = open_fds(D.pid, D.port), not any(t > time.monotonic() - 2.0 for t in garbage.connections)
            if fds <= before + 3 and quiet:
                break
            if time.monotonic() > deadline:
                late = sum(1 for t in garbage.connections if t > ended + 1.0)
                raise AssertionError(f"10 s after the requests ended, D holds {fds - before} more open fds than "
                                     f"before and connected to the garbage port {late} times since")
            time.sleep(0.5)
    finally:
        garbage.close()
