"""Discovery through a real etcd (issue 19, part 2), on real processes: workers register with
``--discovery`` and a router with ``--discovery`` and no static worker finds them. One etcd, one
router and the workers are shared by the tests, which run in order: the first pair, records that
are no records, scale-up under load, a rolling restart of 2 prefill + 2 decode under load, a
``kill -9`` under load, etcd stopped under load (``long``). Requests are counted, never timed."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import requests

from cluster import RouterProcess, metric_sum, metrics, pages_back_to_total, sse_events
from conftest import ServerProcess, free_port
from etcd_server import EtcdServer, have_etcd

IN_CI = os.environ.get("CI") == "true"


@pytest.fixture(scope="module")
def etcd():
    if not have_etcd():  # under CI=true a missing etcd fails: .ci/run installs it
        message = "etcd is not installed (apt-get install etcd-server; .ci/run does)"
        pytest.fail(message) if IN_CI else pytest.skip(message)
    with EtcdServer() as server:
        yield server


TTL_S = "6"  # short for the tests, long enough that a loaded machine keeps a live worker's lease
ROUTER_ARGS = ("--health-interval-s", "0.5", "--health-failures", "2")


class Workers:
    """The workers of the test cluster, by name (``p1`` ...); each registers in etcd as that id."""

    def __init__(self, etcd: EtcdServer):
        self.etcd = etcd
        self.procs: dict[str, ServerProcess] = {}

    def spawn(self, name: str, *extra: str, model: str = "tiny") -> ServerProcess:
        role = "prefill" if name.startswith("p") else "decode"
        args = ["--role", role, "--worker-id", name, "--discovery", self.etcd.url(), "--discovery-ttl-s", TTL_S,
                "--discovery-grace-s", "2", *extra]
        bootstrap = free_port() if role == "prefill" else None
        if bootstrap is not None:
            args += ["--bootstrap-port", str(bootstrap)]
        proc = ServerProcess(*args, model=model)
        proc.name, proc.role, proc.bootstrap_port = name, role, bootstrap
        proc.spawn()
        self.procs[name] = proc
        return proc

    def start(self, *names: str) -> None:
        procs = [self.spawn(n) for n in names]  # they load in parallel
        for p in procs:
            p.wait_ready()

    def ensure(self, *names: str) -> None:
        """Those of ``names`` not running now, started (a test run alone, ``-m long``, starts here)."""
        self.start(*[n for n in names if n not in self.procs or self.procs[n].proc.poll() is not None])

    def stop_all(self) -> None:
        for p in self.procs.values():
            p.stop(timeout=15)


@pytest.fixture(scope="module")
def cluster(etcd):
    workers = Workers(etcd)
    router = RouterProcess([], [], "--discovery", etcd.url(), *ROUTER_ARGS, wait_healthy=False)
    try:
        router.start()
        workers.router = router
        yield workers
    finally:
        router.stop()
        workers.stop_all()


def listed(c) -> list[dict]:
    return requests.get(c.router.url + "/workers", timeout=10).json()["workers"]


def routable(c) -> dict[str, dict]:
    return {w["id"]: w for w in listed(c) if w["state"] == "healthy"}


def wait_for(what: str, check, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout:g} s: {what}")


def finished(proc) -> float:
    return metric_sum(metrics(proc), "splitserve_requests_total", outcome="finished")


class Load:
    """Steady streaming ``/generate`` through the router from ``threads`` threads, each request after
    the last; every failure kept (status, body)."""

    def __init__(self, url: str, threads: int = 2, max_new_tokens: int = 8):
        self.url, self.max_new_tokens = url, max_new_tokens
        self.done = 0
        self.failures: list = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(180)

    def _run(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            body = {"input_ids": [3, 1, 4, i, n % 50], "stream": True,
                    "sampling_params": {"max_new_tokens": self.max_new_tokens}}
            try:
                r = requests.post(self.url + "/generate", json=body, timeout=120)
                events = sse_events(r.text) if r.status_code == 200 else []
                if r.status_code != 200 or not events or events[-1] != "[DONE]" or \
                        any(isinstance(e, dict) and "error" in e for e in events):
                    self.failures.append((r.status_code, r.text[-500:]))
            except requests.RequestException as exc:
                self.failures.append((0, repr(exc)))
            self.done += 1

    def wait_done(self, more: int, timeout: float = 120.0) -> None:
        target = self.done + more
        wait_for(f"{more} more requests through the router", lambda: self.done >= target, timeout)


def test_workers_registered_in_etcd_are_served(cluster, etcd):
    cluster.start("p1", "d1")
    wait_for("the router ready", lambda: requests.get(cluster.router.url + "/health", timeout=5).status_code == 200)
    seen = routable(cluster)
    assert set(seen) == {"p1", "d1"} and all(w["source"] == "discovery" for w in seen.values()), seen
    for name in ("p1", "d1"):
        health = requests.get(cluster.procs[name].url + "/health", timeout=5).json()
        assert seen[name]["incarnation"] == health["incarnation"]
    r = requests.post(cluster.router.url + "/generate", json={"input_ids": [1, 2, 3],
                                                              "sampling_params": {"max_new_tokens": 4}}, timeout=60)
    assert r.status_code == 200, r.text


def test_static_workers_serve_beside_discovery(cluster, etcd):
    """A router given p1 on its command line and --discovery: p1 is served once (its record is left
    alone), d1 comes from etcd."""
    p1 = cluster.procs["p1"]
    router = RouterProcess([(p1.url, p1.bootstrap_port)], [], "--discovery", etcd.url(), *ROUTER_ARGS,
                           wait_healthy=False).start()
    try:
        wait_for("the second router ready", lambda: requests.get(router.url + "/health", timeout=5).status_code == 200)
        seen = {w["id"]: w["source"] for w in requests.get(router.url + "/workers", timeout=10).json()["workers"]}
        assert seen == {"p1": "static", "d1": "discovery"}, seen
        r = requests.post(router.url + "/generate", json={"input_ids": [4, 5], "sampling_params":
                                                          {"max_new_tokens": 2}}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        router.stop()


def test_values_under_the_prefix_that_are_no_records_are_ignored(cluster, etcd):
    e = etcd.client()
    good = json.loads(e.get("/splitserve/workers/d1")[0])
    bad = {"/splitserve/workers/junk": "not json",
           "/splitserve/workers/evil": json.dumps({**good, "id": "evil", "url": "http://user@10.0.0.1:1"}),
           "/splitserve/workers/other": json.dumps({**good, "id": "not-other"}),  # key and id differ
           "/splitserve/workers/extra": json.dumps({**good, "id": "extra", "surprise": True}),
           "/splitserve/workers/port": json.dumps({**good, "id": "port", "role": "prefill", "bootstrap_port": 0})}
    for key, value in bad.items():
        e.put(key, value)
    try:
        wait_for("every bad value counted", lambda: cluster.router.metric(
            "splitserve_router_discovery_records_invalid_total") >= len(bad))
        assert set(w["id"] for w in listed(cluster)) == {"p1", "d1"}
        r = requests.post(cluster.router.url + "/generate", json={"input_ids": [1, 2],
                                                                  "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        for key in bad:
            e.delete(key)


def test_a_worker_started_under_load_gets_legs(cluster):
    with Load(cluster.router.url) as load:
        load.wait_done(4)
        d2 = cluster.spawn("d2")
        d2.wait_ready()
        wait_for("d2 serving routed requests", lambda: finished(d2) > 0)
        p2 = cluster.spawn("p2")  # prefill likewise
        p2.wait_ready()
        wait_for("p2 serving routed requests", lambda: finished(p2) > 0)
    assert not load.failures, load.failures[:3]
    assert set(routable(cluster)) == {"p1", "p2", "d1", "d2"}


def test_a_rolling_restart_under_load_fails_no_request_and_leaks_no_page(cluster):
    """Each of 2 prefill + 2 decode workers SIGTERMed and started again on another port (a new
    incarnation of the same id), one at a time, under steady streaming load."""
    with Load(cluster.router.url) as load:
        for name in ("p1", "d1", "p2", "d2"):
            old = cluster.procs[name]
            before = routable(cluster)[name]["incarnation"]
            old.send_signal(signal.SIGTERM)
            assert old.proc.wait(120) == 0, old.output_tail()
            new = cluster.spawn(name)
            new.wait_ready()
            wait_for(f"{name}'s new incarnation in rotation", lambda: (w := routable(cluster).get(name)) is not None
                     and w["incarnation"] != before and w["url"] == new.url)
            load.wait_done(4)
    assert not load.failures, load.failures[:3]
    assert len(listed(cluster)) == 4  # the old incarnations are gone
    for proc in cluster.procs.values():
        pages_back_to_total(proc)


def test_a_worker_killed_is_out_of_rotation_and_gets_nothing_after(cluster):
    with Load(cluster.router.url) as load:
        load.wait_done(2)
        victim = cluster.procs["d2"]
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        wait_for("d2 out of the set (its lease expired)", lambda: "d2" not in {w["id"] for w in listed(cluster)}, 60)
        failed_before = len(load.failures)  # only requests that were on d2 when it died may fail
        load.wait_done(8)
        assert len(load.failures) == failed_before, load.failures[failed_before:][:3]
    del cluster.procs["d2"]
    series = [labels for name, labels in cluster.router.metrics() if name.startswith("splitserve_router_worker_")]
    assert series and not [ls for ls in series if ("url", victim.url) in ls]  # its series went with it


def test_two_fingerprints_under_one_name_are_never_paired_across(cluster, tmp_path_factory):
    """A rolling upgrade's middle: workers of another checkpoint (other weights), served under the
    same name, beside the ones there: every request is served by a pair of one fingerprint (a
    crossed pair would fail its handshake), and the router counts the pairings it refused."""
    from splitserve.testing.tiny import build_tiny_model

    other = str(build_tiny_model(tmp_path_factory.mktemp("other-weights"), seed=7))
    cluster.ensure("p1", "d1")
    procs = [cluster.spawn(name, "--served-model-name", "tiny", model=other) for name in ("pb", "db")]
    for p in procs:
        p.wait_ready()
    wait_for("pb and db in rotation", lambda: {"pb", "db"} <= set(routable(cluster)))
    fingerprints = {w["id"]: w["model_fingerprint"] for w in listed(cluster)}
    assert fingerprints["pb"] == fingerprints["db"] != fingerprints["p1"] == fingerprints["d1"], fingerprints
    old = [p for n, p in cluster.procs.items() if n not in ("pb", "db")]
    before = {p.name: finished(p) for p in cluster.procs.values()}
    refused = cluster.router.metric("splitserve_router_pairings_refused_total")
    for i in range(12):
        r = requests.post(cluster.router.url + "/generate", json={"input_ids": [7, i], "sampling_params":
                                                                  {"max_new_tokens": 3}}, timeout=60)
        assert r.status_code == 200, r.text
    served = {name: finished(p) - before[name] for name, p in cluster.procs.items()}
    new_pairs = served["pb"]
    assert new_pairs == served["db"] > 0, served  # pb's requests all went to db, and only they
    assert sum(served[p.name] for p in old if p.role == "prefill") == \
        sum(served[p.name] for p in old if p.role == "decode") == 12 - new_pairs, served
    assert cluster.router.metric("splitserve_router_pairings_refused_total") > refused
    for p in procs:
        p.stop(timeout=30)
        del cluster.procs[p.name]
    wait_for("pb and db gone", lambda: not {"pb", "db"} & {w["id"] for w in listed(cluster)})


@pytest.mark.long
def test_etcd_stopped_under_load_fails_no_request_and_a_worker_started_meanwhile_joins(cluster, etcd):
    cluster.ensure("p1", "d1")
    wait_for("the router ready", lambda: requests.get(cluster.router.url + "/health", timeout=5).status_code == 200)
    with Load(cluster.router.url) as load:
        load.wait_done(2)
        known = {w["id"] for w in listed(cluster)}
        etcd.stop()
        wait_for("the outage shown", lambda: cluster.router.metric("splitserve_router_discovery_outage") == 1)
        d3 = cluster.spawn("d3")
        d3.wait_ready()
        load.wait_done(10)
        assert {w["id"] for w in listed(cluster)} == known  # the workers known are kept, d3 not yet found
        etcd.start()
        wait_for("d3 serving routed requests", lambda: finished(d3) > 0)
        assert cluster.router.metric("splitserve_router_discovery_outage") == 0
    assert not load.failures, load.failures[:3]
    assert cluster.router.metric("splitserve_router_discovery_errors_total") >= 1
