"""Worker identity and the router's membership API (issue 19, parts 1 and 3), on real processes:
one prefill and two decode workers, and a router that starts knowing one decode worker. The tests
share that cluster and run in order: identity, ``POST /workers``, ``DELETE /workers/{id}``, a
foreign process on a removed worker's port. Requests are counted, never timed."""

from __future__ import annotations

import json
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from cluster import Cluster, RouterProcess, generate, metric_sum, metrics

ROUTER_ARGS = ("--health-interval-s", "0.5", "--health-failures", "1")


@pytest.fixture(scope="module")
def cluster():
    with Cluster(prefill=1, decode=2, router=False) as c:
        p = c.prefill[0]
        c.router = RouterProcess([(p.url, p.bootstrap_port)], [c.decode[0].url], *ROUTER_ARGS).start()
        yield c


def finished(worker) -> float:
    return metric_sum(metrics(worker), "splitserve_requests_total", outcome="finished")


def router_workers(c) -> list[dict]:
    return requests.get(c.url + "/workers", timeout=10).json()["workers"]


def wait_for(what: str, check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout:g} s: {what}")


def test_every_worker_reports_its_identity(cluster):
    seen = set()
    for w in cluster.workers:
        health = requests.get(w.url + "/health", timeout=10).json()
        assert health["status"] == "ok" and health["role"] == w.role
        assert health["id"] == f"{w.role}@127.0.0.1:{w.port}"
        info = requests.get(w.url + "/get_server_info", timeout=10).json()
        assert (info["id"], info["incarnation"]) == (health["id"], health["incarnation"])
        assert info["transfer_backend"] == "nixl" and isinstance(info["protocol_version"], int)
        assert info["model_fingerprint"].startswith("LlamaForCausalLM:")
        assert info["bootstrap_port"] == (w.bootstrap_port if w.role == "prefill" else None)
        seen.add(health["incarnation"])
    assert len(seen) == 3  # each process start its own
    listed = {(w["url"], w["id"]) for w in router_workers(cluster)}
    assert listed == {(w.url, f"{w.role}@127.0.0.1:{w.port}") for w in (cluster.prefill[0], cluster.decode[0])}


def test_post_workers_adds_a_worker_that_then_gets_legs(cluster):
    d0, d1 = cluster.decode
    bad = [({"url": d1.url}, 400), ({"url": "http://user@127.0.0.1:1", "worker_type": "decode"}, 400),
           ({"url": d1.url + "/path", "worker_type": "decode"}, 400),
           ({"url": d1.url, "worker_type": "decode", "bootstrap_port": 9}, 400),
           ({"url": d1.url, "worker_type": "decode", "surprise": 1}, 400),
           ({"url": d0.url, "worker_type": "decode"}, 409),  # already in the set
           ({"url": d1.url, "worker_type": "decode", "id": "someone-else"}, 409),
           ({"url": d1.url, "worker_type": "prefill"}, 409),  # it says it is a decode worker
           ({"url": "http://127.0.0.1:9", "worker_type": "decode"}, 502)]
    for body, status in bad:
        r = requests.post(cluster.url + "/workers", json=body, timeout=30)
        assert r.status_code == status, (body, r.status_code, r.text)
        assert r.json()["error"]["message"]
    before = finished(d1)
    r = requests.post(cluster.url + "/workers", json={"url": d1.url, "worker_type": "decode"}, timeout=30)
    assert r.status_code == 202, r.text
    assert r.json()["worker_id"] == f"decode@127.0.0.1:{d1.port}"
    wait_for("the new decode worker in rotation",
             lambda: [w for w in router_workers(cluster) if w["url"] == d1.url and w["state"] == "healthy"])
    for i in range(6):  # round robin: every other request goes to the new worker
        generate(cluster.url, [5, 6, 7, i], max_new_tokens=4)
    assert finished(d1) - before >= 2


def test_delete_drains_a_worker_then_it_gets_no_leg(cluster):
    d0, d1 = cluster.decode
    assert requests.delete(cluster.url + "/workers/nobody", timeout=10).status_code == 404
    wid = f"decode@127.0.0.1:{d0.port}"
    streams = []  # streams in flight through d0 when it starts draining finish whole
    results: list = []

    def stream():
        try:
            results.append(generate(cluster.url, [9, 9, 9], max_new_tokens=24, stream=True))
        except AssertionError as exc:
            results.append(exc)

    for _ in range(4):
        streams.append(threading.Thread(target=stream))
        streams[-1].start()
    r = requests.delete(cluster.url + f"/workers/{wid}", timeout=10)
    assert r.status_code == 202 and r.json()["status"] == "draining", r.text
    before = finished(d0)
    for i in range(4):
        generate(cluster.url, [1, 2, i], max_new_tokens=4)
    for t in streams:
        t.join(120)
    assert len(results) == 4 and all(isinstance(x, list) for x in results), results
    wait_for("the drained worker gone", lambda: all(w["url"] != d0.url for w in router_workers(cluster)))
    time.sleep(0.5)
    assert finished(d0) - before <= 4  # only streams that were already routed to it before the delete
    after = finished(d0)
    for i in range(4):
        generate(cluster.url, [3, 2, i], max_new_tokens=4)
    assert finished(d0) == after


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


def test_a_foreign_process_on_a_worker_s_port_is_never_taken_for_it(cluster):
    """d1 stops; another process answers on its port as another worker, then as none: the router
    takes d1 out of rotation and sends the impostor nothing."""
    d1 = cluster.decode[1]
    d1.send_signal(signal.SIGTERM)
    assert d1.proc.wait(60) == 0
    ThreadingHTTPServer.allow_reuse_address = True
    server = ThreadingHTTPServer(("127.0.0.1", d1.port), _Impostor)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for identity, why in (({"id": "someone-else", "incarnation": "abc123"}, "another process answers"),
                              ({}, "without a worker identity")):
            _Impostor.identity = identity
            checks = _Impostor.checks
            wait_for("two health checks answered by the impostor", lambda: _Impostor.checks >= checks + 2)
            view = [w for w in router_workers(cluster) if w["url"] == d1.url][0]
            assert view["state"] == "unhealthy" and why in view["error"], view
            for i in range(3):
                r = requests.post(cluster.url + "/generate", json={"input_ids": [1, i], "sampling_params":
                                                                   {"max_new_tokens": 2}}, timeout=30)
                assert r.status_code == 503, r.text
        assert _Impostor.posts == 0
        health = requests.get(cluster.url + "/health", timeout=10).json()
        assert health["status"] == "unavailable"
    finally:
        server.shutdown()
        server.server_close()
