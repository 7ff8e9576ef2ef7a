"""A worker that changes its role at runtime: ``POST /role`` on a decode worker makes it a prefill
worker with the model it holds, and back (``server/role_switch.py``, ``docs/lifecycle.md``, *A role
switch*).

One cluster for the module (nixl): a prefill ``P``, a decode ``D`` and a decode ``X`` (given its
``--bootstrap-port`` from the start, so that it may become a prefill), behind a router that knows
them from the command line (``--prefill P``, ``--decode D --decode X``): the router learns the
switch from ``X``'s ``/health`` (a new incarnation, another role) and its bootstrap port from its
``/get_server_info``. The workers hold the admin and worker keys, the router the worker key. ``X``
also registers in a real etcd (``--discovery``, when ``etcd`` is installed: CI installs it; the
session's, ``tests/etcd_cluster.py``, under a prefix of its own), whose
record must follow each switch, and a second router that knows ``X`` from etcd alone must follow
it too (the old incarnation's worker drained away, the new one in rotation in its new role).

Peers are declared lost only after 120 s of silence here, far past anything this file waits for:
a peer that ends a session of ``X``'s old incarnation did so because ``X`` said goodbye.

The tcp backend's switch (a smaller cluster of its own) runs under ``make check-long``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import socket
import threading
from typing import Optional

import pytest
import requests

from cluster import (HTTP_TIMEOUT_S, Cluster, RouterProcess, metric, metric_sum, metrics, pages_back_to_total,
                     post_generate)
from conftest import CLUSTER_SECRET, free_port
from etcd_cluster import Load
from etcd_server import have_etcd
from splitserve.auth import bearer
from helpers.prompts import GREEDY, prompt
from helpers.sse import sse_events
from helpers.waiting import wait_for

ADMIN, WORKER, METRICS = "role-test-admin-key", "role-test-worker-key", "role-test-metrics-key"
KEYS = ["--admin-api-key", ADMIN, "--worker-api-key", WORKER, "--metrics-api-key", METRICS]
SILENCE = ["--heartbeat-interval-s", "1", "--heartbeat-misses", "120"]  # 120 s of silence to be lost
ROUTER = ["--worker-api-key", WORKER, "--health-interval-s", "0.5"]
BOUND_S = 60.0  # every wait of this file: far under the silence bound, far over what it takes


ETCD_PREFIX = "/role-test"
DRAIN_S = 300  # X's drain bound: what is in flight always finishes first here, however loaded the machine
LONG_TOKENS = 400


def start(backend: str, decodes: int, etcd=None) -> Cluster:
    """A prefill and ``decodes`` decode workers, the last of them (``X``) with a bootstrap port
    (and registered in ``etcd``, if given)."""
    port = free_port()
    x_args = ["--bootstrap-port", str(port), "--worker-id", "x", "--drain-timeout-s", str(DRAIN_S)]
    if etcd is not None:
        x_args += ["--discovery", etcd.url(ETCD_PREFIX), "--discovery-grace-s", "0.5", "--discovery-ttl-s", "6"]
    decode_args = [[] for _ in range(decodes - 1)] + [x_args]
    c = Cluster(1, decodes, backend, worker_args=[*KEYS, *SILENCE], decode_args=decode_args,
                router_args=ROUTER).start()
    c.decode[-1].bootstrap_port = port
    c.etcd = etcd
    return c


def load(url: str, threads: int = 3) -> Load:
    """Streaming requests through the router at ``url`` (prompts of 12 to 31 tokens, greedy)."""
    return Load(url, threads, max_new_tokens=12, tag="role", sampling=GREEDY, timeout=HTTP_TIMEOUT_S,
                input_ids=lambda i, n: prompt(12 + n % 20, i * 100003 + n))


@pytest.fixture(scope="module")
def cluster(request):
    """The module's cluster; ``X`` registers in the session's etcd (``tests/etcd_cluster.py``,
    under a prefix of its own) when etcd is installed."""
    with contextlib.ExitStack() as stack:
        etcd = request.getfixturevalue("etcd_cluster").etcd if have_etcd() else None
        c = start("nixl", 2, etcd)
        stack.callback(c.stop)
        c.watcher = None  # a second router that knows X from etcd alone
        if etcd is not None:
            c.watcher = RouterProcess([], [], "--discovery", etcd.url(ETCD_PREFIX), "--cluster-secret-file",
                                      CLUSTER_SECRET, *ROUTER, wait_healthy=False).start()
            stack.callback(c.watcher.stop)
        yield c


def record(c: Cluster) -> Optional[dict]:
    """``X``'s record in etcd now (None: there is none), if it registers there; its seal verified."""
    from splitserve.disagg.control.curve import ClusterSecret
    from splitserve.discovery.signing import RecordSeal

    found = c.etcd.client().get(f"{ETCD_PREFIX}/workers/x")
    seal = RecordSeal(ClusterSecret.load(CLUSTER_SECRET).record_key)
    return dataclasses.asdict(seal.open(found[0])) if found else None


def assert_registered(c: Cluster, body: dict) -> None:
    """``X``'s record in etcd names the role and incarnation of ``body`` (a ``POST /role`` answer),
    and the router that watches etcd has that incarnation of ``X`` in rotation, in that role, and
    no other one of it."""
    if c.etcd is None:
        return
    X = c.decode[-1]
    want = {"role": body["role"], "incarnation": body["incarnation"], "url": X.url,
            "bootstrap_port": X.bootstrap_port if body["role"] == "prefill" else None}
    wait_for(f"X's record in etcd says {want}",
             lambda: (r := record(c)) is not None and all(r[k] == v for k, v in want.items()), BOUND_S,
             on_fail=lambda: f"{record(c)}\n{X.output_tail(2000)}")

    def seen() -> list:
        return [w for w in requests.get(c.watcher.url + "/workers", timeout=10).json()["workers"] if w["id"] == "x"]

    def as_wanted() -> bool:
        return [(w["state"], w["source"], *(w[k] for k in want)) for w in seen()] == \
            [("healthy", "discovery", *want.values())]

    wait_for(f"the watching router has X as {want}, and no other X", as_wanted, BOUND_S,
             on_fail=lambda: f"{seen()}\n{c.watcher.output_tail(2000)}")


def health(worker) -> dict:
    return requests.get(worker.url + "/health", timeout=10).json()


def post_role(worker, body, key: str = ADMIN) -> requests.Response:
    return requests.post(worker.url + "/role", json=body, headers=bearer(key) if key else {}, timeout=BOUND_S + 60)


def worker_metrics(worker) -> dict:
    return metrics(worker, ADMIN)


def error_code(resp: requests.Response) -> str:
    return resp.json()["error"]["code"]


def legs(worker, role: str) -> float:
    """Requests ``worker`` ended as a ``role`` worker (its lifecycle's count)."""
    return metric_sum(worker_metrics(worker), "splitserve_requests_total", role=role)


def switch(worker, role: str) -> dict:
    before = health(worker)
    resp = post_role(worker, {"role": role, "epoch": before["epoch"]})
    assert resp.status_code == 200, f"{resp.status_code}: {resp.text}\n{worker.output_tail(3000)}"
    body = resp.json()
    assert body["switched"] is True and body["role"] == role and body["epoch"] == before["epoch"] + 1, body
    assert body["previous"] == {"role": before["role"], "epoch": before["epoch"],
                                "incarnation": before["incarnation"]}, body
    now = health(worker)
    assert (now["role"], now["epoch"], now["incarnation"]) == (role, body["epoch"], body["incarnation"]), now
    assert now["incarnation"] != before["incarnation"] and now["id"] == before["id"], (before, now)
    return body


# -- the engine loop's side, in process: what a replaced role's threads posted never reaches the next


class FakeRole:
    """A role that records the events it is handed; ``on_close`` runs as it closes (standing for
    a thread of it that posts while it stops)."""

    name = "fake"
    deadlines = "the old role's deadlines"  # what a switch hands the role it builds
    rooms: dict = {}

    def __init__(self, on_close=None, fail_start: bool = False):
        self.events, self.closed, self.on_close, self.fail_start = [], [], on_close, fail_start

    def start(self, loop) -> None:
        if self.fail_start:
            raise RuntimeError("its port is taken")
        self.loop, self.post = loop, loop.poster()

    def close(self, goodbye=None) -> None:
        self.closed.append(goodbye)
        if self.on_close is not None:
            self.on_close(self)

    def on_event(self, event):
        self.events.append(event)
        return []

    def fail_all(self, ending):
        return []

    def tick(self, now):
        return []

    def wait_s(self, now):
        return 0.05

    def stats(self):
        return None

    def holds_nothing(self) -> bool:
        return True


@pytest.fixture
def engine():
    from conftest import CACHE_DIR
    from splitserve.config import EngineConfig
    from splitserve.engine.async_engine import AsyncEngine
    from splitserve.models.resolve import resolve_model_dir

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPLITSERVE_CACHE", str(CACHE_DIR))
        model = resolve_model_dir("tiny")
    old = FakeRole(on_close=lambda role: role.post("posted by the old role as it stopped"))
    e = AsyncEngine(EngineConfig(model=model, page_size=16, max_total_tokens=1024), old)
    e.start()
    yield e
    e.shutdown()


def test_events_of_a_replaced_role_are_dropped_and_the_next_role_gets_its_own(engine):
    old, new = engine.role, FakeRole()
    assert engine.replace_role(new, "it becomes another") == 0
    assert engine.role is new and old.closed == ["it becomes another"]
    old.post("posted later by a thread of the old role that did not stop")
    new.post("the new role's")
    wait_for("the new role gets its event", lambda: new.events, BOUND_S)
    engine.call_on_loop(lambda: None)  # the loop has taken everything posted before
    assert new.events == ["the new role's"] and old.events == [], (new.events, old.events)
    assert engine.stale_events == 2


def test_a_role_that_cannot_start_is_closed_and_the_loop_keeps_the_old_one(engine):
    old, broken = engine.role, FakeRole(fail_start=True)
    with pytest.raises(RuntimeError, match="its port is taken"):
        engine.replace_role(broken, "it becomes another")
    assert engine.role is old and broken.closed == [None], broken.closed
    engine.post_event("after")  # for the role the loop runs now
    wait_for("the old role gets it", lambda: old.events == ["after"], BOUND_S)


class Registration:
    """What ``--discovery`` keeps of the worker's record: revoked as a switch begins."""

    def __init__(self, log: list):
        self.log = log

    def revoke(self) -> None:
        self.log.append("revoked")


def test_a_role_that_cannot_be_built_leaves_the_old_one_serving_and_registered(engine):
    """The new role fails before the old one stopped (building it raised: its transfer agent, say):
    the switch fails, and the old role serves on as it was — not closed, the same incarnation, taking
    requests, and its record put back in discovery."""
    from splitserve.config import ServerConfig
    from splitserve.metrics import Registry
    from splitserve.server.state import WorkerState
    from splitserve.server.role_switch import SwitchFailed, switch as switch_role

    config = ServerConfig(role="decode", discovery_grace_s=0.0, drain_timeout_s=5.0)
    state = WorkerState(engine, config, Registry(), incarnation="i-old")
    discovery: list = []
    state.registration = Registration(discovery)
    state.register = lambda: discovery.append("registered") or Registration(discovery)
    old, built = engine.role, []

    def broken(config, deadlines, incarnation):
        built.append((config.role, deadlines))
        raise RuntimeError("no transfer agent for it")

    target = dataclasses.replace(config, role="prefill")
    with pytest.raises(SwitchFailed, match="no transfer agent for it; the worker serves as a decode on "
                                           r"\(incarnation i-old\)"):
        asyncio.run(switch_role(state, target, make_role=broken))
    assert built == [("prefill", old.deadlines)]
    assert engine.role is old and old.closed == [], old.closed
    assert (state.config.role, state.incarnation, state.switch) == ("decode", "i-old", None)
    assert not state.draining and not engine.draining
    assert discovery == ["revoked", "registered"] and state.registration is not None
    engine.post_event("after")  # the old role still runs the loop
    wait_for("the old role gets it", lambda: old.events == ["after"], BOUND_S)


# -- the router's side, in process: a worker it knows from its command line changes its role -------


def test_the_router_moves_a_worker_that_switched_its_role_and_asks_a_prefill_its_bootstrap_port():
    import aiohttp
    from aiohttp import web

    from splitserve.router.workers import DECODE, PREFILL, HealthChecker, Worker, WorkerSet

    now = {"role": DECODE, "incarnation": "inc1", "bootstrap_port": None}

    async def health(_request):
        return web.json_response({"status": "ok", "id": "x", "incarnation": now["incarnation"], "role": now["role"],
                                  "epoch": 0})

    async def server_info(_request):
        return web.json_response({"bootstrap_port": now["bootstrap_port"] if now["role"] == PREFILL else None,
                                  "model_fingerprint": "tiny:abc/none", "protocol_version": 5,
                                  "transfer_backend": "nixl"})

    async def models(_request):
        return web.json_response({"data": [{"id": "tiny"}]})

    async def go():
        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/get_server_info", server_info)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        x = Worker(DECODE, f"http://127.0.0.1:{runner.addresses[0][1]}")
        workers = WorkerSet([], [x])
        try:
            async with aiohttp.ClientSession() as session:
                checker = HealthChecker(workers, session, 0.5, 1)
                await checker.check(x)
                assert x.healthy and workers.decode == [x] and workers.prefill == []
                now.update(role=PREFILL, incarnation="inc2")  # switched; its bootstrap port not said (yet)
                await checker.check(x)
                assert workers.prefill == [x] and workers.decode == [] and x.role == PREFILL, workers
                assert not x.healthy and "bootstrap port" in x.last_error and x.restarts == 1, x
                now["bootstrap_port"] = 9123
                await checker.check(x)
                assert x.healthy and x.bootstrap_port == 9123 and x.incarnation == "inc2", x
                now.update(role=DECODE, incarnation="inc3")  # and back
                await checker.check(x)
                assert workers.decode == [x] and x.healthy and x.bootstrap_port is None and x.restarts == 2, x
        finally:
            await runner.cleanup()

    asyncio.run(go())


# -- real processes --------------------------------------------------------------------------------


def test_a_role_request_needs_the_admin_key_and_a_well_formed_body(cluster):
    X = cluster.decode[-1]
    epoch = health(X)["epoch"]
    assert post_role(X, {"role": "prefill", "epoch": epoch}, key="").status_code == 401
    assert post_role(X, {"role": "prefill", "epoch": epoch}, key="not-a-key").status_code == 401
    refused = post_role(X, {"role": "prefill", "epoch": epoch}, key=METRICS)  # a key it knows, of another class
    assert refused.status_code == 403 and error_code(refused) == "permission_denied", refused.text
    for body in (None, [], "prefill", {"role": "prefill"}, {"epoch": epoch}, {"role": "colocated", "epoch": epoch},
                 {"role": "prefill", "epoch": -1}, {"role": "prefill", "epoch": "0"},
                 {"role": "prefill", "epoch": True}, {"role": "prefill", "epoch": epoch, "force": True}):
        resp = post_role(X, body)
        assert resp.status_code == 400 and error_code(resp) == "invalid_role_request", (body, resp.text)
    for raw in (b"{not json", b"[" * 5000 + b"]" * 5000):  # the second: a RecursionError in json.loads
        resp = requests.post(X.url + "/role", data=raw, headers=bearer(ADMIN), timeout=10)
        assert resp.status_code == 400 and error_code(resp) == "invalid_role_request", resp.text
    assert health(X)["epoch"] == epoch and health(X)["role"] == "decode"  # nothing of it changed anything


def test_a_stale_epoch_is_refused_and_the_same_role_is_a_no_op(cluster):
    X = cluster.decode[-1]
    now = health(X)
    for epoch in (now["epoch"] + 1, now["epoch"] + 7) + ((now["epoch"] - 1,) if now["epoch"] else ()):
        resp = post_role(X, {"role": "prefill", "epoch": epoch})
        assert resp.status_code == 409 and error_code(resp) == "stale_epoch", resp.text
        assert f"epoch {now['epoch']}" in resp.json()["error"]["message"], resp.text
    same = post_role(X, {"role": now["role"], "epoch": now["epoch"]})
    assert same.status_code == 200, same.text
    assert same.json() == {"role": now["role"], "epoch": now["epoch"], "incarnation": now["incarnation"],
                           "switched": False}, same.text
    assert health(X) == now  # no drain, no new incarnation, the same epoch


def test_a_role_that_cannot_start_gives_the_worker_back_its_old_one(cluster):
    """``X``'s bootstrap port is taken when it would become a prefill: the answer says so (500),
    and ``X`` is a decode again, under a new incarnation, serving requests through the router."""
    X = cluster.decode[-1]
    before = health(X)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", X.bootstrap_port))
        squatter.listen()
        resp = post_role(X, {"role": "prefill", "epoch": before["epoch"]})
    assert resp.status_code == 500 and error_code(resp) == "role_switch_failed", resp.text
    assert "serves as a decode again" in resp.json()["error"]["message"], resp.text
    now = health(X)
    assert now["role"] == "decode" and now["epoch"] == before["epoch"] + 1, now
    assert now["incarnation"] != before["incarnation"], now
    served, seeds = legs(X, "decode"), itertools.count(7000)

    def one_more() -> bool:  # the router finds it again (a new incarnation) and sends it legs
        resp = post_generate(cluster.url, prompt(16, next(seeds)), 6, stream=True, **GREEDY)
        assert resp.status_code == 200 and sse_events(resp.text)[-1] == "[DONE]", resp.text[-500:]
        return legs(X, "decode") > served

    wait_for("X serves decode legs again", one_more, BOUND_S)
    pages_back_to_total(X, api_key=ADMIN)


def test_a_decode_becomes_a_prefill_and_back_under_load_and_no_request_fails(cluster):
    """The switch under steady streaming load through the router: every request succeeds, ``X``
    serves prefill legs once it is a prefill and decode legs once it is a decode again, the peers
    of each old incarnation end its sessions at once (goodbye), and every page account is back
    to total at the end."""
    P, D, X = cluster.prefill[0], cluster.decode[0], cluster.decode[-1]
    ended_on_p = metric(worker_metrics(P), "splitserve_control_ended_sessions", role="prefill")
    with load(cluster.url) as running:
        running.wait_done(3, BOUND_S)
        wait_for("X serves decode legs", lambda: legs(X, "decode") >= 1, BOUND_S)
        assert_registered(cluster, {**health(X), "role": "decode"})
        first = switch(X, "prefill")
        assert_registered(cluster, first)
        # P had a session with X's decode incarnation: it ended at once (goodbye), not at the silence bound
        wait_for("P ends the session of X's old incarnation",
                 lambda: metric(worker_metrics(P), "splitserve_control_ended_sessions", role="prefill") > ended_on_p,
                 BOUND_S)
        wait_for("X serves prefill legs", lambda: legs(X, "prefill") >= 3, BOUND_S,
                 on_fail=lambda: cluster.output(2000))
        running.wait_done(3, BOUND_S)
        lost_on_d = metric_sum(worker_metrics(D), "splitserve_peers", role="decode", state="lost")
        second = switch(X, "decode")
        assert second["epoch"] == first["epoch"] + 1
        assert_registered(cluster, second)
        # D had sessions with X's prefill incarnation: ended at once too
        wait_for("D ends its session with X's prefill incarnation",
                 lambda: "its incarnation ended" in D.stderr() and
                 metric_sum(worker_metrics(D), "splitserve_peers", role="decode", state="lost") > lost_on_d, BOUND_S,
                 on_fail=lambda: D.output_tail(3000))
        decoded = legs(X, "decode")
        wait_for("X serves decode legs again", lambda: legs(X, "decode") >= decoded + 3, BOUND_S)
    assert not running.failures, f"{len(running.failures)} of {running.done} failed: {running.failures[:5]}"
    assert running.done >= 12, running.done
    print(f"\nrole switch under load (nixl): {running.done} requests, none failed; X ended {legs(X, 'prefill'):.0f} "
          f"as a prefill, {legs(X, 'decode'):.0f} as a decode; epochs {first['epoch']}, {second['epoch']}")
    for w in cluster.workers:
        pages_back_to_total(w, api_key=ADMIN)
    assert metric_sum(worker_metrics(X), "splitserve_thread_restarts_total") == 0


def test_a_switch_waits_for_what_is_in_flight_and_refuses_a_second_one_meanwhile(cluster):
    """A long stream served by ``X`` alone (no bootstrap fields: decode computes its prompt) holds
    the switch in its drain: ``/health`` says ``draining``, a second request meanwhile — with the
    new epoch, or the old one — is refused (409, a switch under way), and the stream still ends
    whole before ``X`` becomes a prefill. Then ``X`` goes back to decode."""
    X = cluster.decode[-1]
    before = health(X)
    assert before["role"] == "decode", before
    got: dict = {}

    def long_stream() -> None:
        got["stream"] = requests.post(X.url + "/generate", headers=bearer(WORKER), timeout=DRAIN_S, json={
            "input_ids": prompt(16, 4242), "stream": True,
            "sampling_params": {"max_new_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0}})
        got["switched before the stream ended"] = "switch" in got

    def first_switch() -> None:
        got["switch"] = post_role(X, {"role": "prefill", "epoch": before["epoch"]})

    streaming = threading.Thread(target=long_stream)
    streaming.start()
    wait_for("X runs the stream", lambda: any(r.get("state") == "DECODING" for r in requests.get(
        X.url + "/debug/requests", headers=bearer(ADMIN), timeout=10).json()), BOUND_S)
    switching = threading.Thread(target=first_switch)
    switching.start()
    wait_for("X drains", lambda: health(X)["status"] == "draining", BOUND_S)
    for epoch in (before["epoch"] + 1, before["epoch"]):  # the switch's epoch, and the one it was asked with
        resp = post_role(X, {"role": "decode", "epoch": epoch})
        assert resp.status_code == 409 and error_code(resp) == "role_switch_in_progress", (epoch, resp.text)
    streaming.join(DRAIN_S)
    switching.join(BOUND_S)
    stream = got["stream"]
    events = sse_events(stream.text)
    assert stream.status_code == 200 and events[-1] == "[DONE]", stream.text[-500:]
    assert "output_ids" in events[-2] and len(events[-2]["output_ids"]) == LONG_TOKENS, events[-3:]  # whole
    assert got["switched before the stream ended"] is False
    assert got["switch"].status_code == 200 and got["switch"].json()["role"] == "prefill", got["switch"].text
    switch(X, "decode")
    pages_back_to_total(X, api_key=ADMIN)


@pytest.mark.long
def test_the_switch_on_the_tcp_backend():
    """The same round trip on the tcp backend (its receiver threads and sockets torn down and
    made again in one process), with requests through the router before, between and after."""
    c = start("tcp", 2)
    try:
        X = c.decode[-1]
        with load(c.url, threads=2) as running:
            running.wait_done(3, BOUND_S)
            switch(X, "prefill")
            wait_for("X serves prefill legs", lambda: legs(X, "prefill") >= 3, BOUND_S)
            switch(X, "decode")
            decoded = legs(X, "decode")
            wait_for("X serves decode legs again", lambda: legs(X, "decode") >= decoded + 3, BOUND_S)
        assert not running.failures, running.failures[:5]
        print(f"\nrole switch (tcp): {running.done} requests, none failed; X ended {legs(X, 'prefill'):.0f} as a "
              f"prefill, {legs(X, 'decode'):.0f} as a decode")
        for w in c.workers:
            pages_back_to_total(w, api_key=ADMIN)
    finally:
        c.stop()
