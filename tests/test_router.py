"""The router as a real process (``python -m splitserve.cli router``), in front of:

- two real colocated workers (``serve --role colocated``) standing in for prefill and decode (a
  colocated worker accepts the bootstrap fields and ignores them): passthrough of answers and
  streams, byte for byte what the worker itself says;
- fake workers (:class:`FakeWorker`: a small aiohttp app in a thread of this process) that record
  what reaches them and answer as told: the bootstrap fields, a failing prefill leg, client
  disconnects, health rotation and policies, where a real worker could not be told to misbehave;
- raw sockets for clients that misbehave: one that never reads (a small ``SO_RCVBUF``), one that
  sends its head or body a byte at a time. With the fakes they show every bound of
  ``docs/router.md``: each failure of one leg reaches the client while the other leg is open, and
  every wait on a client or a worker ends at its bound (checked with a margin of 5 s).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import pytest
import requests
from aiohttp import web

from cluster import RouterProcess, metric
from conftest import ServerProcess
from helpers.fake_workers import COMPLETION, MODEL, FakeWorker, drop_connection, error_then_hang, hang, reply, sse
from helpers.fake_workers import fake_loop, fakes  # noqa: F401 (fixtures)
from helpers.router_fixture import start_router  # noqa: F401 (a fixture)
from helpers.sse import sse_events
from helpers.waiting import wait_for


# -- the router process ----------------------------------------------------------------------------


SHARED_BOOTSTRAP_PORT = 4242
# a router made for one test never spends its retry budget (10 retries in 10 s); one shared by many
# tests could, and a retry denied would change what a later test sees
SHARED_ROUTER_ARGS = ("--retry-budget-min", "1000")


class RouterSince:
    """A shared router as one test sees it: its counters (``*_total``, and a histogram's
    ``_count``, ``_sum`` and ``_bucket``) counted from the test's start, gauges as they are, and
    its log from the test's start."""

    COUNTED = ("_total", "_count", "_sum", "_bucket")

    def __init__(self, router: RouterProcess):
        self.router, self.url = router, router.url
        self._base = router.metrics()
        self._log_from = len(router.output())

    def metrics(self) -> dict:
        return {key: value - self._base.get(key, 0.0) if key[0].endswith(self.COUNTED) else value
                for key, value in self.router.metrics().items()}

    def metric(self, name: str, **labels) -> float:
        return metric(self.metrics(), name, **labels)

    def output(self) -> str:
        return self.router.output()[self._log_from:]


@pytest.fixture(scope="module")
def shared_routers(fake_loop):
    """Routers over one fake prefill and one fake decode each, by their options, for the module."""
    made: dict[tuple, tuple[RouterProcess, FakeWorker, FakeWorker]] = {}
    yield fake_loop, made
    for router, *pair in made.values():
        router.stop()
        for fake in pair:
            fake.end_hangs()
            fake.stop_listening()


@pytest.fixture
def shared_pair(shared_routers):
    """``shared_pair(prefill_behaviour, decode_behaviour, *router_options)``: (a router, its fake
    prefill, its fake decode), the router started once for the module per set of options (a
    router start is most of a test's time) and the fakes made new for this test
    (``FakeWorker.reset``); the router seen through :class:`RouterSince`. For tests that leave
    both fakes listening. After the test, its hangs end and nothing may be left in flight."""
    loop, made = shared_routers
    used = []

    def get(prefill_behaviour=None, decode_behaviour=None, *args: str):
        if args not in made:
            prefill, decode = FakeWorker(loop), FakeWorker(loop)
            router = RouterProcess([(prefill.url, SHARED_BOOTSTRAP_PORT)], [decode.url], *args, *SHARED_ROUTER_ARGS,
                                   wait_healthy=False)
            made[args] = (router.start(), prefill, decode)
        router, prefill, decode = made[args]
        prefill.reset(prefill_behaviour)
        decode.reset(decode_behaviour)
        used.append((router, prefill, decode))
        return RouterSince(router), prefill, decode

    yield get
    for router, prefill, decode in used:
        prefill.end_hangs()
        decode.end_hangs()
        assert_nothing_in_flight(router, prefill, decode)


def assert_openai_error(resp: requests.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["message"]
    return error


# -- against real colocated workers ----------------------------------------------------------------


@pytest.fixture(scope="module")
def real_workers(server):
    """Two colocated workers standing in for prefill and decode: one of this module's and the
    session's shared one (``conftest.server``: the suite starts it anyway)."""
    # Started from this thread: ServerProcess sets PR_SET_PDEATHSIG, which is tied to the thread
    # that forks, so a server started from a pool thread dies with that thread.
    with ServerProcess() as prefill:
        yield prefill, server


def test_passthrough_with_real_workers(real_workers, start_router):
    prefill, decode = real_workers
    router = start_router([(prefill.url, 9999)], [decode.url])
    models = requests.get(router.url + "/v1/models", timeout=5)
    assert models.status_code == 200, models.text + "\n" + router.output()
    model = models.json()["data"][0]["id"]
    assert model == requests.get(decode.url + "/v1/models", timeout=5).json()["data"][0]["id"]
    assert requests.get(router.url + "/health", timeout=5).status_code == 200

    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    direct = requests.post(decode.url + "/v1/completions", json=body, timeout=60).json()
    via = requests.post(router.url + "/v1/completions", json=body, timeout=60)
    assert via.status_code == 200, via.text
    assert via.json()["choices"][0]["text"] == direct["choices"][0]["text"]
    assert via.json()["model"] == model

    with requests.post(router.url + "/v1/completions", json={**body, "stream": True}, stream=True, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == direct["choices"][0]["text"]

    # both workers ran the request (one as "prefill", one as "decode"); nothing left open
    m = router.metrics()
    assert m[("splitserve_router_requests_total", frozenset({("outcome", "finished")}))] == 2
    wait_for("the prefill leg to end",
             lambda: router.metric("splitserve_router_worker_in_flight", role="prefill", url=prefill.url) == 0, 5.0)
    assert router.metric("splitserve_router_worker_healthy", role="decode", url=decode.url) == 1


# -- against fake workers --------------------------------------------------------------------------


def test_bootstrap_fields_reach_both_workers(shared_pair):
    router, prefill, decode = shared_pair(reply(200, {"who": "prefill"}), reply(200, {"who": "decode"}))
    sent = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "rid": "req-1"}
    for _ in range(2):
        r = requests.post(router.url + "/v1/completions", json=sent, timeout=10)
        assert r.status_code == 200 and r.json() == {"who": "decode"}
    assert len(prefill.requests) == len(decode.requests) == 2
    for (p_path, p_body), (d_path, d_body) in zip(prefill.requests, decode.requests):
        assert p_path == d_path == "/v1/completions"
        assert p_body == d_body  # the same body to both
        assert {k: p_body[k] for k in sent} == sent
        assert p_body["bootstrap_host"] == "127.0.0.1" and p_body["bootstrap_port"] == SHARED_BOOTSTRAP_PORT
        assert isinstance(p_body["bootstrap_room"], int) and 0 <= p_body["bootstrap_room"] < 2**63
    assert prefill.rooms()[0] != prefill.rooms()[1]


def test_bad_input_is_refused_without_touching_workers(shared_pair):
    router, prefill, decode = shared_pair()
    url = router.url + "/v1/completions"
    assert_openai_error(requests.post(url, data=b"{not json", timeout=5), 400)
    assert assert_openai_error(requests.post(url, json={"prompt": "x", "max_tokens": "4"}, timeout=5),
                               400)["param"] == "max_tokens"
    assert assert_openai_error(requests.post(url, json={"prompt": "x", "n": 17}, timeout=5), 400)["param"] == "n"
    assert_openai_error(requests.post(router.url + "/v1/chat/completions", json={"messages": []}, timeout=5), 400)
    assert_openai_error(requests.post(router.url + "/generate", json={"text": 1}, timeout=5), 400)
    error = assert_openai_error(requests.post(url, json={"model": "other", "prompt": "x"}, timeout=5), 404)
    assert MODEL in error["message"] and error["code"] == "model_not_found"
    surrogates = [("/v1/completions", '{"prompt": "hi \\ud800"}', "prompt"),
                  ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}]}',
                   "messages[0].content"),
                  ("/generate", '{"input_ids": [1], "cache_salt": "\\ud800"}', "cache_salt")]
    for path, raw, param in surrogates:  # legal JSON, not text: the router could not even forward it
        error = assert_openai_error(requests.post(router.url + path, data=raw.encode(), timeout=5), 400)
        assert error["param"] == param and "surrogate" in error["message"]
    stops = {"input_ids": [1], "sampling_params": {"stop": [f"s{i}" for i in range(17)]}}  # capped as on workers
    assert assert_openai_error(requests.post(router.url + "/generate", json=stops, timeout=5),
                               400)["param"] == "sampling_params.stop"
    assert prefill.requests == [] and decode.requests == []
    assert router.metric("splitserve_router_requests_total", outcome="bad_request") == 10
    assert "Traceback" not in router.output()


@pytest.mark.parametrize("case", ["429", "500", "reset", "refused", "429-stream"])
def test_prefill_failure_aborts_the_decode_leg(case, fakes, start_router, shared_pair):
    stream = case.endswith("-stream")
    if case.startswith("429"):
        behaviour = reply(429, {"error": {"message": "queue full", "type": "x", "param": None, "code": "busy"}},
                          headers={"Retry-After": "1"})
    elif case == "500":
        behaviour = reply(500, {"error": {"message": "boom", "type": "x", "param": None, "code": "boom"}})
    else:
        behaviour = drop_connection() if case == "reset" else None
    # the decode worker would wait for KV forever; streaming, it has already sent its SSE headers
    decode_behaviour = sse([{"note": "headers sent"}], then_hang=True) if stream else hang()
    options = ("--health-interval-s", "60", "--no-pd-fallback")
    if case == "refused":  # a prefill of its own: it stops listening
        prefill, decode = fakes(behaviour), fakes(decode_behaviour)
        router = start_router([(prefill.url, 1)], [decode.url], *options)
        prefill.stop_listening()  # healthy at the router's first check, gone now
    else:
        router, prefill, decode = shared_pair(behaviour, decode_behaviour, *options)

    started = time.monotonic()
    r = requests.post(router.url + "/v1/completions", json={**COMPLETION, "stream": stream}, timeout=10)
    assert time.monotonic() - started < 3.0
    if case.startswith("429"):
        assert assert_openai_error(r, 429)["message"] == "queue full"
        assert r.headers.get("Retry-After") == "1"
    elif case == "500":
        assert assert_openai_error(r, 500)["message"] == "boom"
    else:
        message = assert_openai_error(r, 502)["message"]  # in words: the address only in the router's log
        assert message.startswith("the prefill worker ") and prefill.url not in message
        assert prefill.url in router.output()
    assert decode.aborted.wait(3.0), "the decode leg was not closed"
    assert decode.finished == 0
    wait_for("the outcome metric",
             lambda: router.metric("splitserve_router_requests_total", outcome="prefill_failed") == 1, 5.0)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_prefill_error_that_echoes_decode_gives_way_to_decode_s_own(stream, shared_pair):
    """Decode failed the room first (say, incompatible_peer) and told prefill, whose leg then fails
    with ``peer_failed`` a little before decode's own answer arrives: the client gets decode's
    error, which names the cause, not prefill's echo of it."""
    echo = {"error": {"message": "peer_failed: peer: incompatible_peer", "type": "server_error", "param": None,
                      "code": "peer_failed"}}
    cause = {"error": {"message": "incompatible_peer: page_size (ours 16, peer's 32)", "type": "server_error",
                       "param": None, "code": "incompatible_peer"}}

    router, _, _ = shared_pair(reply(502, echo), reply(502, cause, delay=0.3))
    r = requests.post(router.url + "/v1/completions", json={**COMPLETION, "stream": stream}, timeout=10)
    assert assert_openai_error(r, 502)["code"] == "incompatible_peer", r.text
    wait_for("the outcome metric",
             lambda: router.metric("splitserve_router_requests_total", outcome="decode_failed") == 1, 5.0)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_decode_error_that_echoes_prefill_gives_way_to_prefill_s_own(stream, shared_pair):
    """The mirror: prefill's writes timed out and it told decode, whose leg fails with
    ``peer_failed`` a little before prefill's own answer arrives (a race on a busy machine): the
    client gets prefill's error, which names the cause (504 transfer_timeout), not decode's 502
    echo of it, whichever leg's answer came first."""
    echo = {"error": {"message": "peer_failed: peer: transfer_timeout", "type": "server_error", "param": None,
                      "code": "peer_failed"}}
    cause = {"error": {"message": "transfer_timeout: 1 writes unfinished", "type": "server_error",
                       "param": None, "code": "transfer_timeout"}}

    router, _, _ = shared_pair(reply(504, cause, delay=0.3), reply(502, echo), "--max-retries", "0", "--no-pd-fallback")
    r = requests.post(router.url + "/v1/completions", json={**COMPLETION, "stream": stream}, timeout=10)
    assert assert_openai_error(r, 504)["code"] == "transfer_timeout", r.text
    wait_for("the outcome metric",
             lambda: router.metric("splitserve_router_requests_total", outcome="prefill_failed") == 1, 5.0)


def test_decode_error_passes_through_and_closes_prefill(shared_pair):
    router, prefill, _ = shared_pair(hang(), reply(503, {"error": {"message": "draining", "type": "x", "param": None,
                                                                   "code": "d"}}))
    r = requests.post(router.url + "/v1/completions", json=COMPLETION, timeout=10)
    assert assert_openai_error(r, 503)["message"] == "draining"
    assert prefill.aborted.wait(3.0)


def raw_request(url: str, path: str, body: dict, rcvbuf: Optional[int] = None) -> socket.socket:
    """A socket that has sent one request. ``rcvbuf``: its receive buffer, set before connecting
    so that the window stays that small (a client that never reads then fills it at once)."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    data = json.dumps(body).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(5)
    sock.connect((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_closes_both_legs(stream, shared_pair):
    router, prefill, decode = shared_pair(sse([{"prefill": 1}], then_hang=True) if stream else hang(),
                                          sse([{"token": "a"}], then_hang=True) if stream else hang())
    sock = raw_request(router.url, "/v1/completions", {**COMPLETION, "stream": stream})
    if stream:
        received = b""
        while b'"token"' not in received:  # the decode worker's first event reached the client
            received += sock.recv(4096)
        assert received.startswith(b"HTTP/1.1 200")
    else:
        wait_for("both legs", lambda: prefill.requests and decode.requests, 5.0)
    sock.close()
    assert decode.aborted.wait(3.0), "the decode leg was not closed"
    assert prefill.aborted.wait(3.0), "the prefill leg was not closed"
    wait_for("the outcome metric",
             lambda: router.metric("splitserve_router_requests_total", outcome="client_disconnect") == 1, 5.0)
    assert router.metric("splitserve_router_requests_in_flight") == 0


def test_a_client_gone_before_a_failure_reached_it_is_counted_as_leaving(shared_pair):
    """Decode answers 502 and its error body does not come; the router has taken the failure as the
    answer (it closed the prefill leg) and reads that body when the client hangs up. The client
    never saw the failure: it is counted ``client_disconnect`` (not ``decode_failed``)."""
    router, prefill, decode = shared_pair(hang(), error_then_hang(502))
    sock = raw_request(router.url, "/v1/completions", COMPLETION)
    assert prefill.aborted.wait(5.0), "the router did not take decode's failure as the answer"
    sock.close()
    assert decode.aborted.wait(5.0), "the decode leg was not closed"
    assert_outcome(router, "client_disconnect")
    assert router.metric("splitserve_router_requests_total", outcome="decode_failed") == 0


def test_unhealthy_worker_leaves_rotation_and_comes_back(fakes, start_router):
    prefill = fakes()
    a, b = fakes(reply(200, {"who": "a"})), fakes(reply(200, {"who": "b"}))
    router = start_router([(prefill.url, 1)], [a.url, b.url], "--health-interval-s", "0.1",
                          "--health-failures", "2", "--no-pd-fallback")

    def healthy(fake, role="decode") -> float:
        return router.metric("splitserve_router_worker_healthy", role=role, url=fake.url)

    def whos(n: int) -> list[str]:
        return [requests.post(router.url + "/v1/completions", json=COMPLETION, timeout=5).json()["who"]
                for _ in range(n)]

    a.health_status = 503
    wait_for("a to leave the rotation", lambda: healthy(a) == 0, 5.0)
    assert whos(3) == ["b"] * 3
    a.health_status = 200
    wait_for("a to come back", lambda: healthy(a) == 1, 5.0)
    assert sorted(whos(2)) == ["a", "b"]

    prefill.health_status = 500  # no prefill worker left: 503 with a reason, and /health says so
    wait_for("the prefill worker to leave", lambda: healthy(prefill, "prefill") == 0, 5.0)
    r = requests.post(router.url + "/v1/completions", json=COMPLETION, timeout=5)
    assert "no healthy prefill worker" in assert_openai_error(r, 503)["message"]
    assert requests.get(router.url + "/health", timeout=5).status_code == 503


def test_round_robin_alternates(fakes, start_router):
    prefill = fakes()
    a, b = fakes(reply(200, {"who": "a"})), fakes(reply(200, {"who": "b"}))
    router = start_router([(prefill.url, 1)], [a.url, b.url], "--policy", "round_robin")
    whos = [requests.post(router.url + "/v1/completions", json=COMPLETION, timeout=5).json()["who"]
            for _ in range(4)]
    assert whos[0] != whos[1] and whos[:2] == whos[2:]


def test_least_load_picks_the_idle_worker(fakes, start_router):
    prefill = fakes()
    busy, idle = fakes(hang()), fakes(reply(200, {"who": "idle"}))
    router = start_router([(prefill.url, 1)], [busy.url, idle.url], "--policy", "least_load")
    with ThreadPoolExecutor(1) as pool:
        # the first pick is a tie, broken round robin: that is `busy`, which holds the request
        held = pool.submit(requests.post, router.url + "/v1/completions", json=COMPLETION, timeout=10)
        wait_for("the held request", lambda: busy.requests, 5.0)
        for _ in range(3):
            assert requests.post(router.url + "/v1/completions", json=COMPLETION, timeout=5).json()["who"] == "idle"
        busy.end_hangs()
        assert held.result().json() == {"who": "released"}


def test_cache_aware_keeps_each_conversation_on_its_workers(fakes, start_router):
    prefill_a, prefill_b = fakes(), fakes()
    a, b = fakes(reply(200, {"who": "a"})), fakes(reply(200, {"who": "b"}))
    router = start_router([(prefill_a.url, 1), (prefill_b.url, 1)], [a.url, b.url], "--policy", "cache_aware",
                          "--cache-block-chars", "16")
    histories = {"one": "You are a helpful agent. " * 8, "two": "You are a careful planner. " * 8}
    seen: dict[str, set] = {name: set() for name in histories}
    for turn in range(4):
        for name in histories:
            histories[name] += f" user turn {turn}: do the next step; answer: step {turn} done."
            who = requests.post(router.url + "/v1/completions", json={"prompt": histories[name], "max_tokens": 4},
                                timeout=5).json()["who"]
            seen[name].add(who)
    assert seen["one"] in ({"a"}, {"b"}) and seen["two"] in ({"a"}, {"b"}) and seen["one"] != seen["two"], seen
    # prefill is chosen on its own, by the same rule: each conversation's prompts went to one prefill
    for p in (prefill_a, prefill_b):
        prompts = {body["prompt"][:30] for _, body in p.requests}
        assert len(prompts) == 1, prompts


def test_cache_aware_weighs_matches_against_load():
    from splitserve.router.policy import CacheAware, CacheKnobs
    from splitserve.router.workers import Worker
    policy = CacheAware(CacheKnobs(block_chars=8, threshold=0.5, balance_abs=2, balance_rel=1.5, index_blocks=4))
    a, b = Worker("decode", "http://a"), Worker("decode", "http://b")

    def pick(key: str, load_a: int, load_b: int) -> Worker:
        a.in_flight, b.in_flight = load_a, load_b
        return policy.pick([a, b], key)

    one, two = "abcdefgh" * 3, "ijklmnop" * 3  # 3 blocks each
    assert pick(one, 0, 1) is a  # nothing matches: the least busy, which learns the key
    assert pick(one + "and more", 2, 0) is a  # a full match outweighs 2 requests more in flight
    assert pick(one, 3, 0) is b  # 3 more and more than 1.5x as many: load wins (and b learns it)
    assert pick(two, 1, 0) is b
    assert pick(two + "z", 0, 1) is b  # b holds it
    assert pick(two[:8] + "y" * 16, 0, 1) is a  # 1 block of 3 is below the threshold: the least busy
    for i in range(10):  # the index is bounded: each worker keeps its last 4 blocks
        pick(f"{i:08d}" * 2, 0, 0)
    assert all(len(seen) <= 4 for seen in policy._seen.values())


def test_cache_aware_index_follows_worker_identity_not_url():
    """A worker replaced at the same URL (another identity) or restarted (a new incarnation) has an
    empty cache, so its index starts empty; a worker that leaves the set takes its index along."""
    from splitserve.config import RouterConfig, WorkerAddress
    from splitserve.metrics import Registry
    from splitserve.router.app import RouterState
    from splitserve.router.workers import DECODE, Worker

    state = RouterState(RouterConfig(policy="cache_aware", prefill=(WorkerAddress("http://p", 1),),
                                     decode=(WorkerAddress("http://a"),)), Registry())
    policy, workers = state.policies[DECODE], state.workers
    key = "abcdefgh" * 32
    blocks = policy.blocks(key)
    static = workers.decode[0]
    static.id, static.incarnation, static.healthy = "decode-a", "1", True
    assert policy.pick([static], key) is static and policy.match(static, blocks) == len(blocks)
    static.incarnation = "2"  # the health check saw it restart: same object, a new process
    assert policy.match(static, blocks) == 0
    assert len(policy._seen) == 0  # the old incarnation's index is gone, not kept beside
    policy.pick([static], key)
    workers.remove(static)
    assert policy._seen == {} and policy._keys == {}  # removal drops the worker's index
    old = workers.add(Worker(DECODE, "http://b", id="decode-b", incarnation="1", healthy=True))
    policy.pick([old], key)
    workers.remove(old)
    new = workers.add(Worker(DECODE, "http://b", id="decode-c", incarnation="7", healthy=True))
    assert policy.match(new, blocks) == 0  # another worker at the old one's URL knows nothing of its cache


def test_flush_cache_reaches_every_worker(fakes, start_router):
    prefill, a, b = fakes(), fakes(), fakes()
    router = start_router([(prefill.url, 1)], [a.url, b.url])
    r = requests.post(router.url + "/flush_cache", timeout=10)
    assert r.status_code == 200, r.text
    assert [w["status"] for w in r.json()["workers"]] == [200, 200, 200]
    assert (prefill.flushes, a.flushes, b.flushes) == (1, 1, 1)
    b.flush_status = 500  # one worker failing: 502, and its answer named
    r = requests.post(router.url + "/flush_cache", timeout=10)
    assert r.status_code == 502
    assert [w["status"] for w in r.json()["workers"] if w["url"] == b.url] == [500]


def test_request_timeout_closes_both_legs(fakes, start_router):
    prefill, decode = fakes(hang()), fakes(hang())
    router = start_router([(prefill.url, 1)], [decode.url], "--request-timeout-s", "1")
    started = time.monotonic()
    r = requests.post(router.url + "/v1/completions", json=COMPLETION, timeout=10)
    assert assert_openai_error(r, 504)["code"] == "timeout"
    assert time.monotonic() - started < 3.0
    assert prefill.aborted.wait(3.0) and decode.aborted.wait(3.0)


def test_a_decode_stream_that_breaks_off_ends_with_an_error_event(shared_pair):
    async def break_off(fake, request, _body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"token": "a"}\n\n')
        await asyncio.sleep(0.1)
        request.transport.close()  # the worker dies mid-stream
        await asyncio.sleep(1)
        return resp

    router, prefill, decode = shared_pair(sse([{"prefill": 1}]), break_off)
    with requests.post(router.url + "/v1/completions", json={**COMPLETION, "stream": True}, stream=True,
                       timeout=10) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[0] == {"token": "a"} and events[-1] == "[DONE]"
    message = events[1]["error"]["message"]  # in words: the address only in the router's log
    assert "the decode worker broke off the answer" in message and decode.url not in message
    assert f"{decode.url} broke off its stream" in router.output()
    wait_for("the outcome metric",
             lambda: router.metric("splitserve_router_requests_total", outcome="decode_failed") == 1, 5.0)


# -- bounds on both legs and on the client (docs/router.md) -----------------------------------------


SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8"}
DECODE_ERROR = {"error": {"message": "kv_timeout: no KV within kv_wait_s", "type": "server_error", "param": None,
                          "code": "kv_timeout"}}


def failing_stream(kind: str, wait: float = 0.0):
    """SSE headers at once, then after ``wait`` seconds one token and a failure: ``error`` (an
    error event and ``[DONE]``, as a worker ends a failed stream), ``reset`` (the connection
    breaks) or ``no_done`` (the body ends cleanly without ``[DONE]``: a truncated answer)."""
    async def behaviour(fake, request, _body):
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await asyncio.sleep(wait)
        await resp.write(b'data: {"token": "a"}\n\n')
        if kind == "error":
            await resp.write(f"data: {json.dumps(DECODE_ERROR)}\n\ndata: [DONE]\n\n".encode())
        elif kind == "reset":
            await asyncio.sleep(0.05)
            request.transport.close()
            await asyncio.sleep(1)
            return resp
        await resp.write_eof()
        return resp
    return behaviour


def endless_stream(event_bytes: int = 16384):
    """SSE events of ``event_bytes`` each, as fast as the reader takes them, until released."""
    payload = b"data: " + json.dumps({"token": "x" * event_bytes}).encode() + b"\n\n"

    async def behaviour(fake, request, _body):
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        while not fake.release.is_set():
            await resp.write(payload)
            await asyncio.sleep(0)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    return behaviour


def assert_legs_closed(router, prefill, decode, timeout: float = 5.0) -> None:
    """Both workers saw their leg closed, and the router counts nothing in flight any more."""
    assert prefill.aborted.wait(timeout), "the prefill leg was not closed"
    assert decode.aborted.wait(timeout), "the decode leg was not closed"
    assert_nothing_in_flight(router, prefill, decode)


def assert_nothing_in_flight(router, prefill, decode) -> None:
    def zero() -> bool:
        m = router.metrics()
        return (m.get(("splitserve_router_requests_in_flight", frozenset()), -1) == 0
                and all(m.get(("splitserve_router_worker_in_flight", frozenset({("role", role), ("url", w.url)})), -1)
                        == 0 for role, w in (("prefill", prefill), ("decode", decode))))
    wait_for("no request and no leg in flight", zero, 5.0)


def assert_outcome(router, outcome: str, timeout: float = 5.0) -> None:
    wait_for(f"outcome {outcome}",
             lambda: router.metric("splitserve_router_requests_total", outcome=outcome) == 1, timeout)


@pytest.mark.parametrize("kind", ["error", "reset", "no_done"])
@pytest.mark.parametrize("when", ["before_prefill_answers", "after_prefill_answered"])
def test_a_decode_failure_reaches_the_client_at_once_and_closes_prefill(when, kind, shared_pair):
    """Decode's stream fails while the prefill leg is open: its headers not yet sent (a slow or
    queued prefill), or sent and its stream still running. The client gets decode's failure at
    once (not when prefill answers: here, never), as an error event and ``[DONE]``; the prefill
    leg is closed; nothing stays in flight."""
    before = when == "before_prefill_answers"
    router, prefill, decode = shared_pair(hang() if before else sse([{"prefill": 1}], then_hang=True),
                                          failing_stream(kind, wait=0.0 if before else 0.5))
    started = time.monotonic()
    with requests.post(router.url + "/v1/completions", json={**COMPLETION, "stream": True}, stream=True,
                       timeout=6) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert time.monotonic() - started < 5.0
    assert events[0] == {"token": "a"} and events[-1] == "[DONE]", events
    error = events[1]["error"]
    if kind == "error":
        assert events[1] == DECODE_ERROR and len(events) == 3  # decode's own bytes, unchanged
    else:
        assert error["message"].startswith("the decode worker") and decode.url not in error["message"], error
    assert prefill.aborted.wait(3.0), "the prefill leg was not closed"
    assert_outcome(router, "decode_failed")
    assert_nothing_in_flight(router, prefill, decode)


@pytest.mark.parametrize("kind", ["reset", "error"])
def test_a_prefill_failure_after_its_headers_leaves_decode_s_stream_alone(kind, shared_pair):
    """The contract (proxy.py): once prefill has accepted, its leg's later failures are the
    workers' business (decode learns of them over the control channel and ends its own stream
    with the cause). The router passes decode's stream through untouched and does not cut it."""
    async def accept_then_fail(fake, request, _body):
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await asyncio.sleep(0.1)
        if kind == "reset":
            request.transport.close()
            await asyncio.sleep(1)
            return resp
        echo = {"error": {"message": "peer_failed", "type": "server_error", "param": None, "code": "peer_failed"}}
        await resp.write(f"data: {json.dumps(echo)}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp

    tokens = [{"token": t} for t in "abcde"]
    router, prefill, decode = shared_pair(accept_then_fail, sse(tokens, delay=0.1))
    with requests.post(router.url + "/v1/completions", json={**COMPLETION, "stream": True}, stream=True,
                       timeout=10) as r:
        assert r.status_code == 200
        assert sse_events(r) == tokens + ["[DONE]"]
    assert decode.finished == 1 and not decode.aborted.is_set()
    assert_outcome(router, "finished")
    assert_nothing_in_flight(router, prefill, decode)


WRITE_BOUND_S = 1.0


def test_a_client_that_stops_reading_a_stream_is_cut_off(shared_pair):
    router, prefill, decode = shared_pair(sse([{"prefill": 1}], then_hang=True), endless_stream(),
                                          "--client-write-timeout-s", str(WRITE_BOUND_S))
    sock = raw_request(router.url, "/v1/completions", {**COMPLETION, "stream": True}, rcvbuf=4096)  # never read
    try:
        assert_legs_closed(router, prefill, decode, timeout=WRITE_BOUND_S + 5)
        assert_outcome(router, "client_timeout")
    finally:
        sock.close()


def test_a_client_that_never_reads_a_large_answer_is_cut_off(shared_pair):
    size = 16 * 1024 * 1024  # far more than the kernel buffers on both sides hold

    async def large(fake, request, _body):
        return web.Response(body=b'{"text": "' + b"a" * size + b'"}', content_type="application/json")

    router, prefill, decode = shared_pair(None, large, "--client-write-timeout-s", str(WRITE_BOUND_S))
    sock = raw_request(router.url, "/v1/completions", COMPLETION, rcvbuf=4096)  # never read
    try:
        assert_outcome(router, "client_timeout", timeout=WRITE_BOUND_S + 5)
        received = 0
        try:
            while chunk := sock.recv(1 << 20):
                received += len(chunk)
        except (ConnectionError, socket.timeout):
            pass
        assert received < size  # the router dropped the connection, it did not keep the answer for us
    finally:
        sock.close()
    assert_nothing_in_flight(router, prefill, decode)


def trickle(url: str, head: bytes, then: bytes, bound: float, answered=lambda received: False) -> tuple[bytes, float]:
    """Send ``head``, then ``then`` a byte every 0.2 s (over and over, never finishing), reading
    what the router answers; stop when it closes the connection, when ``answered(received)``, or
    after ``bound + 5`` seconds. What was received, and the seconds until the stop (inf if the
    time ran out)."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    started = time.monotonic()
    received = b""
    try:
        sock.sendall(head)
        sock.settimeout(0.2)
        i = 0
        while time.monotonic() - started < bound + 5:
            try:
                sock.send(then[i % len(then):i % len(then) + 1])
                i += 1
                chunk = sock.recv(65536)
            except socket.timeout:
                continue
            except ConnectionError:
                chunk = b""
            received += chunk
            if not chunk or answered(received):
                return received, time.monotonic() - started
    finally:
        sock.close()
    return received, float("inf")


def whole_answer(received: bytes) -> bool:
    head, sep, body = received.partition(b"\r\n\r\n")
    lengths = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
    length = lengths[0] if lengths else None
    return bool(sep) and length is not None and len(body) >= length


BODY_BOUND_S = 1.0


def test_a_slow_request_body_is_refused_before_any_leg_opens(fakes, start_router):
    """Slowloris on the body: the router answers 408 once ``client_body_timeout_s`` has passed
    (aiohttp then closes the connection after its lingering read); no worker hears of it."""
    prefill, decode = fakes(), fakes()
    router = start_router([(prefill.url, 1)], [decode.url], "--client-body-timeout-s", str(BODY_BOUND_S))
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{\"prompt\": \"")
    received, seconds = trickle(router.url, head, b"x", BODY_BOUND_S, answered=whole_answer)
    assert seconds < BODY_BOUND_S + 5 and received.startswith(b"HTTP/1.1 408"), received[:300]
    assert json.loads(received.partition(b"\r\n\r\n")[2])["error"]["code"] == "client_timeout"
    assert_outcome(router, "client_timeout")
    assert prefill.requests == [] and decode.requests == []
    assert router.metric("splitserve_router_requests_in_flight") == 0


def test_slow_request_headers_are_cut_off(fakes, start_router):
    prefill, decode = fakes(), fakes()
    router = start_router([(prefill.url, 1)], [decode.url], "--client-header-timeout-s", "1")
    received, seconds = trickle(router.url, b"POST /v1/completions HTTP/1.1\r\n", b"X-Slow: 1\r\n", 1.0)
    assert seconds < 1.0 + 5, "the connection was still open"
    assert not received.startswith(b"HTTP/1.1 2")
    assert prefill.requests == [] and decode.requests == []


@pytest.mark.parametrize("silent", ["prefill", "decode"])
def test_a_worker_that_never_sends_its_headers_is_bounded(silent, shared_pair):
    """A worker that accepts a streaming request and never answers its headers (a worker answers
    them as soon as it accepts or refuses) fails that leg after ``worker_header_timeout_s`` with
    504; the other leg is closed."""
    open_stream = sse([{"note": "headers sent"}], then_hang=True)
    router, prefill, decode = shared_pair(hang() if silent == "prefill" else open_stream,
                                          hang() if silent == "decode" else open_stream,
                                          "--worker-header-timeout-s", "1", "--no-pd-fallback")
    started = time.monotonic()
    r = requests.post(router.url + "/v1/completions", json={**COMPLETION, "stream": True}, timeout=6)
    assert time.monotonic() - started < 1 + 5
    error = assert_openai_error(r, 504)
    assert error["code"] == "worker_timeout" and error["message"].startswith(f"the {silent} worker did not answer")
    assert (prefill if silent == "prefill" else decode).url not in error["message"]
    assert_legs_closed(router, prefill, decode)
    assert_outcome(router, f"{silent}_failed")


def test_the_bounds_are_options_with_defaults_and_must_be_positive(capsys):
    from splitserve.cli import build_parser
    from splitserve.config import RouterConfig, WorkerAddress
    from splitserve.router.app import create_app

    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for flag, default in (("client-header-timeout-s", 60.0), ("client-body-timeout-s", 30.0),
                          ("client-write-timeout-s", 30.0), ("worker-connect-timeout-s", 10.0),
                          ("worker-header-timeout-s", 30.0)):
        assert getattr(RouterConfig(), flag.replace("-", "_")) == default
        section = shown.rsplit(f"--{flag} {flag.replace('-', '_').upper()}", 1)[1]  # the option, not the usage
        assert f"(default: {default})" in section.split("--", 1)[0], flag
    workers = dict(prefill=(WorkerAddress("http://127.0.0.1:1", 1),), decode=(WorkerAddress("http://127.0.0.1:2"),))
    with pytest.raises(ValueError, match="--client-write-timeout-s must be a positive"):
        create_app(RouterConfig(client_write_timeout_s=0, **workers))


def test_ready_and_models_wait_for_a_usable_pair(fakes, start_router):
    """The router says it is ready, and ``/v1/models`` answers 200, only once a usable pair is up (a
    client that believed either sooner would get 503). With the decode up and the prefill down it
    says it listens and is not ready, ``/v1/models`` answers 503 naming the prefill; once the
    prefill is up it prints its ready line and ``/v1/models`` answers."""
    prefill, decode = fakes(), fakes()
    prefill.health_status = 503
    router = start_router([(prefill.url, 1)], [decode.url], "--health-interval-s", "0.2")
    out = router.output()
    assert "splitserve router listening" in out and "prefill 0/1 up, decode 1/1 up" in out, out
    assert "ready" not in out.replace("not ready", ""), out
    r = requests.get(router.url + "/v1/models", timeout=5)
    assert "no healthy prefill worker" in assert_openai_error(r, 503)["message"]
    prefill.health_status = 200
    wait_for("the ready line", lambda: "splitserve router ready" in router.output(), 5.0)
    assert "prefill 1/1 up, decode 1/1 up" in router.output().split("splitserve router ready")[1]
    r = requests.get(router.url + "/v1/models", timeout=5)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL, r.text


def test_models_is_answered_by_any_healthy_decode_worker(fakes, start_router):
    """The first decode worker in rotation accepts ``/v1/models`` and never answers (a wedged
    worker that health checks have not caught yet): another healthy one answers instead, at once."""
    prefill, wedged, fine = fakes(), fakes(), fakes()
    wedged.models_hang = True
    router = start_router([(prefill.url, 1)], [wedged.url, fine.url])
    started = time.monotonic()
    r = requests.get(router.url + "/v1/models", timeout=8)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL, r.text
    assert time.monotonic() - started < 5.0


@pytest.mark.parametrize("where", ["worker", "router"])
def test_a_client_gone_as_its_body_completes_is_not_missed(where):
    """The router closes a leg the moment the other leg is refused; the worker's handler may be
    cancelled just as it reads the last of the body. That cancellation must not be lost (Python
    3.11's ``asyncio.wait_for`` drops it when its inner future is done: the request then went on
    with its client gone, a decode room held until its deadline)."""
    from splitserve.http_util import read_body as worker_read_body
    from splitserve.router.client import read_body as router_read_body

    read_body = worker_read_body if where == "worker" else router_read_body

    async def main() -> None:
        body = asyncio.get_running_loop().create_future()

        class Request:
            def read(self):
                return body

        task = asyncio.ensure_future(read_body(Request(), 30.0, 1 << 20))
        await asyncio.sleep(0)  # the read is under way
        body.set_result(b"{}")  # the body is in ...
        task.cancel()  # ... and the client is gone, in the same turn of the loop
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_no_wait_for_in_the_servers():
    """The siblings of the read_body case above: every bounded await of the router and the worker
    uses ``asyncio.timeout``, never ``asyncio.wait_for``, which on Python 3.11 drops a cancellation
    that arrives in the turn its inner future completes (the leg, drain, error-body and release
    waits had it). The simulator's HTTP client (``sim/http.py``) stands in for aiohttp's own
    timeout and is not served code."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "splitserve"
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "sim":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "wait_for":
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, f"asyncio.wait_for can lose a cancellation; use asyncio.timeout: {found}"
