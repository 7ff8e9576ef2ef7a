"""Time to first token against prompt length, in one run, interleaved (medians): a colocated
worker; a decode worker alone, asked directly (no bootstrap fields: it computes the prompt
itself); the router splitting every request (``--pd-threshold-tokens 0``: prefill + decode, the KV
over the transfer); and the router deciding per request (its default threshold, or
``--threshold``). Usage::

    .venv/bin/python bench/ttft.py [--model tiny|smollm2|DIR] [--backend nixl|tcp] [--repeat 5]
                                   [--lengths 32,128,512,1024,4096] [--threshold N]

Columns (ms): ``colocated``, ``alone`` (decode alone, direct), ``split`` and ``router`` (the
router's own choice, ``A``lone or ``S``plit); ``split adds`` = split - alone (what disaggregating
costs one request), ``prompt`` = alone - alone at the shortest length (what computing the prompt
on decode costs it, and stalls the streams beside it for); ``router cost`` = router - alone where
the router sent it alone (its own hop). The checks printed after the table (docs/router.md): at
128 tokens the router is no slower than colocated plus its own cost, at 4,096 no slower than the
split. Each round runs the four in a shuffled order, with fresh random token ids (no cache hits).

It starts its processes itself on free ports (127.0.0.1) and stops them at the end.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from splitserve.secret_file import write_secret_file

from procs import free_port, stop_all


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
    ap.add_argument("--lengths", default="32,128,512,1024,4096")
    ap.add_argument("--threshold", type=int, default=None, help="the deciding router's --pd-threshold-tokens "
                                                                 "(default: the router's default)")
    args = ap.parse_args()

    ports = {k: free_port() for k in ("prefill", "bootstrap", "decode", "split", "router", "colocated")}
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
        for name in list(procs):
            wait_healthy(f"http://127.0.0.1:{ports[name]}", procs[name])
        workers = ["--prefill", f"http://127.0.0.1:{ports['prefill']}", str(ports["bootstrap"]),
                   "--decode", f"http://127.0.0.1:{ports['decode']}"]
        threshold = [] if args.threshold is None else ["--pd-threshold-tokens", str(args.threshold)]
        procs["split"] = spawn("router-split", ["router", "--port", str(ports["split"]), *workers,
                                                "--pd-threshold-tokens", "0"])
        procs["router"] = spawn("router", ["router", "--port", str(ports["router"]), *workers, *threshold])
        for name in ("split", "router"):
            wait_healthy(f"http://127.0.0.1:{ports[name]}", procs[name])
        url = {k: f"http://127.0.0.1:{ports[k]}" for k in ("colocated", "decode", "split", "router")}
        vocab = 40000 if args.model == "smollm2" else 2000
        rng = random.Random(0)
        print(f"model {args.model}  backend {args.backend}  repeat {args.repeat} (median, interleaved)  "
              f"threshold {args.threshold if args.threshold is not None else 'default'}  logs {LOG_DIR}", flush=True)
        print(f"{'prompt':>7} {'colocated':>10} {'alone':>8} {'split':>8} {'router':>9} {'split adds':>11} "
              f"{'prompt':>8} {'router cost':>12}", flush=True)
        rows, base = {}, None
        for n in map(int, args.lengths.split(",")):
            got: dict[str, list[float]] = {k: [] for k in url}
            before = requests.get(url["router"] + "/metrics", timeout=10).text
            for r in range(args.repeat + 1):  # round 0 warms up
                order = list(url)
                rng.shuffle(order)
                for k in order:
                    ids = [rng.randint(10, vocab) for _ in range(n)]  # fresh ids: no prefix-cache hit
                    t = ttft(url[k], ids) * 1e3
                    if r:
                        got[k].append(t)
            after = requests.get(url["router"] + "/metrics", timeout=10).text
            alone_now = decisions(after, "alone") > decisions(before, "alone")
            m = {k: statistics.median(v) for k, v in got.items()}
            base = m["decode"] if base is None else base
            cost = f"{m['router'] - m['decode']:+.1f}" if alone_now else "-"
            rows[n] = (m, alone_now)
            print(f"{n:>7} {m['colocated']:>10.1f} {m['decode']:>8.1f} {m['split']:>8.1f} {m['router']:>8.1f}"
                  f"{'A' if alone_now else 'S'} {m['split'] - m['decode']:>+11.1f} {m['decode'] - base:>+8.1f} "
                  f"{cost:>12}", flush=True)
        if 128 in rows:
            m, alone_now = rows[128]
            cost = max(0.0, m["router"] - m["decode"])  # a hop costs no less than nothing: below 0 is noise
            print(f"128 tokens: router {m['router']:.1f} ms vs colocated {m['colocated']:.1f} + the router's own cost "
                  f"{cost:.1f} = {m['colocated'] + cost:.1f} ms: "
                  f"{'ok' if m['router'] <= m['colocated'] + cost else 'WORSE'}", flush=True)
        if 4096 in rows:
            m, _ = rows[4096]
            print(f"4096 tokens: router {m['router']:.1f} ms vs split {m['split']:.1f} ms: "
                  f"{'ok' if m['router'] <= m['split'] else 'worse by %.1f ms' % (m['router'] - m['split'])}",
                  flush=True)
    finally:
        stop_all(procs.values())


def decisions(metrics_text: str, decision: str) -> float:
    """``splitserve_router_pd_decisions_total{decision=...}`` in a scrape."""
    for line in metrics_text.splitlines():
        if line.startswith("splitserve_router_pd_decisions_total") and f'decision="{decision}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


if __name__ == "__main__":
    main()
