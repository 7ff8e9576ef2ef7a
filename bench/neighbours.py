"""One request's input never slows another: a short request's latency beside hostile neighbours,
against the same request alone, measured in one run on one colocated worker.

Neighbours (each case runs in rounds: the short request alone, then beside the neighbours while
they live, then alone again once they ended; medians over all rounds):

  plain    one long generation (``ignore_eos``) with no stop strings: the reference for what
           sharing the batch costs by itself
  stops    the same generation with the most stop strings a request may have, each as long as
           allowed (``MAX_STOP`` x ``MAX_STOP_CHARS``), built to be almost completed by the text
           at every character
  prompts  two text prompts just under the body cap (``--prompt-mib``), of a context's worth of
           tokens many times over: refused (400) once they are known not to fit; the short
           request is sent at the same moment as they are

Printed: each case's median latency of the short request (``--short-tokens`` greedy tokens of a
3-token prompt) alone and beside, and their ratio; the target is at most 2x for ``stops`` and
``prompts`` (and ``stops`` about ``plain``). Usage::

    .venv/bin/python bench/neighbours.py [--model tiny|smollm2|DIR] [--cases plain,stops,prompts]
        [--rounds 3] [--samples 5] [--short-tokens 4] [--prompt-mib 7.6]

It starts ``splitserve serve`` itself on a free port (127.0.0.1) and stops it at the end; the
neighbours are sent by ``curl`` (other processes, so this one's own threads do not slow the short
request).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from procs import free_port, stop_all

LOG = Path(tempfile.mkdtemp(prefix="splitserve-neighbours-")) / "serve.log"



def short_latency(url: str, tokens: int) -> float:
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": tokens, "temperature": 0,
                                                         "ignore_eos": True}}
    started = time.monotonic()
    r = requests.post(url + "/generate", json=body, timeout=600)
    if r.status_code != 200:
        raise SystemExit(f"the short request failed: {r.status_code} {r.text[:300]}")
    return time.monotonic() - started


def neighbours(case: str, args) -> list[tuple[str, bytes]]:
    """(path, body) of each neighbour request of ``case``."""
    if case in ("plain", "stops"):
        sp = {"max_new_tokens": args.neighbour_tokens, "temperature": 0, "ignore_eos": True}
        if case == "stops":  # each nearly matched at every character: "aaa...a" + a letter never generated
            from splitserve.validation import MAX_STOP, MAX_STOP_CHARS

            sp["stop"] = ["a" * (MAX_STOP_CHARS - 1) + chr(0x4E00 + i) for i in range(MAX_STOP)]
        return [("/generate", json.dumps({"input_ids": [5, 6, 8], "sampling_params": sp}).encode())]
    text = "a " * int(args.prompt_mib * (1 << 20) / 2)
    body = json.dumps({"prompt": text, "max_tokens": 4}).encode()
    return [("/v1/completions", body), ("/v1/completions", body)]


def run_case(url: str, case: str, args) -> tuple[list[float], list[float], list[int]]:
    alone, beside, statuses = [], [], []
    for _ in range(args.rounds):
        alone += [short_latency(url, args.short_tokens) for _ in range(args.samples)]
        threads = []
        for i, (path, body) in enumerate(neighbours(case, args)):
            body_file = LOG.parent / f"{case}-{i}.json"
            body_file.write_bytes(body)

            def send(path=path, body_file=body_file):  # from another process: not this one's GIL
                out = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-H",
                                      "Content-Type: application/json", "--data-binary", f"@{body_file}",
                                      url + path], capture_output=True, text=True, timeout=900)
                statuses.append(int(out.stdout or 0))

            threads.append(threading.Thread(target=send, daemon=True))
        for t in threads:
            t.start()
        # the neighbours are in (generating), or just sent (prompts: their bodies are on the way,
        # then parsed and checked): each beside-sample is sent while one of them is still open,
        # the first one at once for prompts
        time.sleep(0.0 if case == "prompts" else args.settle_s)
        for i in range(args.samples):
            if i and not any(t.is_alive() for t in threads):
                break
            beside.append(short_latency(url, args.short_tokens))
        for t in threads:
            t.join()
    return alone, beside, statuses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--cases", default="plain,stops,prompts")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--short-tokens", type=int, default=4)
    ap.add_argument("--neighbour-tokens", type=int, default=1500)
    ap.add_argument("--prompt-mib", type=float, default=7.6)
    ap.add_argument("--settle-s", type=float, default=0.5)
    args = ap.parse_args()
    port = free_port()
    with open(LOG, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "serve", "--model", args.model, "--host",
                                 "127.0.0.1", "--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode}; see {LOG}")
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"the server is not up after 300 s; see {LOG}")
            time.sleep(0.5)
        short_latency(url, args.short_tokens)  # warm up
        print(f"model {args.model}, short request: {args.short_tokens} greedy tokens; {args.rounds} rounds "
              f"x {args.samples} samples")
        for case in args.cases.split(","):
            alone, beside, statuses = run_case(url, case, args)
            a, b = statistics.median(alone), statistics.median(beside) if beside else float("nan")
            print(f"{case:8s} alone {a * 1e3:8.1f} ms   beside {b * 1e3:8.1f} ms ({len(beside)} samples)   "
                  f"ratio {b / a:5.2f}x   neighbours answered {sorted(set(statuses))}", flush=True)
    finally:
        stop_all([proc], 60)


if __name__ == "__main__":
    main()
