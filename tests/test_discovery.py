"""Discovery through a real etcd, on real processes: workers register with ``--discovery`` and a
router with ``--discovery`` and no static worker finds them. The etcd and the workers are the
session's (``tests/etcd_cluster.py``, shared with ``test_membership.py``); one router is shared by
this file's tests, which run in order: the first pair, records that are no records, scale-up under
load, a rolling restart of 2 prefill + 2 decode under load (the router's retries before the commit
too; ``long``), a ``kill -9`` under load, two fingerprints, etcd stopped under load (``long``). The
router does not retry (``--max-retries 0 --no-pd-fallback``): what it shows is discovery's own
contract. Requests are counted, never timed."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from cluster import RouterProcess, pages_back_to_total
from conftest import CACHE_DIR, CLUSTER_SECRET
from etcd_cluster import Load, finished, listed, routable
from helpers.waiting import wait_for

ROUTER_ARGS = ("--health-interval-s", "0.5", "--health-failures", "2", "--cluster-secret-file", CLUSTER_SECRET)
"""The router holds the workers' cluster secret: it uses only sealed records, and workers that prove themselves."""
NO_RETRIES = ("--max-retries", "0", "--no-pd-fallback")


@pytest.fixture(scope="module")
def router(etcd_cluster):
    router = RouterProcess([], [], "--discovery", etcd_cluster.etcd.url(), *ROUTER_ARGS, *NO_RETRIES,
                           wait_healthy=False)
    try:
        yield router.start()
    finally:
        router.stop()


def running(c) -> set[str]:
    """The ids of the session's workers that are running."""
    return {p.name for p in c.procs.values() if p.proc.poll() is None}


def test_workers_registered_in_etcd_are_served(etcd_cluster, router):
    p1, d1 = etcd_cluster.ensure("p1", "d1")
    wait_for("the router ready", lambda: requests.get(router.url + "/health", timeout=5).status_code == 200, 90)
    wait_for("every running worker found", lambda: set(routable(router)) == running(etcd_cluster), 90)
    seen = routable(router)
    assert {p1.name, d1.name} <= set(seen) and all(w["source"] == "discovery" for w in seen.values()), seen
    for proc in (p1, d1):
        health = requests.get(proc.url + "/health", timeout=5).json()
        assert seen[proc.name]["incarnation"] == health["incarnation"]
    r = requests.post(router.url + "/generate", json={"input_ids": [1, 2, 3],
                                                      "sampling_params": {"max_new_tokens": 4}}, timeout=60)
    assert r.status_code == 200, r.text


def test_static_workers_serve_beside_discovery(etcd_cluster, router):
    """A router given p1 on its command line and --discovery: p1 is served once (its record is left
    alone), d1 comes from etcd."""
    p1, d1 = etcd_cluster.ensure("p1", "d1")
    other = RouterProcess([(p1.url, p1.bootstrap_port)], [], "--discovery", etcd_cluster.etcd.url(), *ROUTER_ARGS,
                          wait_healthy=False).start()
    try:
        wait_for("the second router ready",
                 lambda: requests.get(other.url + "/health", timeout=5).status_code == 200, 90)
        seen = {w["id"]: w["source"] for w in listed(other)}
        assert seen[p1.name] == "static" and seen[d1.name] == "discovery", seen
        assert len(seen) == len(running(etcd_cluster)), seen
        r = requests.post(other.url + "/generate", json={"input_ids": [4, 5], "sampling_params":
                                                         {"max_new_tokens": 2}}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        other.stop()


def test_values_under_the_prefix_that_are_no_records_are_ignored(etcd_cluster, router):
    p1, d1 = etcd_cluster.ensure("p1", "d1")
    e = etcd_cluster.etcd.client()
    sealed = json.loads(e.get(f"/splitserve/workers/{d1.name}")[0])
    good = sealed["record"]
    bad = {"/splitserve/workers/junk": "not json",
           "/splitserve/workers/unsigned": json.dumps({**good, "id": "unsigned"}),
           "/splitserve/workers/forged": json.dumps({**sealed, "record": {**good, "id": "forged"}}),
           "/splitserve/workers/evil": json.dumps({**good, "id": "evil", "url": "http://user@10.0.0.1:1"}),
           "/splitserve/workers/other": json.dumps({**good, "id": "not-other"}),  # key and id differ
           "/splitserve/workers/extra": json.dumps({**good, "id": "extra", "surprise": True}),
           "/splitserve/workers/port": json.dumps({**good, "id": "port", "role": "prefill", "bootstrap_port": 0})}
    invalid = router.metric("splitserve_router_discovery_records_invalid_total")
    for key, value in bad.items():
        e.put(key, value)
    try:
        wait_for("every bad value counted", lambda: router.metric(
            "splitserve_router_discovery_records_invalid_total") >= invalid + len(bad), 90)
        assert set(w["id"] for w in listed(router)) == running(etcd_cluster)
        r = requests.post(router.url + "/generate", json={"input_ids": [1, 2],
                                                          "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        for key in bad:
            e.delete(key)


def test_a_worker_started_under_load_gets_legs(etcd_cluster, router):
    """A decode and a prefill worker started (together: they load in parallel) under streaming load
    each get legs once found."""
    etcd_cluster.ensure("p1", "d1")
    with Load(router.url) as load:
        load.wait_done(4)
        started = [etcd_cluster.spawn(name) for name in ("d2", "p2")]
        for proc in started:
            proc.wait_ready()
        for proc in started:
            wait_for(f"{proc.name} serving routed requests", lambda: finished(proc) > 0, 90)
    assert not load.failures, load.failures[:3]
    assert set(routable(router)) >= {p.name for p in etcd_cluster.procs.values()}


def retries(router: RouterProcess) -> dict[str, float]:
    """``role:cause`` -> the router's retries of that role's legs for that cause."""
    return {dict(labels)["role"] + ":" + dict(labels)["cause"]: v for (name, labels), v in router.metrics().items()
            if name == "splitserve_router_retries_total" and v}


def attempts(router: RouterProcess, rids: list[str]) -> list[list[dict]]:
    """Each request's attempts, from the router's records (asked in parallel)."""
    def one(rid: str) -> list[dict]:
        r = requests.get(f"{router.url}/debug/requests/{rid}", timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["router"]["attempts"]

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, rids))


@pytest.mark.long  # four workers restarted one at a time, each a model load: most of this file's time
def test_a_rolling_restart_under_load_fails_no_request_and_leaks_no_page(etcd_cluster, router):
    """A rolling restart checks both the router's retries before the commit (each with a fresh room)
    and discovery's drain contract: one test for both.

    Each of 2 prefill + 2 decode workers, one at a time, is SIGTERMed and started again on other
    ports (a new incarnation of the same id, loading while the old one drains), under steady
    streaming load through two routers at once:

    - this file's discovery router, which does not retry: no request fails, because a worker told
      to stop revokes its lease first (the router sends it no new leg), then serves what it has;
      the router finds the new incarnation at its new address;
    - a static router given the four by URL and id, which keeps each in rotation whatever its health
      checks say (``--health-failures`` beyond any count here): it sends legs to each worker as it
      drains and once it is gone, and no request fails because every such leg is tried again on
      another worker with a new room. Once the new incarnation is up it is told as an operator
      tells it (``DELETE /workers/ID``, ``POST /workers``).

    Then: no request failed through either router; the static router retried legs of both roles
    (waited for while each worker stopped), counted by cause, as many as its records hold failed
    attempts; no room served two attempts, of any request of either router; both routers list the
    four new incarnations only; every worker's pages are back to total."""
    c = etcd_cluster
    names = ("p1", "d1", "p2", "d2")
    procs = c.ensure(*names)
    pinned = ["--health-interval-s", "0.5", "--health-failures", "1000000", "--retry-budget-min", "1000000"]
    for p in procs:
        pinned += ["--prefill", p.url, str(p.bootstrap_port)] if p.role == "prefill" else ["--decode", p.url]
        pinned.append(f"id={p.name}")
    static = RouterProcess([], [], *pinned).start()

    def role_retries(role: str) -> float:
        return sum(v for k, v in retries(static).items() if k.startswith(role + ":"))

    try:
        # one client thread per router: the load is steady, and leaves the CPUs to the workers' starts
        with Load(router.url, threads=1, tag="found") as found, \
                Load(static.url, threads=1, tag="pinned") as pinned_load:
            found.wait_done(2)
            pinned_load.wait_done(2)
            for name in names:
                old = c.procs[name]
                before, retried = routable(router)[name]["incarnation"], role_retries(old.role)
                old.send_signal(signal.SIGTERM)
                new = c.spawn(name)
                wait_for(f"the static router retrying {name}'s legs elsewhere",
                         lambda: role_retries(old.role) > retried, 90)
                new.wait_ready()
                incarnation = requests.get(new.url + "/health", timeout=10).json()["incarnation"]
                assert incarnation != before
                wait_for(f"{name}'s new incarnation in rotation at its new address",
                         lambda: routable(router).get(name, {}).get("url") == new.url, 90)
                assert routable(router)[name]["incarnation"] == incarnation
                assert requests.delete(f"{static.url}/workers/{name}", timeout=10).status_code == 202
                added = {"url": new.url, "worker_type": new.role, "id": name,
                         **({"bootstrap_port": new.bootstrap_port} if new.role == "prefill" else {})}
                r = requests.post(static.url + "/workers", json=added, timeout=30)
                assert r.status_code == 202, r.text
                wait_for(f"{name}'s new incarnation in the static router's rotation",
                         lambda: routable(static).get(name, {}).get("url") == new.url, 90)
                assert old.proc.wait(120) == 0, old.output_tail()
                old.stop()
                found.wait_done(2)
                pinned_load.wait_done(2)
        assert not found.failures, found.failures[:3]
        assert not pinned_load.failures, pinned_load.failures[:3]
        now = {p.name: p.url for p in c.procs.values() if p.name in names}
        wait_for("the old incarnations gone from both routers",
                 lambda: all({w["id"]: w["url"] for w in listed(r)} == now for r in (router, static)), 90)
        counted = retries(static)
        assert {k.split(":")[0] for k in counted} == {"prefill", "decode"}, counted
        assert {k.split(":")[1] for k in counted} <= {"unavailable", "unreachable", "gone"}, counted
        pinned_attempts = attempts(static, pinned_load.rids)
        assert sum(len(a) - 1 for a in pinned_attempts) == sum(counted.values()), counted
        assert all(all(x["failed"] for x in a[:-1]) and a[-1]["failed"] is None for a in pinned_attempts)
        rooms = [x["room"] for a in pinned_attempts + attempts(router, found.rids) for x in a]
        assert len(set(rooms)) == len(rooms) == len(found.rids) + len(pinned_load.rids) + sum(counted.values())
    finally:
        static.stop()
    for proc in c.procs.values():
        pages_back_to_total(proc)


def test_a_worker_killed_is_out_of_rotation_and_gets_nothing_after(etcd_cluster, router):
    etcd_cluster.ensure("p1", "d1", "d2")
    with Load(router.url) as load:
        load.wait_done(2)
        victim = etcd_cluster.procs.pop("d2")
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        wait_for("d2 out of the set (its lease expired)", lambda: victim.name not in {w["id"] for w in listed(router)},
                 60)
        failed_before = len(load.failures)  # only requests that were on d2 when it died may fail
        load.wait_done(8)
        assert len(load.failures) == failed_before, load.failures[failed_before:][:3]
    victim.stop()
    series = [labels for name, labels in router.metrics() if name.startswith("splitserve_router_worker_")]
    assert series and not [ls for ls in series if ("url", victim.url) in ls]  # its series went with it


UPGRADED = ("pb", "db")


def test_two_fingerprints_under_one_name_are_never_paired_across(etcd_cluster, router):
    """A rolling upgrade's middle: workers of another checkpoint (other weights: the tiny model of
    another seed, built once into the tests' cache), served under the same name, beside the ones
    there: every request is served by a pair of one fingerprint (a crossed pair would fail its
    handshake), and the router counts the pairings it refused."""
    from splitserve.testing.tiny import tiny_model_path

    c = etcd_cluster
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPLITSERVE_CACHE", str(CACHE_DIR))
        other = str(tiny_model_path(seed=7))
    c.ensure("p1", "d1")
    procs = [c.spawn(name, "--served-model-name", "tiny", model=other) for name in UPGRADED]
    for p in procs:
        p.wait_ready()
    wait_for("pb and db in rotation", lambda: {"pb", "db"} <= set(routable(router)), 90)
    fingerprints = {w["id"]: w["model_fingerprint"] for w in listed(router)}
    p1, d1 = c.procs["p1"].name, c.procs["d1"].name
    assert fingerprints["pb"] == fingerprints["db"] != fingerprints[p1] == fingerprints[d1], fingerprints
    old = [p for n, p in c.procs.items() if n not in UPGRADED and p.proc.poll() is None]
    before = {p.name: finished(p) for p in old + procs}
    refused = router.metric("splitserve_router_pairings_refused_total")
    for i in range(12):
        r = requests.post(router.url + "/generate", json={"input_ids": [7, i], "sampling_params":
                                                          {"max_new_tokens": 3}}, timeout=60)
        assert r.status_code == 200, r.text
    served = {p.name: finished(p) - before[p.name] for p in old + procs}
    new_pairs = served["pb"]
    assert new_pairs == served["db"] > 0, served  # pb's requests all went to db, and only they
    assert sum(served[p.name] for p in old if p.role == "prefill") == \
        sum(served[p.name] for p in old if p.role == "decode") == 12 - new_pairs, served
    assert router.metric("splitserve_router_pairings_refused_total") > refused
    c.stop(*UPGRADED)
    wait_for("pb and db gone", lambda: not {"pb", "db"} & {w["id"] for w in listed(router)}, 90)


@pytest.mark.long
def test_etcd_stopped_under_load_fails_no_request_and_a_worker_started_meanwhile_joins(etcd_cluster, router):
    c, etcd = etcd_cluster, etcd_cluster.etcd
    c.ensure("p1", "d1")
    wait_for("the router ready", lambda: requests.get(router.url + "/health", timeout=5).status_code == 200, 90)
    with Load(router.url) as load:
        load.wait_done(2)
        known = {w["id"] for w in listed(router)}
        etcd.stop()
        wait_for("the outage shown", lambda: router.metric("splitserve_router_discovery_outage") == 1, 90)
        d3 = c.spawn("d3")
        d3.wait_ready()
        load.wait_done(10)
        assert {w["id"] for w in listed(router)} == known  # the workers known are kept, d3 not yet found
        etcd.start()
        wait_for("d3 serving routed requests", lambda: finished(d3) > 0, 90)
        assert router.metric("splitserve_router_discovery_outage") == 0
    assert not load.failures, load.failures[:3]
    assert router.metric("splitserve_router_discovery_errors_total") >= 1
