"""One real etcd and the workers registered in it, shared by ``test_discovery.py`` and
``test_membership.py`` (the session fixture ``etcd_cluster`` of ``conftest.py``): the model loads
are what those tests cost, so workers started by one test are used by the next.

- Workers are named ``p1``, ``d1`` ... (``p``: prefill, else decode); each registers in etcd with
  ``--discovery`` as ``--worker-id NAME`` (``worker.name``), so one started again under its name,
  on any port, is a new incarnation of the same worker.
- :meth:`EtcdCluster.ensure` starts the named workers not running (so a test run alone, or a file
  run alone, finds what it needs); workers load in parallel.
- :class:`Load`: steady streaming ``/generate`` through a router, every failure kept, every
  request's rid kept (for the router's records), the load of ``test_role_switch.py`` too;
  :func:`wait_for` polls a condition, counting nothing but whether it came.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable, Optional

import pytest
import requests

from cluster import metric_sum, metrics
from conftest import ServerProcess, free_port
from etcd_server import EtcdServer, have_etcd
from helpers.sse import sse_events
from helpers.waiting import wait_for

TTL_S = "6"  # short for the tests, long enough that a loaded machine keeps a live worker's lease


class EtcdCluster:
    """The etcd and the workers of the tests, by name; every worker registers under ``etcd.url()``."""

    def __init__(self, etcd: EtcdServer):
        self.etcd = etcd
        self.procs: dict[str, ServerProcess] = {}

    @classmethod
    def etcd_or_skip(cls) -> EtcdServer:
        if not have_etcd():  # under CI=true a missing etcd fails: .ci/run installs it
            message = "etcd is not installed (apt-get install etcd-server; .ci/run does)"
            pytest.fail(message) if os.environ.get("CI") == "true" else pytest.skip(message)
        return EtcdServer()

    def spawn(self, name: str, *extra: str, model: str = "tiny") -> ServerProcess:
        """Start worker ``name`` on free ports (not waiting for it); it replaces any of that name in
        ``procs``."""
        role = "prefill" if name.startswith("p") else "decode"
        args = ["--role", role, "--worker-id", name, "--discovery", self.etcd.url(), "--discovery-ttl-s", TTL_S,
                "--discovery-grace-s", "2", *extra]
        if role == "prefill":
            bootstrap = free_port()
            args += ["--bootstrap-port", str(bootstrap)]
        else:
            bootstrap = None
        proc = ServerProcess(*args, model=model)
        proc.name, proc.role, proc.bootstrap_port = name, role, bootstrap
        proc.spawn()
        self.procs[name] = proc
        return proc

    def ensure(self, *names: str) -> list[ServerProcess]:
        """The named workers, those not running now started (in parallel) and waited for."""
        procs = [self.spawn(n) for n in names if n not in self.procs or self.procs[n].proc.poll() is not None]
        for p in procs:
            p.wait_ready()
        return [self.procs[n] for n in names]

    def stop(self, *names: str) -> None:
        """Stop the named workers together (their drains overlap)."""
        procs = [self.procs.pop(n) for n in names if n in self.procs]
        for p in procs:
            if p.proc.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            p.stop(timeout=15)

    def __enter__(self) -> "EtcdCluster":
        self.etcd.start()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop(*self.procs)
        finally:
            self.etcd.__exit__()


def listed(router) -> list[dict]:
    return requests.get(router.url + "/workers", timeout=10).json()["workers"]


def routable(router) -> dict[str, dict]:
    """The router's workers in rotation, by id."""
    return {w["id"]: w for w in listed(router) if w["state"] == "healthy"}


def finished(proc) -> float:
    return metric_sum(metrics(proc), "splitserve_requests_total", outcome="finished")


class Load:
    """Steady streaming ``/generate`` through the router at ``url`` from ``threads`` threads, each
    request after the last, each with a rid of its own (``tag-THREAD-N``, kept in ``rids``); every
    failure kept (rid, status, what it said). ``input_ids(thread, n)``: the prompt of a thread's
    ``n``-th request; ``sampling``: more sampling parameters. The one load generator of the tests
    (``test_discovery.py``, ``test_membership.py``, ``test_role_switch.py``)."""

    def __init__(self, url: str, threads: int = 2, max_new_tokens: int = 8, tag: str = "load",
                 input_ids: Callable[[int, int], list] = lambda i, n: [3, 1, 4, i, n % 50],
                 sampling: Optional[dict] = None, timeout: float = 120.0):
        self.url, self.max_new_tokens, self.tag, self.timeout = url, max_new_tokens, tag, timeout
        self.input_ids, self.sampling = input_ids, dict(sampling or {})
        self.done = 0  # requests ended, whole or not
        self.rids: list[str] = []
        self.failures: list = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout + 60)

    def _run(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            rid = f"{self.tag}-{i}-{n}"
            self.rids.append(rid)
            body = {"input_ids": list(self.input_ids(i, n)), "stream": True, "rid": rid,
                    "sampling_params": {"max_new_tokens": self.max_new_tokens, **self.sampling}}
            failure = None
            try:
                r = requests.post(self.url + "/generate", json=body, timeout=self.timeout)
                events = sse_events(r.text) if r.status_code == 200 else []
                if r.status_code != 200 or not events or events[-1] != "[DONE]" or \
                        any(isinstance(e, dict) and "error" in e for e in events):
                    failure = (rid, r.status_code, r.text[-500:])
            except requests.RequestException as exc:
                failure = (rid, 0, repr(exc))
            with self._lock:
                if failure is not None:
                    self.failures.append(failure)
                self.done += 1

    def wait_done(self, more: int, timeout: float = 120.0) -> None:
        """Until ``more`` requests more have ended (whole or not: failures are counted apart)."""
        target = self.done + more
        wait_for(f"{more} more requests through {self.url}", lambda: self.done >= target, timeout)
