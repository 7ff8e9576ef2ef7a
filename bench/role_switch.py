"""A role switch (``POST /role``) against the restart it replaces, in one run, interleaved: a decode
worker ``X`` becomes a prefill worker and back, each way by a switch (it keeps its process and
model) and by the restart it replaces (SIGTERM, then a new process in that role, until its
``/health`` is 200). Usage::

    .venv/bin/python bench/role_switch.py [--model tiny|smollm2|DIR] [--backend nixl|tcp] [--rounds 3]

Per round and direction it prints both times (s) and, at the end, the medians and their ratio
(switch / restart: below 1, the switch is faster). A prefill ``P`` and a decode ``D`` serve beside
``X``, so that the switch has peers to say goodbye to; no load runs (the drain takes nothing), so
what is measured is the switch's own cost: the control plane and transfer agent torn down and made
again, against a process start and a model load.

It starts its processes itself on free ports (127.0.0.1) and stops them at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from splitserve.secret_file import write_secret_file

from procs import free_port, stop_all

LOG_DIR = Path(tempfile.mkdtemp(prefix="splitserve-role-switch-"))
ADMIN = "bench-admin-key"



def spawn(name: str, args: list[str]) -> subprocess.Popen:
    log = open(LOG_DIR / f"{name}.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "splitserve.cli", *args], stdout=log, stderr=log,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: process exited with {proc.returncode} (logs {LOG_DIR})")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.05)
    raise SystemExit(f"{url} never became healthy (logs {LOG_DIR})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--backend", default="nixl", choices=["nixl", "tcp"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    ports = {k: free_port() for k in ("prefill", "bootstrap", "decode", "x", "x_bootstrap")}
    url = {k: f"http://127.0.0.1:{ports[k]}" for k in ("prefill", "decode", "x")}
    secret = ["--cluster-secret-file", write_secret_file(str(LOG_DIR / "cluster-secret"))]
    common = ["serve", "--model", args.model, "--host", "127.0.0.1", "--transfer-backend", args.backend, *secret,
              "--allowed-prefill", "127.0.0.1", "--admin-api-key", ADMIN]

    def x_args(role: str) -> list[str]:
        return [*common, "--role", role, "--port", str(ports["x"]), "--bootstrap-port", str(ports["x_bootstrap"]),
                "--worker-id", "x"]

    procs = {
        "prefill": spawn("prefill", [*common, "--role", "prefill", "--port", str(ports["prefill"]),
                                     "--bootstrap-port", str(ports["bootstrap"])]),
        "decode": spawn("decode", [*common, "--role", "decode", "--port", str(ports["decode"])]),
        "x": spawn("x", x_args("decode")),
    }
    try:
        for name in procs:
            wait_healthy(url[name], procs[name])
        print(f"model {args.model}  backend {args.backend}  rounds {args.rounds}  logs {LOG_DIR}", flush=True)
        print(f"{'round':>5} {'to':>8} {'switch s':>9} {'restart s':>10}", flush=True)
        times: dict[str, list[float]] = {"switch": [], "restart": []}
        for n in range(args.rounds):
            for to in ("prefill", "decode"):
                epoch = requests.get(url["x"] + "/health", timeout=10).json()["epoch"]
                t0 = time.perf_counter()
                r = requests.post(url["x"] + "/role", json={"role": to, "epoch": epoch},
                                  headers={"Authorization": f"Bearer {ADMIN}"}, timeout=300)
                switched = time.perf_counter() - t0
                if r.status_code != 200:
                    raise SystemExit(f"POST /role answered {r.status_code}: {r.text}")
                # the restart it replaces: stop the process, start one in role `to` (a restart into the
                # same role costs what one into the other does: a process start and a model load)
                t0 = time.perf_counter()
                procs["x"].send_signal(signal.SIGTERM)
                procs["x"].wait(120)
                procs["x"] = spawn("x", x_args(to))
                wait_healthy(url["x"], procs["x"])
                restarted = time.perf_counter() - t0
                times["switch"].append(switched)
                times["restart"].append(restarted)
                print(f"{n:>5} {to:>8} {switched:>9.2f} {restarted:>10.2f}", flush=True)
        s, r = statistics.median(times["switch"]), statistics.median(times["restart"])
        print(f"median: switch {s:.2f} s, restart {r:.2f} s: switch / restart {s / r:.3f}x", flush=True)
    finally:
        stop_all(procs.values())


if __name__ == "__main__":
    main()
