"""Serving throughput and latency through HTTP with ``splitserve bench``'s load generator
(``splitserve/bench/``): a closed loop of 8 streaming clients, 512-token random prompts, 48-token
answers (``ignore_eos``), against

  split     ``splitserve launch`` (router, 1 prefill + 1 decode worker), CPUs split between the workers
  shared    the same with ``--no-split-cpus`` (both workers use every CPU)
  colocated ``splitserve serve`` (one worker does both)

one after the other in one run (only one is up at a time), ``--rounds`` times. Prints requests/s,
output tokens/s, TTFT p50/p90 and TPOT p50 (the mean time per token after the first) of each (median over rounds, with min-max), and the
ratios split / shared and split / colocated of each round (median, min-max). Each round's line
also shows the load average: on a machine shared with other work, a worker whose threads span
every core slows down most when something else runs, so read the spread, not one figure. Usage::

    .venv/bin/python bench/serving.py [--model tiny|DIR] [--rounds 3] [--concurrency 8]
        [--requests 64] [--prompt-tokens 512] [--output-tokens 48] [--backend nixl|tcp]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from splitserve.bench.client import Target
from splitserve.bench.load import Load, run
from splitserve.bench.stats import Summary, summarize
from splitserve.bench.workload import Workload

from procs import free_port, stop_all

LOG_DIR = Path(tempfile.mkdtemp(prefix="splitserve-serving-"))
DEPLOYMENTS = ("split", "shared", "colocated")



def command(name: str, model: str, port: int, backend: str) -> list[str]:
    if name == "colocated":
        return ["serve", "--model", model, "--host", "127.0.0.1", "--port", str(port)]
    return ["launch", "--model", model, "--port", str(port), "--transfer-backend", backend,
            *(["--no-split-cpus"] if name == "shared" else [])]


class Deployment:
    """One of the three set-ups as a process tree on a free port, up until ``stop()``."""

    def __init__(self, name: str, argv: list[str], port: int, tag: str):
        self.name, self.argv, self.url = name, argv, f"http://127.0.0.1:{port}"
        self.log = LOG_DIR / f"{tag}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "splitserve.cli", *argv], stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def wait_healthy(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name}: exited with {self.proc.returncode}; see {self.log}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{self.name}: not healthy after {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        stop_all([self.proc], 60)


def measure(name: str, args: argparse.Namespace, workload: Workload, load: Load, tag: str) -> Summary:
    port = free_port()
    dep = Deployment(name, command(name, args.model, port, args.backend), port, tag)
    try:
        dep.wait_healthy()
        result = asyncio.run(run(Target(dep.url), workload, load))
    finally:
        dep.stop()
    summary = summarize(result.records, result.duration_s)
    if summary.failed:
        raise SystemExit(f"{name}: {summary.failed} of {len(result.records)} requests failed, e.g. "
                         f"{summary.errors[0]}; see {dep.log}")
    return summary


def spread(values: list[float], fmt: str) -> str:
    text = format(statistics.median(values), fmt)
    return text if len(values) == 1 else f"{text} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--backend", default="nixl", choices=["nixl", "tcp"])
    ap.add_argument("--rounds", type=int, default=1, help="times each set-up is measured (default: 1)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=64, help="requests counted per set-up and round")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=48)
    args = ap.parse_args()
    load = Load(requests=args.requests, concurrency=args.concurrency, warmup=8)
    workload = Workload(input_len=args.prompt_tokens, output_len=args.output_tokens)

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"model {args.model}  backend {args.backend}  {cpus} CPUs  concurrency {load.concurrency}  "
          f"prompt {workload.input_len}  output {workload.output_len}  {load.requests} requests x "
          f"{args.rounds} rounds  logs {LOG_DIR}", flush=True)
    results: dict[str, list[Summary]] = {name: [] for name in DEPLOYMENTS}
    for r in range(args.rounds):
        for name in DEPLOYMENTS:
            s = measure(name, args, workload, load, f"{name}-{r}")
            results[name].append(s)
            print(f"  round {r + 1} {name:<9} {s.request_throughput:6.2f} req/s  TTFT p50 {s.ttft_ms['p50']:7.0f} ms  "
                  f"TPOT p50 {s.tpot_ms['p50']:6.1f} ms  load average {os.getloadavg()[0]:.1f}", flush=True)

    print(f"\n{'set-up':<10} {'requests/s':>20} {'output tokens/s':>20} {'TTFT p50 ms':>20} "
          f"{'TTFT p90 ms':>20} {'TPOT p50 ms':>18}")
    for name, runs in results.items():
        print(f"{name:<10} {spread([s.request_throughput for s in runs], '.2f'):>20} "
              f"{spread([s.output_throughput for s in runs], '.1f'):>20} "
              f"{spread([s.ttft_ms['p50'] for s in runs], '.0f'):>20} "
              f"{spread([s.ttft_ms['p90'] for s in runs], '.0f'):>20} {spread([s.tpot_ms['p50'] for s in runs], '.1f'):>18}")
    per_round = {key: [a.request_throughput / b.request_throughput for a, b in zip(results["split"], results[other])]
                 for key, other in (("shared", "shared"), ("colocated", "colocated"))}
    print(f"\nsplit pair, requests/s with CPUs split / not split: {spread(per_round['shared'], '.2f')}x "
          f"(target >= 1.25x)")
    print(f"split pair (CPUs split) / colocated:                {spread(per_round['colocated'], '.2f')}x")


if __name__ == "__main__":
    main()
