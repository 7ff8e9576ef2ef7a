"""Chaos: ``splitserve launch`` with 2 prefill + 2 decode workers under a steady load while, every
``--every-s`` seconds, a random worker is SIGKILLed (``launch`` starts it again) or SIGSTOPped for
``--stop-s`` seconds; every answer is compared with a colocated worker's. Usage::

    .venv/bin/python bench/chaos.py [--model tiny|smollm2|DIR] [--duration-s 300] [--every-s 15]
        [--stop-s 6] [--clients 4] [--seed 0] [--router-args=...] [--dry-run]

First a colocated worker (``splitserve serve``, the same model) answers each request of the set
once: its answers are the references. The set mixes streamed and whole requests, greedy and
seeded, short and long prompts (``/v1/completions`` and ``/v1/chat/completions``). Then
``launch`` starts the cluster (a restart budget large enough for the run) and ``--clients``
threads send the set's requests round and round for ``--duration-s`` while the faults strike
(their schedule is drawn from ``--seed``). At the end, once every worker is back and idle, it
prints:

- requests sent, failed (an error status or event, a stream without ``[DONE]``, no answer) and
  different from the colocated answer (text or finish reason): both are to be 0;
- faults injected (kills, stops), and what the router and ``launch`` did about them: migrations
  (``splitserve_router_migrations_total`` by reason), retries (``..._retries_total``), prefill
  fallbacks to decode alone (``..._pd_decisions_total{decision="fallback"}``), prompts recomputed
  on decode (``splitserve_kv_fallback_total`` of the workers alive at the end: a restarted
  worker's count starts again), restarts (``launch``'s ``restarting it`` lines);
- every worker's KV pages after ``POST /flush_cache``: free of total, owned and quarantined (all
  back: free = total).

``--dry-run`` prints the request set and the fault schedule and starts nothing. The benches'
processes listen on free ports of 127.0.0.1 and are stopped at the end; the logs stay in a
temporary folder (printed). The exit status is 1 if a request failed or differed, or a worker's
pages did not all come back.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import requests

from procs import free_port, stop_all

ADMIN = "chaos-bench-admin-key"
LONG_WORDS = ("the cluster keeps serving while workers are killed stopped and restarted and every answer stays "
              "the one a single worker gives ").split()
SUMMARY_LINE = re.compile(r"^\s+((?:prefill|decode)\S*)\s+pid (\d+)\s+(http://\S+)")
STARTED_AGAIN = re.compile(r"(\S+) started again: pid (\d+)")


def cpu_flags() -> str:
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    return " ".join(sorted(x for x in set(flags) if x in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")))


def request_set(rng: random.Random, n: int) -> list[dict]:
    """``n`` requests: every mix of streamed/whole, greedy/seeded, short/long prompt, chat/completions."""
    out = []
    for i, (stream, seeded, long, chat) in zip(range(n), itertools.cycle(itertools.product((True, False), repeat=4))):
        words = [rng.choice(LONG_WORDS) for _ in range(rng.randint(150, 300) if long else rng.randint(3, 12))]
        body = {"model": "m", "max_tokens": rng.randint(24, 64), "stream": stream, "temperature": 0.0}
        if seeded:
            body.update(temperature=0.8, seed=1000 + i)
        if chat:
            body["messages"] = [{"role": "user", "content": " ".join(words)}]
        else:
            body["prompt"] = " ".join(words)
        out.append({"path": "/v1/chat/completions" if chat else "/v1/completions", "body": body})
    return out


def fault_schedule(rng: random.Random, duration_s: float, every_s: float) -> list[tuple[float, str, int]]:
    """(seconds from the start, "kill" or "stop", which worker: an index into the live workers)."""
    return [(t, rng.choice(("kill", "stop")), rng.randrange(1 << 16))
            for t in [every_s * k for k in range(1, int(duration_s // every_s) + 1)] if t < duration_s]


def ask(url: str, req: dict, timeout: float = 180.0) -> tuple[bool, str, object]:
    """(answered whole, why not, (text, finish_reason)) of one request."""
    try:
        with requests.post(url + req["path"], json=req["body"], stream=req["body"]["stream"], timeout=timeout) as resp:
            if resp.status_code != 200:
                return False, f"status {resp.status_code}: {resp.text[:200]}", None
            if not req["body"]["stream"]:
                choice = resp.json()["choices"][0]
                return True, "", (choice.get("text") or (choice.get("message") or {}).get("content") or "",
                                  choice.get("finish_reason"))
            return read_stream(resp)
    except (requests.RequestException, ValueError, KeyError, IndexError) as exc:
        return False, f"{type(exc).__name__}: {exc}", None


def read_stream(resp) -> tuple[bool, str, object]:
    text, finish, done = [], None, False
    for line in resp.iter_lines():
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            done = True
            continue
        event = json.loads(data)
        if "error" in event:
            return False, f"error event: {json.dumps(event)[:200]}", None
        for choice in event.get("choices") or ():
            text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            finish = choice.get("finish_reason") or finish
    if not done:
        return False, "the stream ended without data: [DONE]", None
    return True, "", ("".join(text), finish)


def spawn(log_dir: Path, name: str, args: list[str]) -> subprocess.Popen:
    log = open(log_dir / f"{name}.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "splitserve.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: its process exited with {proc.returncode}")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} never became healthy")


def references(args, reqs: list[dict], log_dir: Path) -> list[object]:
    """Each request's answer from a colocated worker of the same model (each request's ``model``
    set to the name it serves)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = spawn(log_dir, "colocated", ["serve", "--model", args.model, "--host", "127.0.0.1", "--port", str(port)])
    try:
        wait_healthy(url, proc)
        name = requests.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        for req in reqs:
            req["body"]["model"] = name
        out = []
        for req in reqs:
            ok, why, answer = ask(url, req)
            if not ok:
                raise SystemExit(f"the colocated worker failed a reference request: {why}")
            out.append(answer)
        return out
    finally:
        stop_all([proc])


class Cluster:
    """``splitserve launch`` and what its output says: each worker's pid and URL, its restarts."""

    def __init__(self, args, log_dir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        key_file = log_dir / "admin-api-key"
        key_file.write_text(ADMIN + "\n")
        key_file.chmod(0o600)
        argv = ["launch", "--model", args.model, "--num-prefill", "2", "--num-decode", "2", "--port", str(self.port),
                "--admin-api-key-file", str(key_file), "--restart-budget", "1000", "--no-split-cpus"]
        if args.router_args:
            argv.append(f"--router-args={args.router_args}")
        self.log = open(log_dir / "launch.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "splitserve.cli", *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.workers: dict[str, tuple[int, str]] = {}  # name -> (pid, url)
        self.restarts = 0
        self.ready = threading.Event()
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            with self.lock:
                if m := SUMMARY_LINE.match(line):
                    self.workers[m.group(1)] = (int(m.group(2)), m.group(3))
                elif m := STARTED_AGAIN.search(line):
                    name = m.group(1)
                    if name in self.workers:
                        self.workers[name] = (int(m.group(2)), self.workers[name][1])
                if ": restarting it" in line:
                    self.restarts += 1
                if line.startswith("splitserve ready"):
                    self.ready.set()

    def wait_ready(self, timeout: float = 900.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready.wait(1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"launch did not come up (exit {self.proc.poll()})")

    def live(self) -> list[tuple[str, int, str]]:
        with self.lock:
            return sorted((name, pid, url) for name, (pid, url) in self.workers.items())


def strike(cluster: Cluster, kind: str, pick: int, stop_s: float, out: Counter) -> None:
    """SIGKILL one worker (launch restarts it), or SIGSTOP it for ``stop_s`` then SIGCONT."""
    workers = cluster.live()
    name, pid, _ = workers[pick % len(workers)]
    print(f"  t={time.monotonic() - START:7.1f}s  {kind} {name} (pid {pid})", flush=True)
    try:
        if kind == "kill":
            os.kill(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stop_s)
            os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:  # already gone (a restart under way)
        out["faults missed (process gone)"] += 1
        return
    out[f"{kind}s"] += 1


class Load:
    """``clients`` threads sending the set round and round until told to stop; what came back."""

    def __init__(self, url: str, reqs: list[dict], refs: list[object], clients: int):
        self.url, self.reqs, self.refs = url, reqs, refs
        self.counts: Counter = Counter()
        self.examples: list[str] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.next = itertools.count()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self) -> None:
        while not self.stopping.is_set():
            i = next(self.next) % len(self.reqs)
            ok, why, answer = ask(self.url, self.reqs[i])
            with self.lock:
                self.counts["sent"] += 1
                if not ok:
                    self.counts["failed"] += 1
                    self._example(f"request {i} failed: {why}")
                elif answer != self.refs[i]:
                    self.counts["different"] += 1
                    self._example(f"request {i} differs: {answer!r} (colocated: {self.refs[i]!r})")

    def _example(self, text: str) -> None:
        if len(self.examples) < 10:
            self.examples.append(text)

    def finish(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join()


def metrics(url: str) -> dict[str, float]:
    """``/metrics`` of ``url``: every sample, by its name and labels as written."""
    text = requests.get(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def summed(samples: dict[str, float], prefix: str, where: str = "") -> dict[str, int]:
    """``prefix``'s samples (containing ``where``), by their labels."""
    return {k[len(prefix):] or "-": int(v) for k, v in samples.items()
            if (k == prefix or k.startswith(prefix + "{")) and where in k}


def counted(samples: dict[str, float], prefix: str) -> str:
    """``prefix``'s total, and its labels that are not 0."""
    by = summed(samples, prefix)
    nonzero = ", ".join(f"{k.strip('{}')} {v}" for k, v in sorted(by.items()) if v)
    return f"{sum(by.values())}" + (f" ({nonzero})" if nonzero else "")


def pages(cluster: Cluster) -> tuple[list[str], bool]:
    """Each worker's pages once its prefix cache is flushed; whether all came back."""
    lines, back = [], True
    for name, pid, url in cluster.live():
        try:
            requests.post(url + "/flush_cache", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
            m = metrics(url)
        except requests.RequestException as exc:
            lines.append(f"  {name}: unreadable ({exc})")
            back = False
            continue
        free, total = m.get("splitserve_kv_pages_free", -1), m.get("splitserve_kv_pages_total", -2)
        owned, held = m.get("splitserve_kv_pages_owned", 0), m.get("splitserve_kv_pages_quarantined", 0)
        recomputed = sum(summed(m, "splitserve_kv_fallback_total").values())
        back = back and free == total
        lines.append(f"  {name} (pid {pid}): pages free {free:.0f} of {total:.0f}, owned {owned:.0f}, quarantined "
                     f"{held:.0f}, prompts recomputed here {recomputed}{'' if free == total else '  NOT ALL BACK'}")
    return lines, back


def settle(cluster: Cluster, timeout: float = 300.0) -> None:
    """Until every worker answers /health 200 (restarts done) and has nothing running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            busy = 0
            for _, _, url in cluster.live():
                if requests.get(url + "/health", timeout=5).status_code != 200:
                    busy += 1
                    continue
                m = metrics(url)
                busy += int(m.get("splitserve_requests_running", 0) + m.get("splitserve_requests_waiting", 0))
            if not busy and len(cluster.live()) == 4:
                return
        except requests.RequestException:
            pass
        time.sleep(1.0)
    print("  (the cluster did not settle within the wait: pages are read anyway)")


def main() -> int:
    global START
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--duration-s", type=float, default=300.0)
    ap.add_argument("--every-s", type=float, default=15.0)
    ap.add_argument("--stop-s", type=float, default=6.0, help="how long a SIGSTOPped worker stays stopped")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=32, help="distinct requests in the set")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--router-args", default="", help="more options for the router (launch --router-args)")
    ap.add_argument("--dry-run", action="store_true", help="print the request set and the faults; start nothing")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    reqs = request_set(rng, args.requests)
    schedule = fault_schedule(rng, args.duration_s, args.every_s)
    load1 = os.getloadavg()[0]
    print(f"chaos: model {args.model}, 2 prefill + 2 decode, {args.clients} clients, {len(reqs)} distinct requests, "
          f"{args.duration_s:g} s, a fault every {args.every_s:g} s (stops {args.stop_s:g} s), seed {args.seed}; "
          f"CPU flags: {cpu_flags()}; {os.cpu_count()} CPUs, load {load1:.1f}")
    if args.dry_run:
        mix = Counter((r["path"], r["body"]["stream"], "seeded" if "seed" in r["body"] else "greedy") for r in reqs)
        print("requests: " + ", ".join(f"{p} {'stream' if s else 'whole'} {g} x{n}" for (p, s, g), n in sorted(mix.items())))
        print("faults: " + ", ".join(f"t={t:g}s {kind} worker #{pick % 4}" for t, kind, pick in schedule))
        return 0
    log_dir = Path(tempfile.mkdtemp(prefix="splitserve-chaos-"))
    print(f"logs: {log_dir}", flush=True)
    return run(args, reqs, schedule, log_dir)


START = time.monotonic()


def run(args, reqs: list[dict], schedule: list, log_dir: Path) -> int:
    global START
    refs = references(args, reqs, log_dir)
    print(f"references: {len(refs)} answers of a colocated worker", flush=True)
    cluster = Cluster(args, log_dir)
    faults: Counter = Counter()
    try:
        cluster.wait_ready()
        START = time.monotonic()
        load = Load(cluster.url, reqs, refs, args.clients)
        for at, kind, pick in schedule:
            time.sleep(max(0.0, START + at - time.monotonic()))
            strike(cluster, kind, pick, args.stop_s, faults)
        time.sleep(max(0.0, START + args.duration_s - time.monotonic()))
        load.finish()
        settle(cluster)
        router = metrics(cluster.url)
        page_lines, back = pages(cluster)
    finally:
        cluster.proc.send_signal(signal.SIGTERM)
        stop_all([cluster.proc], timeout=60)
    c = load.counts
    print(f"requests sent {c['sent']}, failed {c['failed']}, different from the colocated answer {c['different']}")
    for example in load.examples:
        print("  " + example)
    print("faults: " + (", ".join(f"{k} {v}" for k, v in sorted(faults.items())) or "none"))
    print(f"migrations: {counted(router, 'splitserve_router_migrations_total')}")
    print(f"retries: {counted(router, 'splitserve_router_retries_total')}")
    print(f"router outcomes: {counted(router, 'splitserve_router_requests_total')}")
    print(f"prefill fallbacks to decode alone: "
          f"{sum(summed(router, 'splitserve_router_pd_decisions_total', 'fallback').values())}")
    print(f"restarts (launch): {cluster.restarts}")
    print("pages at the end, prefix caches flushed:")
    print("\n".join(page_lines))
    return 0 if c["failed"] == 0 and c["different"] == 0 and back else 1


if __name__ == "__main__":
    sys.exit(main())
