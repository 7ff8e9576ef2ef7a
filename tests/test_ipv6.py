"""IPv6 end to end: host strings in one form (``splitserve/hosts.py``), the router's
``bootstrap_host`` for an IPv6 prefill, the allow-lists, the control and tcp transfer sockets on
``::1``, and a router, a prefill and a decode worker on ``[::1]`` serving a split request.

A test that needs ``::1`` (a loopback with IPv6) is skipped where the kernel has none.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
import uuid

import pytest
import requests
import torch

from cluster import RouterProcess, generate, metric_sum, metrics
from conftest import ServerProcess, free_port
from splitserve.hosts import allow_host, check_host, host_port, url_host, zmq_endpoint


def _have_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _have_ipv6_loopback(), reason="no IPv6 loopback (::1) here")


# -- the one form of a host -------------------------------------------------------------------------


@pytest.mark.parametrize("given, url, key", [
    ("::1", "[::1]", "[::1]"),
    ("[::1]", "[::1]", "[::1]"),
    ("[0:0:0:0:0:0:0:1]", "[::1]", "[::1]"),
    ("FD00::2", "[fd00::2]", "[fd00::2]"),
    ("::ffff:127.0.0.1", "[::ffff:7f00:1]", "127.0.0.1"),  # a dual-stack socket's IPv4 peer
    ("127.0.0.1", "127.0.0.1", "127.0.0.1"),
    ("Prefill-0.Example.", "Prefill-0.Example.", "prefill-0.example"),
])
def test_a_host_has_one_form_in_a_url_and_one_in_a_comparison(given, url, key):
    assert url_host(given) == url
    assert allow_host(given) == key == allow_host(url)


def test_zmq_endpoints_bracket_ipv6_and_star_what_is_any():
    assert zmq_endpoint("::1", 8998) == "tcp://[::1]:8998"
    assert zmq_endpoint("[::1]", 0) == "tcp://[::1]:*"
    assert zmq_endpoint("127.0.0.1", None) == "tcp://127.0.0.1:*"
    assert zmq_endpoint("", 5) == zmq_endpoint("*", 5) == "tcp://*:5"
    assert host_port("::", 1) == "[::]:1"


@pytest.mark.parametrize("host, want", [
    ("[::1]", "[::1]"), ("[0::1]", "[::1]"), ("10.0.0.1", "10.0.0.1"), ("prefill_0.svc", "prefill_0.svc"),
    ("::1", "in brackets"), ("[::1", "brackets"), ("[g::1]", "brackets"), ("[fe80::1%eth0]", "brackets"),
    ("a b", "not a host"), ("a%20b", "not a host"), ("", "not a host"), ("-x", "not a host"), ("x" * 254, "not a host"),
    (5, "a string"),
])
def test_a_host_from_the_network_is_checked_and_put_in_its_form(host, want):
    if want.startswith(("[", "1", "p")):
        assert check_host(host) == want == check_host(want)  # its form is a fixed point
    else:
        with pytest.raises(ValueError, match=want):
            check_host(host)


# -- the router's bootstrap_host --------------------------------------------------------------------


def _validated_bootstrap_host(host: str) -> str:
    from splitserve.validation import RequestContext, validate_request

    body = {"model": "m", "prompt": "hi", "max_tokens": 1, "bootstrap_host": host, "bootstrap_port": 8998,
            "bootstrap_room": 1}
    return validate_request(body, "completions", RequestContext(served_model_name="m")).bootstrap_host


@pytest.mark.parametrize("url, host", [
    ("http://[::1]:30000", "[::1]"), ("http://[FD00:0::2]:30000", "[fd00::2]"), ("http://127.0.0.1:1", "127.0.0.1"),
    ("http://prefill_0:1", "prefill_0"),
])
def test_the_router_sends_a_bootstrap_host_the_workers_accept(url, host):
    """The router's ``bootstrap_host`` for a prefill's URL is one a worker's validation takes as
    it is (an IPv6 prefill's in brackets)."""
    from splitserve.router.workers import PREFILL, Worker

    sent = Worker(PREFILL, url, 8998).host
    assert sent == host
    assert _validated_bootstrap_host(sent) == host


def test_a_prefill_whose_host_no_worker_accepts_is_never_in_rotation():
    """A prefill URL whose host would be refused as a ``bootstrap_host`` (here ``a%20b``, which a
    resolver of the test's takes to 127.0.0.1) answers its health checks and still stays out of
    rotation, saying why: the router never reports a ready pair whose every split request would
    be refused."""
    import aiohttp
    from aiohttp import web
    from aiohttp.abc import AbstractResolver

    from splitserve.router.workers import DECODE, PREFILL, HealthChecker, Worker, WorkerSet

    class ToLoopback(AbstractResolver):
        async def resolve(self, host, port=0, family=socket.AF_INET):
            return [{"hostname": host, "host": "127.0.0.1", "port": port, "family": socket.AF_INET, "proto": 0,
                     "flags": 0}]

        async def close(self):
            pass

    async def health(_request):
        return web.json_response({"status": "ok", "id": "w", "incarnation": "i", "role": PREFILL, "epoch": 0})

    async def go():
        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        bad = Worker(PREFILL, f"http://a%20b:{port}", 8998)
        good = Worker(PREFILL, f"http://127.0.0.1:{port}", 8998)
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(resolver=ToLoopback())) as session:
                for w in (bad, good):
                    workers = WorkerSet([w], [Worker(DECODE, "http://127.0.0.1:1")])
                    await HealthChecker(workers, session, 1.0, 1).check(w)
        finally:
            await runner.cleanup()
        assert good.healthy, good.last_error
        assert bad.host is None and not bad.healthy and "bootstrap_host" in bad.last_error, bad.last_error

    asyncio.run(go())


# -- the allow-lists --------------------------------------------------------------------------------


def test_the_allow_list_compares_hosts_in_one_form():
    from splitserve.auth import parse_allowed_prefill

    allowed = parse_allowed_prefill("[0:0::1]:8998,FD00::7,Prefill.Example:1,10.0.0.0/8,fe80::/64")
    assert ("[::1]", 8998) in allowed and ("[::1]", 8999) not in allowed
    assert ("[fd00::7]", 1) in allowed and ("[FD00:0::7]", 2) in allowed  # a bare IPv6 entry: any port
    assert ("prefill.example", 1) in allowed and ("PREFILL.example.", 1) in allowed
    assert ("10.1.2.3", 5) in allowed and ("[fe80::9]", 5) in allowed and ("[fd00::8]", 1) not in allowed


# -- the sockets on ::1 -----------------------------------------------------------------------------


def _take(recv, n: int, bound_s: float = 60.0) -> list:
    got, deadline = [], time.monotonic() + bound_s  # a bound on a hang only
    while len(got) < n and time.monotonic() < deadline:
        frame = recv()
        if frame is None:
            time.sleep(0.005)
        else:
            got.append(frame)
    return got


@needs_ipv6
@pytest.mark.parametrize("host", ["::1", "127.0.0.1"])
def test_the_control_sockets_bind_and_dial_on_either_family(host):
    """Prefill's ROUTER binds ``host`` and decode's DEALER dials it; the sender's address reads as
    the address it is (an IPv4 peer not as an IPv4-mapped IPv6 one)."""
    from splitserve.disagg.control.curve import ClusterSecret
    from splitserve.disagg.control.decode_client import ZmqDealer
    from splitserve.disagg.control.prefill_server import ZmqRouterEndpoint

    secret = ClusterSecret(secrets.token_bytes(32))
    port = free_port()
    endpoint = ZmqRouterEndpoint(host, port, secret)
    dealer = ZmqDealer(host_port(host, port), b"d-" + secrets.token_bytes(4), secret)
    try:
        dealer.send(b"hello")
        got = _take(endpoint.recv, 1)
        assert [f[-1] for f in got] == [b"hello"]
        assert endpoint.last_source == allow_host(host)
        endpoint.send(got[0][0], b"back")
        assert _take(dealer.recv, 1) == [b"back"]
    finally:
        dealer.close()
        endpoint.close()


@needs_ipv6
def test_the_tcp_transfer_writes_over_ipv6():
    from splitserve.disagg.transfer.base import page_spans
    from splitserve.disagg.transfer.tcp import TcpBackend

    tag = uuid.uuid4().hex[:8]
    src, dst = torch.arange(4096, dtype=torch.uint8) % 251 + 1, torch.zeros(4096, dtype=torch.uint8)
    a = TcpBackend(f"p-{tag}", src, host="::1")
    b = TcpBackend(f"d-{tag}", dst, host="::1")
    try:
        assert b.endpoint.startswith("tcp://[::1]:"), b.endpoint
        a.add_peer(b.agent_name, b.metadata())
        h = a.write(b.agent_name, page_spans([0, 1], [2, 3], 1024), b"done")
        deadline = time.monotonic() + 60
        while a.poll(h).pending and time.monotonic() < deadline:
            time.sleep(0.002)
        assert a.poll(h).done, a.poll(h)
        got = []
        while not got and time.monotonic() < deadline:
            got = b.notifications()
            time.sleep(0.002)
        assert got == [(a.agent_name, b"done")]
        assert torch.equal(dst[2048:], src[:2048]) and int(dst[:2048].count_nonzero()) == 0
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("endpoint", ["inproc://zeromq.zap.01", "ipc:///tmp/x", "tcp://::1:5", "tcp://a b:5",
                                      "tcp://h:0", "tcp://h:99999", "tcp://h", 5])
def test_the_tcp_transfer_dials_only_a_tcp_endpoint(endpoint):
    """A peer's link metadata names where to write: only ``tcp://HOST:PORT`` is dialled, never
    another transport (an ``inproc`` one would reach the process's own sockets)."""
    from splitserve.disagg.transfer.base import encode_metadata
    from splitserve.disagg.transfer.tcp import PROTOCOL, TcpBackend

    a = TcpBackend(f"p-{uuid.uuid4().hex[:8]}", torch.zeros(64, dtype=torch.uint8))
    try:
        md = encode_metadata("tcp", "peer", 64, protocol=PROTOCOL, endpoint=endpoint, max_frame=1024, max_notif=64)
        with pytest.raises(ValueError, match="endpoint"):
            a.add_peer("peer", md)
    finally:
        a.close()


# -- end to end on [::1] ----------------------------------------------------------------------------


class V6Server(ServerProcess):
    """A worker listening on ``::1`` (its ``--host`` given after the default one)."""

    @property
    def url(self) -> str:
        return f"http://[::1]:{self.port}"


class V6Router(RouterProcess):
    @property
    def url(self) -> str:
        return f"http://[::1]:{self.port}"


@needs_ipv6
def test_a_split_request_on_ipv6_answers_as_a_worker_alone():
    """A router, a prefill and a decode worker (tcp transfer) all on ``[::1]``: a split request
    through the router is served by both (the prefill counts it) with the tokens the decode
    worker gives alone, which are a colocated worker's (``test_decode_alone.py``)."""
    bootstrap = free_port()
    prefill = V6Server("--host", "::1", "--role", "prefill", "--transfer-backend", "tcp", "--bootstrap-port",
                       str(bootstrap))
    decode = V6Server("--host", "::1", "--role", "decode", "--transfer-backend", "tcp", "--allowed-prefill",
                      f"[::1]:{bootstrap}")
    router = None
    try:
        prefill.spawn()
        decode.spawn()
        prefill.wait_ready()
        decode.wait_ready()
        router = V6Router([(prefill.url, bootstrap)], [decode.url], "--host", "::1").start()
        ids = [(7 * i + 11) % 2000 + 10 for i in range(40)]
        split = generate(router.url, ids, 12, temperature=0)
        alone = generate(decode.url, ids, 12, temperature=0)
        assert split == alone and len(split) == 12
        assert metric_sum(metrics(prefill), "splitserve_requests_total", role="prefill") >= 1
    finally:
        if router is not None:
            router.stop()
        prefill.stop()
        decode.stop()
