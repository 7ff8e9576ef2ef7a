"""Time to first token: through the router (one prefill + one decode worker) against a colocated
worker, for prompts of 128, 1024 and 4096 tokens, in one run. Prints the medians and the
milliseconds disaggregation adds. Usage::

    .venv/bin/python bench/ttft.py [--model tiny|DIR] [--backend nixl|tcp] [--repeat 5]

It starts the four processes itself on free ports (127.0.0.1) and stops them at the end.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from splitserve.disagg.control.curve import write_secret_file


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LOG_DIR = Path(tempfile.mkdtemp(prefix="splitserve-ttft-"))


def spawn(name: str, args: list[str]) -> subprocess.Popen:
    log = open(LOG_DIR / f"{name}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "splitserve.cli", *args], stdout=log, stderr=log,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: process exited with {proc.returncode}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} never became healthy")


def ttft(url: str, ids: list[int]) -> float:
    """Seconds from sending a streamed /generate to its first SSE event with a token."""
    body = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    t0 = time.perf_counter()
    first, lines = None, []
    with requests.post(url + "/generate", json=body, stream=True, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith(b"data:") and b"output_ids" in line:
                first = time.perf_counter() - t0
            lines.append(line)
    if first is None:
        raise RuntimeError(f"no token from {url}: {lines[:4]}")
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--backend", default="nixl", choices=["nixl", "tcp"])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--lengths", default="128,1024,4096")
    args = ap.parse_args()

    ports = {k: free_port() for k in ("prefill", "bootstrap", "decode", "router", "colocated")}
    common = ["--model", args.model, "--host", "127.0.0.1"]
    secret = ["--cluster-secret-file", write_secret_file(str(LOG_DIR / "cluster-secret"))]
    procs = {
        "prefill": spawn("prefill", ["serve", *common, *secret, "--role", "prefill", "--port", str(ports["prefill"]),
                          "--bootstrap-port", str(ports["bootstrap"]), "--transfer-backend", args.backend]),
        "decode": spawn("decode", ["serve", *common, *secret, "--role", "decode", "--port", str(ports["decode"]),
                         "--transfer-backend", args.backend, "--allowed-prefill", f"127.0.0.1:{ports['bootstrap']}"]),
        "colocated": spawn("colocated", ["serve", *common, "--port", str(ports["colocated"])]),
    }
    try:
        for name in procs:
            wait_healthy(f"http://127.0.0.1:{ports[name]}", procs[name])
        procs["router"] = spawn("router", ["router", "--port", str(ports["router"]),
                                 "--prefill", f"http://127.0.0.1:{ports['prefill']}", str(ports["bootstrap"]),
                                 "--decode", f"http://127.0.0.1:{ports['decode']}"])
        wait_healthy(f"http://127.0.0.1:{ports['router']}", procs["router"])
        router, colocated = (f"http://127.0.0.1:{ports[k]}" for k in ("router", "colocated"))
        rng = random.Random(0)
        print(f"model {args.model}  backend {args.backend}  repeat {args.repeat} (median)  logs {LOG_DIR}")
        print(f"{'prompt':>7} {'colocated ms':>13} {'router ms':>10} {'added ms':>9}")
        for n in map(int, args.lengths.split(",")):
            ids = [rng.randint(10, 2000) for _ in range(n)]
            ttft(colocated, ids), ttft(router, ids)  # warm-up
            a = statistics.median(ttft(colocated, ids) for _ in range(args.repeat)) * 1e3
            b = statistics.median(ttft(router, ids) for _ in range(args.repeat)) * 1e3
            print(f"{n:>7} {a:>13.1f} {b:>10.1f} {b - a:>+9.1f}")
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
