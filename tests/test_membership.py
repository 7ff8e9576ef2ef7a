"""Worker identity and the router's membership API, on real processes: the session's workers
(``tests/etcd_cluster.py``, shared with ``test_discovery.py``: two prefill workers and a decode
worker, registered in etcd, which this router does not read) behind a router that starts knowing one
prefill and the decode worker. The tests share that router and run in order: identity,
``POST /workers``, ``DELETE /workers/{id}``, a foreign process on a removed worker's port. The
router never falls back to decode alone (``--no-pd-fallback``): a request without a prefill worker
is refused. Requests are counted, never timed."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from cluster import RouterProcess, generate
from etcd_cluster import finished
from helpers.waiting import wait_for

# two failed checks in a row, not one: on a loaded machine a live worker's /health can miss one
ROUTER_ARGS = ("--health-interval-s", "0.5", "--health-failures", "2", "--no-pd-fallback")


@pytest.fixture(scope="module")
def workers(etcd_cluster):
    """p1 and d1 (the router's own) and p2 (added by POST /workers). Stopped after this file: no
    file after it uses them, and idle they still take ~5 % of a core each (a later user's
    ``ensure`` would start them again)."""
    yield etcd_cluster.ensure("p1", "d1", "p2")
    etcd_cluster.stop(*etcd_cluster.procs)


@pytest.fixture(scope="module")
def router(workers):
    p1, d1, _ = workers
    router = RouterProcess([(p1.url, p1.bootstrap_port)], [d1.url], *ROUTER_ARGS).start()
    try:
        yield router
    finally:
        router.stop()


def router_workers(router) -> list[dict]:
    return requests.get(router.url + "/workers", timeout=10).json()["workers"]


def test_every_worker_reports_its_identity(workers, router, server):
    p1, d1, p2 = workers
    health = requests.get(server.url + "/health", timeout=10).json()  # a worker given no --worker-id
    assert health["id"] == f"colocated@127.0.0.1:{server.port}" and health["role"] == "colocated"
    seen = set()
    for w in workers:
        health = requests.get(w.url + "/health", timeout=10).json()
        assert health["status"] == "ok" and health["role"] == w.role
        assert health["id"] == w.name
        info = requests.get(w.url + "/get_server_info", timeout=10).json()
        assert (info["id"], info["incarnation"]) == (health["id"], health["incarnation"])
        assert info["transfer_backend"] == "nixl" and isinstance(info["protocol_version"], int)
        assert info["model_fingerprint"].startswith("LlamaForCausalLM:")
        assert info["bootstrap_port"] == (w.bootstrap_port if w.role == "prefill" else None)
        seen.add(health["incarnation"])
    assert len(seen) == 3  # each process start its own
    listed = {(w["url"], w["id"]) for w in router_workers(router)}
    assert listed == {(p1.url, p1.name), (d1.url, d1.name)}


def test_post_workers_adds_a_worker_that_then_gets_legs(workers, router):
    p1, d1, p2 = workers
    bad = [({"url": p2.url}, 400), ({"url": "http://user@127.0.0.1:1", "worker_type": "prefill"}, 400),
           ({"url": p2.url + "/path", "worker_type": "prefill"}, 400),
           ({"url": d1.url, "worker_type": "decode", "bootstrap_port": 9}, 400),
           ({"url": p2.url, "worker_type": "prefill", "surprise": 1}, 400),
           ({"url": p1.url, "worker_type": "prefill", "bootstrap_port": p1.bootstrap_port}, 409),  # in the set
           ({"url": p2.url, "worker_type": "prefill", "bootstrap_port": p2.bootstrap_port, "id": "someone-else"}, 409),
           ({"url": p2.url, "worker_type": "decode"}, 409),  # it says it is a prefill worker
           ({"url": "http://127.0.0.1:9", "worker_type": "decode"}, 502)]
    for body, status in bad:
        r = requests.post(router.url + "/workers", json=body, timeout=30)
        assert r.status_code == status, (body, r.status_code, r.text)
        assert r.json()["error"]["message"]
    before = finished(p2)
    r = requests.post(router.url + "/workers", json={"url": p2.url, "worker_type": "prefill",
                                                     "bootstrap_port": p2.bootstrap_port}, timeout=30)
    assert r.status_code == 202, r.text
    assert r.json()["worker_id"] == p2.name
    wait_for("the new prefill worker in rotation",
             lambda: [w for w in router_workers(router) if w["url"] == p2.url and w["state"] == "healthy"], 60)
    for i in range(6):  # round robin: every other request goes to the new worker
        generate(router.url, [5, 6, 7, i], max_new_tokens=4)
    assert finished(p2) - before >= 2


def test_delete_drains_a_worker_then_it_gets_no_leg(workers, router):
    p1, _, _ = workers
    assert requests.delete(router.url + "/workers/nobody", timeout=10).status_code == 404
    streams = []  # streams in flight through p1 when it starts draining finish whole
    results: list = []

    def stream():
        try:
            results.append(generate(router.url, [9, 9, 9], max_new_tokens=24, stream=True))
        except AssertionError as exc:
            results.append(exc)

    for _ in range(4):
        streams.append(threading.Thread(target=stream))
        streams[-1].start()
    r = requests.delete(router.url + f"/workers/{p1.name}", timeout=10)
    assert r.status_code == 202 and r.json()["status"] == "draining", r.text
    before = finished(p1)
    for i in range(4):
        generate(router.url, [1, 2, i], max_new_tokens=4)
    for t in streams:
        t.join(120)
    assert len(results) == 4 and all(isinstance(x, list) for x in results), results
    wait_for("the drained worker gone", lambda: all(w["url"] != p1.url for w in router_workers(router)), 60)
    time.sleep(0.5)
    assert finished(p1) - before <= 4  # only streams that were already routed to it before the delete
    after = finished(p1)
    for i in range(4):
        generate(router.url, [3, 2, i], max_new_tokens=4)
    assert finished(p1) == after


class _Impostor(BaseHTTPRequestHandler):
    """Answers ``/health`` 200 as another worker (or as none), counts every POST."""

    identity: dict = {"id": "someone-else", "incarnation": "abc123"}
    posts = 0
    checks = 0

    def do_GET(self):
        type(self).checks += 1
        body = json.dumps({"status": "ok", **type(self).identity}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        type(self).posts += 1
        self.send_response(500)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_foreign_process_on_a_worker_s_port_is_never_taken_for_it(etcd_cluster, workers, router):
    """p2 stops; another process answers on its port as another worker, then as none: the router
    takes p2 out of rotation and sends the impostor nothing (and, p1 removed, has no prefill)."""
    p2 = workers[2]
    etcd_cluster.stop("p2")
    assert p2.proc.returncode == 0, p2.output_tail()
    ThreadingHTTPServer.allow_reuse_address = True
    server = ThreadingHTTPServer(("127.0.0.1", p2.port), _Impostor)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for identity, why in (({"id": "someone-else", "incarnation": "abc123"}, "another process answers"),
                              ({}, "without a worker identity")):
            _Impostor.identity = identity
            checks = _Impostor.checks
            wait_for("three health checks answered by the impostor", lambda: _Impostor.checks >= checks + 3, 60)
            view = [w for w in router_workers(router) if w["url"] == p2.url][0]
            assert view["state"] == "unhealthy" and why in view["error"], view
            for i in range(3):
                r = requests.post(router.url + "/generate", json={"input_ids": [1, i], "sampling_params":
                                                                  {"max_new_tokens": 2}}, timeout=30)
                assert r.status_code == 503, r.text
        assert _Impostor.posts == 0
        health = requests.get(router.url + "/health", timeout=10).json()
        assert health["status"] == "unavailable"
    finally:
        server.shutdown()
        server.server_close()
