"""Bounds on what untrusted clients can make us hold (``docs/security.md``), on a real router in
front of a real prefill and decode worker: the request body's size (and the default measured
against the longest legal prompt), connections open at once, a body sent a byte at a time, and a
long stream nobody reads — each cut off at its bound, refused clearly and counted, and the
workers' pages and queues back to idle."""

from __future__ import annotations

import json
import random
import socket
import threading
import time

import pytest
import requests

from cluster import Cluster, metric, metric_sum, metrics, pages_back_to_total, post_generate
from splitserve.config import RouterConfig, ServerConfig

BOUND_S = 2.0  # the clients' body and write bounds of this cluster
ROUTER_BODY_CAP = 64 << 10
CONNECTION_CAP = 12


@pytest.fixture(scope="module")
def capped():
    bounds = ["--client-body-timeout-s", str(BOUND_S), "--client-write-timeout-s", str(BOUND_S)]
    cluster = Cluster(prefill=1, decode=1, backend="tcp", worker_args=bounds + ["--max-connections", "64"],
                      router_args=bounds + ["--max-body-bytes", str(ROUTER_BODY_CAP),
                                            "--max-connections", str(CONNECTION_CAP)])
    with cluster:
        yield cluster


def address(url: str) -> tuple[str, int]:
    host, port = url.rsplit("/", 1)[-1].split(":")
    return host, int(port)


def head(path: str, length: int, host: str = "127.0.0.1") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def read_answer(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return data


def test_the_default_body_cap_holds_the_longest_legal_prompt_with_room_to_spare(capped):
    """The longest prompt a model takes, as the largest JSON body it can be: its whole context of
    the token whose JSON text is longest (or of the largest token id), measured on the served model."""
    from transformers import AutoTokenizer

    info = requests.get(capped.decode[0].url + "/get_model_info", timeout=10).json()
    tok = AutoTokenizer.from_pretrained(info["tokenizer_path"], local_files_only=True)
    ctx, vocab = info["max_context"], len(tok)
    widest = max(len(json.dumps(t)) for t in tok.batch_decode([[i] for i in range(vocab)]))
    as_text = len(json.dumps({"prompt": "x"})) + ctx * widest
    as_ids = len(json.dumps({"input_ids": [vocab - 1] * ctx}))
    default = ServerConfig().max_body_bytes
    assert default == RouterConfig().max_body_bytes < 64 << 20
    assert max(as_text, as_ids) * 4 < default, (ctx, widest, as_text, as_ids)
    assert 131072 * 64 <= default  # a 128k context at 64 JSON bytes a token (docs/security.md)


def test_a_body_over_the_cap_is_refused_413_naming_the_option(capped):
    small = {"input_ids": [7] * 100, "sampling_params": {"max_new_tokens": 1}}
    assert requests.post(capped.url + "/generate", json=small, timeout=60).status_code == 200
    padded = dict(small, padding="x" * ROUTER_BODY_CAP)
    r = requests.post(capped.url + "/generate", json=padded, timeout=60)
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"], r.text
    decode = capped.decode[0]
    huge = json.dumps(dict(small, padding="x" * ServerConfig().max_body_bytes))
    r = requests.post(decode.url + "/generate", data=huge, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"], r.text
    assert metric(metrics(decode), "splitserve_http_requests_total", path="/generate", status="413") == 1
    capped.assert_no_leaks()


@pytest.mark.parametrize("target", ["router", "decode"])
def test_connections_past_the_cap_get_503_at_once_and_the_others_are_served(capped, target):
    url = capped.url if target == "router" else capped.decode[0].url
    cap = CONNECTION_CAP if target == "router" else 64
    before = metrics(url)
    held = []
    try:
        deadline = time.monotonic() + 20
        while metric(metrics(url), "splitserve_http_connections") < cap:  # with the scrape's own
            held.append(socket.create_connection(address(url), timeout=5))
            assert time.monotonic() < deadline, "the connections were not counted"
        held.append(socket.create_connection(address(url), timeout=5))
        over = socket.create_connection(address(url), timeout=5)
        over.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = read_answer(over, 5)
        assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer, answer
        assert b"--max-connections" in answer
        over.close()
        held.pop().close()  # one slot free again: served
        deadline = time.monotonic() + 10
        while True:
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "a freed slot was not given to a new connection"
            time.sleep(0.1)
    finally:
        for s in held:
            s.close()
    after = metrics(url)
    assert metric(after, "splitserve_http_connections_refused_total") > \
        metric(before, "splitserve_http_connections_refused_total")


@pytest.mark.parametrize("target", ["router", "prefill", "decode"])
def test_a_body_sent_a_byte_at_a_time_is_cut_off_at_its_bound(capped, target):
    url = {"router": capped.url, "prefill": capped.prefill[0].url, "decode": capped.decode[0].url}[target]
    body = json.dumps({"input_ids": [7] * 50, "sampling_params": {"max_new_tokens": 1}}).encode()
    sock = socket.create_connection(address(url), timeout=5)
    sock.sendall(head("/generate", len(body)))
    started = time.monotonic()
    answer = b""
    for i in range(len(body)):
        try:
            sock.sendall(body[i:i + 1])
        except (BrokenPipeError, ConnectionResetError):
            break
        sock.settimeout(0.5)  # a byte every 0.5 s, and look for the answer meanwhile
        try:
            answer += sock.recv(65536)
        except socket.timeout:
            pass
        if answer:
            break
    took = time.monotonic() - started
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"client_body_timeout_s" in answer or b"client-body-timeout-s" in answer, answer
    assert BOUND_S <= took < BOUND_S + 3, took
    capped.assert_no_leaks()


def test_a_stream_nobody_reads_is_cut_off_by_the_worker_in_process(byte_tokenizer):
    """The worker's own write bound, everyday: a client with a 4 KiB receive buffer that never reads
    a stream of a fast (fake) engine is dropped at ``--client-write-timeout-s`` and the request
    aborted in the engine (the real workers' version below is long: the tiny model must generate
    the megabytes the kernel's buffers hold first)."""
    import asyncio

    from aiohttp.test_utils import TestServer

    from splitserve.server.app import create_app
    from helpers.fake_engine import FakeEngine

    engine = FakeEngine(byte_tokenizer)
    engine.spec.max_context = 10 ** 8  # an endless stream, as fast as the event loop goes

    async def main():
        server = TestServer(create_app(engine, ServerConfig(client_write_timeout_s=1.0)), handler_cancellation=True)
        await server.start_server()
        try:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", server.port))
            body = json.dumps({"text": "a" * 200, "stream": True, "sampling_params": {"max_new_tokens": 10 ** 7}})
            sock.sendall(head("/generate", len(body)) + body.encode())
            started = time.monotonic()
            while not engine.aborted and time.monotonic() - started < 20:
                await asyncio.sleep(0.1)
            took = time.monotonic() - started
            sock.close()
            assert engine.aborted, "the unread stream was never aborted"
            assert took < 1.0 + 10, took
            while engine.live and time.monotonic() - started < 30:
                await asyncio.sleep(0.1)
            assert not engine.live
        finally:
            await server.close()

    asyncio.run(main())


def test_a_write_goes_without_its_timer_only_while_the_transport_cannot_pause():
    """``cannot_wait``, on a real loopback transport whose peer never reads: true while what is
    buffered stays under the low-water mark with room for the chunk below the high one; false
    once the kernel's buffers are full and the transport's own fills (the write would wait), and
    false for a chunk that would push it over."""
    import asyncio

    from splitserve.client_writer import cannot_wait

    async def main():
        accepted = asyncio.get_running_loop().create_future()
        server = await asyncio.start_server(lambda r, w: accepted.set_result(w), "127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        peer = await accepted  # never reads
        try:
            transport = writer.transport
            low, high = transport.get_write_buffer_limits()
            assert cannot_wait(transport, 200)
            assert not cannot_wait(transport, high)
            while transport.get_write_buffer_size() <= low:  # the kernel's buffers fill first
                transport.write(b"x" * 65536)
                await asyncio.sleep(0)
            assert not cannot_wait(transport, 1)
            assert not cannot_wait(None, 1)
        finally:
            writer.transport.abort()
            peer.transport.abort()
            server.close()

    asyncio.run(main())


@pytest.mark.long
def test_a_stream_nobody_reads_is_cut_off_through_the_router(capped):
    """A client with a 4 KiB receive buffer that never reads a long ignore_eos stream: the router
    drops it at its write bound, both legs close, decode aborts, and every page comes back."""
    decode = capped.decode[0]
    before = metric_sum(metrics(decode), "splitserve_requests_total", reason="client_abort")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(address(capped.url))
    body = json.dumps({"input_ids": [7] * 20, "stream": True,
                       "sampling_params": {"max_new_tokens": 7000, "ignore_eos": True}}).encode()
    sock.sendall(head("/generate", len(body)) + body)
    started = time.monotonic()
    while metric_sum(metrics(decode), "splitserve_requests_total", reason="client_abort") == before:
        assert time.monotonic() - started < BOUND_S + 300, "decode never aborted the unread stream"
        time.sleep(0.2)
    sock.close()
    capped.assert_no_leaks()
    assert metric(metrics(capped.url), "splitserve_router_requests_total", outcome="client_timeout") >= 1


@pytest.mark.long
def test_a_stream_nobody_reads_is_cut_off_by_the_decode_worker_itself(capped):
    """The same client straight at the decode worker (with the bootstrap fields the router would
    add, and the prefill leg sent beside it): decode drops it at its own write bound."""
    prefill, decode = capped.prefill[0], capped.decode[0]
    before = metric_sum(metrics(decode), "splitserve_requests_total", reason="client_abort")
    room = random.getrandbits(63)
    extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": room}
    sampling = {"max_new_tokens": 7000, "ignore_eos": True}
    ids = [7] * 20
    leg = threading.Thread(target=post_generate, args=(prefill.url, ids, 7000), kwargs=dict(extra=extra,
                           ignore_eos=True, timeout=60), daemon=True)
    leg.start()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(address(decode.url))
    body = json.dumps({"input_ids": ids, "stream": True, "sampling_params": sampling, **extra}).encode()
    sock.sendall(head("/generate", len(body)) + body)
    started = time.monotonic()
    while metric_sum(metrics(decode), "splitserve_requests_total", reason="client_abort") == before:
        assert time.monotonic() - started < BOUND_S + 300, f"decode never aborted the unread stream\n{decode.output_tail()}"
        time.sleep(0.2)
    sock.close()
    leg.join(30)
    capped.assert_no_leaks()
