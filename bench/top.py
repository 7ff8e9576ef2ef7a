"""How soon ``splitserve top`` shows a stalled request as late, in a real terminal (tmux).

A prefill worker whose KV writes never land (``--inject-faults stall_writes``, transfer
deadline ``--floor-s``), a decode worker and a router (``--model tiny``: the figure is about the
view, not the model); ``splitserve top --router URL --interval I`` runs in a tmux pane of its
own tmux server. ``--requests`` streaming requests are sent one at a time; for each, the moment
it crosses half its deadline is read off the prefill's ``/debug/requests`` (when it entered
TRANSFERRING, and what that state allows), and the screen is read every 20 ms until its row says
``LATE``; each request is sent at a random phase of top's polls. Printed per interval: the delay
from crossing to the screen (median, max), against the reference measured the same way in the
same run: the delay until the prefill's own ``/debug/requests`` marks the row late (polled every
20 ms, so the figure's own resolution).
The goal: on screen within 1 s. Usage::

    .venv/bin/python bench/top.py [--intervals 1,0.5] [--requests 5] [--floor-s 4]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from splitserve.secret_file import write_secret_file

from procs import free_port, stop_all

POLL_S = 0.02
LOG_DIR = Path(tempfile.mkdtemp(prefix="splitserve-top-bench-"))



class Proc:
    def __init__(self, name: str, *argv: str):
        self.name, self.log = name, LOG_DIR / f"{name}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "splitserve.cli", *argv], stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def wait_healthy(self, url: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode}; see {self.log}")
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise SystemExit(f"{self.name} not healthy after {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        stop_all([self.proc], 20)


def crossing(prefill: str, rid: str, timeout: float) -> tuple[float, float]:
    """(when ``rid`` crossed half its TRANSFERRING deadline, when ``/debug/requests`` first said late),
    both on this process's monotonic clock."""
    deadline, half = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        asked = time.monotonic()
        row = next((r for r in requests.get(prefill + "/debug/requests", timeout=5).json() if r["rid"] == rid), None)
        if row is not None and row["state"] == "TRANSFERRING" and row["deadline_s"] is not None:
            if half is None:
                entered = asked - row["state_age_s"]
                half = entered + (row["state_age_s"] + row["deadline_s"]) / 2
            if row["late"]:
                return half, asked
        time.sleep(POLL_S)
    raise SystemExit(f"{rid} was never late on {prefill}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--intervals", default="1,0.5", help="top's --interval values measured")
    ap.add_argument("--requests", type=int, default=5, help="stalled requests per interval")
    ap.add_argument("--floor-s", type=float, default=4.0, help="the stalled prefill's transfer deadline")
    args = ap.parse_args()
    tmux_bin = shutil.which("tmux")
    if tmux_bin is None:
        raise SystemExit("tmux is not installed (apt-get install tmux)")
    ports = {k: free_port() for k in ("prefill", "bootstrap", "decode", "router")}
    prefill, decode, router = (f"http://127.0.0.1:{ports[k]}" for k in ("prefill", "decode", "router"))
    common = ["serve", "--model", "tiny", "--host", "127.0.0.1", "--transfer-backend", "nixl",
              "--cluster-secret-file", write_secret_file(str(LOG_DIR / "cluster-secret"))]
    procs = [Proc("prefill", *common, "--role", "prefill", "--port", str(ports["prefill"]), "--bootstrap-port",
                  str(ports["bootstrap"]), "--inject-faults", "stall_writes", "--transfer-floor-s", str(args.floor_s)),
             Proc("decode", *common, "--role", "decode", "--port", str(ports["decode"]), "--allowed-prefill",
                  f"127.0.0.1:{ports['bootstrap']}")]
    results: dict[float, list[tuple[float, float]]] = {}
    rng = random.Random(0)
    try:
        procs[0].wait_healthy(prefill), procs[1].wait_healthy(decode)
        procs.append(Proc("router", "router", "--host", "127.0.0.1", "--port", str(ports["router"]), "--prefill",
                          prefill, str(ports["bootstrap"]), "--decode", decode))
        procs[2].wait_healthy(router)
        print(f"prefill (stall_writes, transfer deadline {args.floor_s:g} s), decode, router {router}; "
              f"logs {LOG_DIR}", flush=True)
        for interval in (float(x) for x in args.intervals.split(",")):
            # a tmux server of our own per interval (its own socket, no configuration file)
            tmux = [tmux_bin, "-L", f"splitserve-top-bench-{os.getpid()}-{interval:g}", "-f", "/dev/null"]
            cmd = f"{sys.executable} -m splitserve.cli top --router {router} --interval {interval:g}"
            subprocess.run([*tmux, "new-session", "-d", "-s", "top", "-x", "200", "-y", "50", cmd], check=True)
            results[interval] = []
            try:
                for i in range(args.requests):
                    rid = f"stall-{interval:g}-{i}"
                    time.sleep(rng.uniform(0, interval))  # at a random phase of top's polls
                    call = threading.Thread(target=lambda r=rid: requests.post(
                        router + "/v1/completions", headers={"X-Request-Id": r}, timeout=60,
                        json={"prompt": "stall", "max_tokens": 4, "stream": True}), daemon=True)
                    call.start()
                    half, flagged = crossing(prefill, rid, args.floor_s + 10)
                    while True:
                        screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", "top"], capture_output=True,
                                                text=True, check=True).stdout
                        if any(rid in line and "LATE" in line for line in screen.splitlines()):
                            seen = time.monotonic()
                            break
                        if time.monotonic() > half + args.floor_s + 5:
                            raise SystemExit(f"top never showed {rid} late:\n{screen}")
                        time.sleep(POLL_S)
                    results[interval].append((seen - half, flagged - half))
                    print(f"  interval {interval:g} s  {rid}: on screen {seen - half:.3f} s after crossing half its "
                          f"deadline (/debug/requests: {flagged - half:.3f} s)", flush=True)
                    call.join(args.floor_s + 30)
            finally:
                subprocess.run([*tmux, "kill-server"], capture_output=True)
    finally:
        for p in reversed(procs):
            p.stop()
    print(f"\n{'top --interval':<16} {'on screen median':>17} {'max':>8} {'/debug/requests median':>24} {'max':>8}"
          f"   goal: on screen within 1 s")
    for interval, pairs in results.items():
        screen, flag = [p[0] for p in pairs], [p[1] for p in pairs]
        print(f"{interval:<16g} {statistics.median(screen):>16.3f}s {max(screen):>7.3f}s "
              f"{statistics.median(flag):>23.3f}s {max(flag):>7.3f}s   max within goal: {max(screen) <= 1.0}")


if __name__ == "__main__":
    main()
