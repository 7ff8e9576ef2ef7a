"""A cluster that changes under load, timed: workers found through a real etcd (issue 19).

Under steady streaming traffic at a fixed rate through one router (``--discovery``, no static
worker), on one host:

  scale-up   a decode worker, then a prefill worker, started with ``--discovery``: the time from
             its process start to its first healthy ``/health``, and from that to the first
             request it serves (its own ``/metrics``)
  kill -9    a decode worker killed: the time until the router's ``/workers`` no longer lists it
             (bounded by ``--ttl-s`` plus one list), and the requests that failed meanwhile
  rolling    each of 2 prefill + 2 decode workers SIGTERMed and started again, one at a time: the
             requests sent and the requests failed (should be none)

Usage::

    .venv/bin/python bench/cluster.py [--model tiny] [--rate 4] [--ttl-s 6] [--max-new-tokens 8]

Needs ``etcd`` on PATH (Debian's ``etcd-server``); it starts its own on free ports with a temporary
data dir, and stops everything it started at the end. Times are wall-clock on this machine: on a
shared 2-core machine they include the load of others.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from procs import free_port, stop_all

ROOT = Path(__file__).resolve().parent.parent
LOGS = Path(tempfile.mkdtemp(prefix="splitserve-bench-cluster-"))



def spawn(name: str, argv: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = open(LOGS / f"{name}-{time.monotonic_ns()}.log", "wb")
    return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=ROOT)


def wait_for(what: str, check, timeout: float = 300.0, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
        except requests.RequestException:
            value = None
        if value:
            return value
        time.sleep(poll)
    raise SystemExit(f"not within {timeout:g} s: {what} (logs in {LOGS})")


class Worker:
    def __init__(self, args, name: str):
        self.name, self.role = name, "prefill" if name.startswith("p") else "decode"
        self.port = free_port()
        argv = [sys.executable, "-m", "splitserve.cli", "serve", "--model", args.model, "--role", self.role,
                "--host", "127.0.0.1", "--port", str(self.port), "--worker-id", name,
                "--discovery", args.discovery, "--discovery-ttl-s", str(args.ttl_s), "--discovery-grace-s", "2",
                "--cluster-secret-file", args.secret]
        argv += ["--bootstrap-port", str(free_port())] if self.role == "prefill" else ["--allowed-prefill", "127.0.0.1"]
        self.started = time.monotonic()
        self.proc = spawn(name, argv)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        return requests.get(self.url + "/health", timeout=2).status_code == 200

    def served(self) -> float:
        text = requests.get(self.url + "/metrics", timeout=5).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("splitserve_requests_total{") and 'outcome="finished"' in line)


class Load:
    """``rate`` streaming requests a second, each in a thread of its own; failures counted."""

    def __init__(self, url: str, rate: float, max_new_tokens: int):
        self.url, self.rate, self.tokens = url, rate, max_new_tokens
        self.sent = self.failed = 0
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ticker = threading.Thread(target=self._tick, daemon=True)

    def start(self) -> "Load":
        self._ticker.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._ticker.join()
        for t in self._threads:
            t.join(300)

    def counts(self) -> tuple[int, int]:
        with self.lock:
            return self.sent, self.failed

    def _tick(self) -> None:
        n = 0
        next_at = time.monotonic()
        while not self._stop.is_set():
            n += 1
            t = threading.Thread(target=self._one, args=(n,), daemon=True)
            t.start()
            self._threads.append(t)
            next_at += 1.0 / self.rate
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def _one(self, n: int) -> None:
        body = {"input_ids": [3, 1, 4, n % 97], "stream": True, "sampling_params": {"max_new_tokens": self.tokens}}
        ok = False
        try:
            r = requests.post(self.url + "/generate", json=body, timeout=300)
            ok = r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
        except requests.RequestException:
            pass
        with self.lock:
            self.sent += 1
            self.failed += not ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rate", type=float, default=4.0, help="requests a second")
    parser.add_argument("--ttl-s", type=float, default=6.0, help="the workers' --discovery-ttl-s")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args()
    if shutil.which("etcd") is None:
        raise SystemExit("etcd is not on PATH (apt-get install etcd-server)")
    sys.path.insert(0, str(ROOT))
    from splitserve.secret_file import write_secret_file

    args.secret = write_secret_file(str(LOGS / "cluster-secret"))
    client, peer = free_port(), free_port()
    data = tempfile.mkdtemp(prefix="etcd-", dir=LOGS)
    procs: list[subprocess.Popen] = []
    workers: dict[str, Worker] = {}
    try:
        procs.append(spawn("etcd", ["etcd", "--name", "b", "--data-dir", data,
                                    "--listen-client-urls", f"http://127.0.0.1:{client}",
                                    "--advertise-client-urls", f"http://127.0.0.1:{client}",
                                    "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                                    "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                                    "--initial-cluster", f"b=http://127.0.0.1:{peer}"]))
        wait_for("etcd", lambda: requests.get(f"http://127.0.0.1:{client}/health", timeout=2).ok)
        args.discovery = f"etcd://127.0.0.1:{client}/bench"
        rport = free_port()
        router = f"http://127.0.0.1:{rport}"
        procs.append(spawn("router", [sys.executable, "-m", "splitserve.cli", "router", "--port", str(rport),
                                      "--discovery", args.discovery, "--health-interval-s", "0.5"]))
        for name in ("p1", "d1"):
            workers[name] = Worker(args, name)
        wait_for("the router ready", lambda: requests.get(router + "/health", timeout=2).status_code == 200)
        listed = lambda: {w["id"] for w in requests.get(router + "/workers", timeout=5).json()["workers"]}  # noqa: E731
        print(f"splitserve cluster bench: model {args.model}, {args.rate:g} requests/s streaming "
              f"{args.max_new_tokens} tokens, --discovery-ttl-s {args.ttl_s:g}; logs in {LOGS}")
        load = Load(router, args.rate, args.max_new_tokens).start()
        try:
            for name in ("d2", "p2"):
                w = workers[name] = Worker(args, name)
                wait_for(f"{name} healthy", w.healthy)
                healthy = time.monotonic()
                wait_for(f"{name} serving", lambda: w.served() > 0)
                print(f"scale-up  {w.role:7s} start -> healthy {healthy - w.started:6.2f} s, "
                      f"healthy -> first request served {time.monotonic() - healthy:6.2f} s")
            sent0, failed0 = load.counts()
            victim = workers.pop("d2")
            victim.proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            wait_for("d2 out of the router's set", lambda: "d2" not in listed(), poll=0.05)
            gone = time.monotonic() - killed
            sent1, failed1 = load.counts()
            print(f"kill -9   decode  -> out of rotation {gone:6.2f} s (TTL {args.ttl_s:g} s); "
                  f"{failed1 - failed0} of {sent1 - sent0} requests failed meanwhile")
            workers["d2"] = Worker(args, "d2")
            wait_for("d2 back", lambda: workers["d2"].served() > 0)
            sent0, failed0 = load.counts()
            for name in ("p1", "d1", "p2", "d2"):
                old = workers[name]
                old.proc.send_signal(signal.SIGTERM)
                old.proc.wait(120)
                new = workers[name] = Worker(args, name)
                wait_for(f"{name} again", lambda: new.served() > 0)
            sent1, failed1 = load.counts()
            print(f"rolling   2P+2D restarted one at a time: {failed1 - failed0} of {sent1 - sent0} requests failed")
        finally:
            load.stop()
    finally:
        for w in workers.values():
            procs.append(w.proc)
        stop_all(reversed(procs))  # the workers first, etcd last: they revoke their leases while it is up
    return 0


if __name__ == "__main__":
    sys.exit(main())
