"""The per-token path, engine -> detokenizer -> SSE on decode -> router -> client: what the router
adds to each streamed token against a direct connection to the decode worker, in one run.

It starts a prefill, a decode worker and a router on free ports (127.0.0.1; ``bench/ttft.py``'s
helpers) and stops them at the end. Every request is a streamed ``/v1/completions`` of fresh
random token ids (no prefix-cache hit), greedy, ``ignore_eos``, a fixed ``--max-tokens``; its
prompt is below the router's ``--pd-threshold-tokens``, so the router sends it to the decode
worker alone and both paths run the same work on the same worker. For each stream count, each
round runs the two paths one after the other (the order alternating by round): ``direct`` (the
client asks the decode worker itself, as ``bench/ttft.py``'s "decode alone, direct") and
``router``; each is a closed loop of N clients sending ``--requests-per-stream`` requests each.

Printed per path: output tokens/s (median over rounds, min-max), ITL p50/p99 and TTFT p50 (over
every request of every round), and the CPU milliseconds per streamed token of the router's and
the decode worker's process trees (utime + stime from ``/proc/PID/stat`` before and after each
phase: CPU time holds on a shared machine where wall time does not). The router's added cost per
token is its CPU per token in the router phase less its idle cost in the direct phase (health
checks), and the ITL difference. First, with nothing to do for ``--idle-seconds``, the CPU each of
the three processes takes idle (its threads' timers: a thread that wakes every few milliseconds
takes the GIL from the engine thread as often). The CPU flags and the load average at the start
and the end are printed too.

``--profile``: afterwards, a py-spy profile of the decode worker under ``--profile-streams`` direct
streams (``py-spy record --nonblocking --threads --format raw``, ``--profile-seconds``), summarised
as the share of the worker's CPU time in the model's forward pass, the sampler, the detokenizer,
HTTP/SSE (whatever runs on the event loop: aiohttp, the handlers and the chunks they build) and
lifecycle/scheduler (the rest of the engine and the disaggregation threads), with the functions
outside the forward pass that took the most. A py-spy sample only says where a thread was while it
was not asleep (on a busy machine that includes waiting for a core, which inflates threads that
wake often), so each thread's samples are weighted by the CPU time it took meanwhile
(``/proc/PID/task/TID/stat``); threads with no Python frames (torch's intra-op workers) are shown
apart. ``--profile-router``: the same of the router, under as many streams through it (nearly all
of it is on its event loop, so the functions say more than the categories). py-spy is not a
dependency: ``python3 -m venv /tmp/pyspy && /tmp/pyspy/bin/pip install py-spy`` (or ``--py-spy
PATH``). Usage::

    PYTHONPATH=. .venv/bin/python bench/token_path.py [--model tiny|smollm2|DIR] [--streams 16,64]
        [--rounds 3] [--requests-per-stream 2] [--prompt-tokens 32] [--max-tokens 64] [--idle-seconds 10]
        [--profile] [--profile-router] [--profile-streams 64] [--profile-seconds 20] [--py-spy PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import aiohttp
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ttft  # noqa: E402  (its process helpers: spawn, wait until healthy)
from procs import free_port, stop_all  # noqa: E402
from vs_refs import cpu_description  # noqa: E402

from splitserve.bench.client import Target, send  # noqa: E402
from splitserve.bench.stats import Record, distribution  # noqa: E402
from splitserve.bench.workload import Spec  # noqa: E402
from splitserve.secret_file import write_secret_file  # noqa: E402

ttft.LOG_DIR.rmdir()  # ttft's own log folder, made at import and unused here
LOG_DIR = ttft.LOG_DIR = Path(tempfile.mkdtemp(prefix="splitserve-token-path-"))
TICK = os.sysconf("SC_CLK_TCK")
PATHS = ("direct", "router")


def _stat(pid: int) -> tuple[int, float]:
    """(parent pid, CPU seconds of the process and its reaped children) from ``/proc/PID/stat``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    # fields[0] is the state (field 3); utime, stime, cutime, cstime are fields 14-17
    return int(fields[1]), sum(int(x) for x in fields[11:15]) / TICK


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) of ``root`` and every live descendant, and the reaped ones'."""
    parents, cpu = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)], cpu[int(entry)] = _stat(int(entry))
            except (OSError, ValueError, IndexError):
                pass  # gone meanwhile
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo.extend(p for p, parent in parents.items() if parent == pid and p not in tree)
    return sum(cpu.get(p, 0.0) for p in tree)


def idle_cpu(pids: dict[str, int], seconds: float) -> None:
    """Print each process tree's CPU over ``seconds`` with no request in flight, as a share of a core."""
    time.sleep(2.0)  # what starting up left behind (the first health checks) settles
    before = {name: tree_cpu_s(pid) for name, pid in pids.items()}
    started = time.monotonic()
    time.sleep(seconds)
    took = time.monotonic() - started
    shares = ", ".join(f"{name} {100 * (tree_cpu_s(pid) - before[name]) / took:.2f} %"
                       for name, pid in pids.items())
    print(f"idle for {took:.1f} s, CPU of a core: {shares}", flush=True)


@dataclass
class Phase:
    """What one path measured over its phases: the records, each phase's tokens/s, the tokens, CPU
    seconds by process."""

    records: list[Record] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    tokens: int = 0
    cpu_s: dict = field(default_factory=lambda: {"router": 0.0, "decode": 0.0})


def specs(n: Optional[int], prompt_tokens: int, max_tokens: int, vocab: int, rng: random.Random) -> Iterator[Spec]:
    """``n`` requests (None: until the caller stops) of fresh random ids: no prefix-cache hit."""
    for _ in itertools.repeat(None) if n is None else range(n):
        yield Spec(max_tokens=max_tokens, prompt=[rng.randint(10, vocab) for _ in range(prompt_tokens)])


async def closed_loop(session: aiohttp.ClientSession, url: str, todo: Iterator[Spec], streams: int) -> list[Record]:
    """``streams`` clients, each sending the next request of ``todo`` when its last one ended."""
    target, records = Target(url), []

    async def client() -> None:
        for spec in todo:  # one iterator shared by every client: each spec is sent once
            record, _ = await send(session, target, spec)
            records.append(record)

    await asyncio.gather(*(client() for _ in range(streams)))
    return records


async def measure(session, url: dict, pids: dict, streams: int, args, vocab: int, rng: random.Random) -> dict:
    got = {p: Phase() for p in PATHS}
    await closed_loop(session, url["direct"], specs(streams, args.prompt_tokens, args.max_tokens, vocab, rng),
                      streams)  # warm-up: the batch shapes of this stream count, on the decode worker
    for r in range(args.rounds):
        for path in PATHS if r % 2 == 0 else PATHS[::-1]:
            todo = specs(streams * args.requests_per_stream, args.prompt_tokens, args.max_tokens, vocab, rng)
            cpu0 = {k: tree_cpu_s(pid) for k, pid in pids.items()}
            t0 = time.perf_counter()
            records = await closed_loop(session, url[path], todo, streams)
            wall = time.perf_counter() - t0
            cpu = {k: tree_cpu_s(pid) - cpu0[k] for k, pid in pids.items()}
            bad = [rec.error for rec in records if not rec.ok]
            if bad:
                raise SystemExit(f"{path}: {len(bad)} of {len(records)} requests failed, e.g. {bad[0]}; logs {LOG_DIR}")
            tokens = sum(rec.output_tokens for rec in records)
            ph = got[path]
            ph.records += records
            ph.tokens += tokens
            ph.tokens_per_s.append(tokens / wall)
            for k in cpu:
                ph.cpu_s[k] += cpu[k]
            print(f"  round {r + 1} {path:>6}: {tokens / wall:7.1f} tokens/s, CPU ms/token router "
                  f"{cpu['router'] * 1e3 / tokens:6.3f}, decode {cpu['decode'] * 1e3 / tokens:6.2f}  "
                  f"({tokens} tokens, {wall:.1f} s, load average {os.getloadavg()[0]:.1f})", flush=True)
    return got


def report(streams: int, got: dict) -> None:
    rows = {}
    print(f"{streams} streams: {'path':>6} {'tokens/s (min-max)':>24} {'ITL p50':>8} {'ITL p99':>8} {'TTFT p50':>9} "
          f"{'router CPU ms/tok':>18} {'decode CPU ms/tok':>18}")
    for path, ph in got.items():
        itl = distribution([g for rec in ph.records for g in rec.itls], (50, 99))
        ttft_ms = distribution([rec.ttft for rec in ph.records if rec.ttft is not None], (50,))
        rows[path] = dict(itl50=itl["p50"], itl99=itl["p99"], router=ph.cpu_s["router"] * 1e3 / ph.tokens,
                          decode=ph.cpu_s["decode"] * 1e3 / ph.tokens)
        tps = ph.tokens_per_s
        print(f"{'':>{len(str(streams)) + 9}} {path:>6} {statistics.median(tps):9.1f} ({min(tps):6.1f}-{max(tps):6.1f})"
              f" {itl['p50']:8.1f} {itl['p99']:8.1f} {ttft_ms['p50']:9.1f} {rows[path]['router']:18.3f} "
              f"{rows[path]['decode']:18.2f}")
    d, r = rows["direct"], rows["router"]
    print(f"{streams} streams: the router adds {r['router'] - d['router']:.3f} CPU ms a token ({r['router']:.3f} "
          f"through it less {d['router']:.3f} idle); ITL p50 {r['itl50'] - d['itl50']:+.1f} ms, p99 "
          f"{r['itl99'] - d['itl99']:+.1f} ms; decode's own CPU {r['decode'] - d['decode']:+.2f} ms a token",
          flush=True)


# A sample's stack (root first) belongs to the first category, in this order, any of whose
# markers one of its frames holds.
CATEGORIES = (
    ("forward", ("splitserve/engine/model_runner.py", "splitserve/models/", "splitserve/layers/")),
    ("sampler", ("splitserve/engine/sampler.py", "LLMEngine._sample (")),
    ("detokenizer", ("splitserve/engine/detokenizer.py", "tokenizers/", "transformers/")),
    ("HTTP/SSE", ("splitserve/server/", "aiohttp/", "asyncio/", "selectors.py", "json/", "multidict/", "yarl/",
                  "splitserve/http_util.py", "splitserve/metrics.py", "splitserve/validation/")),
    ("lifecycle/scheduler", ("splitserve/",)),
)
NATIVE = "native threads"  # no Python frame: torch's intra-op workers (the forward pass's other cores)


def categorize(stack: list[str]) -> str:
    for name, markers in CATEGORIES:
        if any(m in frame for frame in stack for m in markers):
            return name
    return "other"


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (utime + stime) of each of ``pid``'s threads, from ``/proc/PID/task/TID/stat``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / TICK
        except (OSError, ValueError, IndexError):
            pass
    return out


def summarize_profile(who: str, raw: Path, cpu: dict[int, float], tokens: int) -> None:
    """py-spy's raw output with ``--threads``: ``thread (TID): NAME;frame;... COUNT`` a line, root
    first. A sample only says where a thread was when it was not asleep (on a busy machine, also
    while it waited for a core), so each thread's samples are weighted by the CPU time that thread
    took meanwhile: a category's share is of the process's CPU time. ``tokens``: the token events
    the clients received meanwhile (for CPU milliseconds a token)."""
    samples: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    functions: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    names: dict[int, str] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack.startswith("thread (") or not count.isdigit():
            continue
        head, _, frames_text = stack.partition(";")
        tid_text, _, name = head[len("thread ("):].partition("): ")
        tid, frames, n = int(tid_text), frames_text.split(";"), int(count)
        names[tid] = name
        kind = categorize(frames)
        samples[tid][kind] += n
        if kind != "forward":
            ours = [f for f in frames if "splitserve/" in f or "aiohttp/" in f or "asyncio/" in f]
            functions[tid][f"{kind}: {(ours or frames)[-1].rsplit(':', 1)[0]})"] += n  # the function, not its line
    total_cpu = sum(cpu.values())
    if not total_cpu:
        print(f"profile: the {who} took no CPU time ({raw})")
        return
    shares, top = collections.Counter(), collections.Counter()
    per_token = f", {total_cpu * 1e3 / tokens:.3f} ms a token ({tokens} token events)" if tokens else ""
    print(f"profile of the {who}: {total_cpu:.1f} CPU s{per_token}; by thread (CPU s, py-spy samples):")
    for tid, s in sorted(cpu.items(), key=lambda kv: -kv[1]):
        n = sum(samples[tid].values())
        if s <= 0 and not n:
            continue
        if not n:
            shares[NATIVE] += s
        for kind, k in samples[tid].items():
            shares[kind] += s * k / n
        for fn, k in functions[tid].items():
            top[f"{names[tid]}: {fn}"] += s * k / n
        print(f"  {names.get(tid, f'{tid} (no Python frames)'):>28}: {s:6.2f} s ({100 * s / total_cpu:5.1f} %), "
              f"{n:5d} samples")
    print(f"share of the {who}'s CPU time (each thread's CPU split by its samples), and CPU ms a token:")
    for name in (*(c for c, _ in CATEGORIES), "other", NATIVE):
        ms = f"  {shares[name] * 1e3 / tokens:7.4f} ms" if tokens else ""
        print(f"  {name:>20}: {100 * shares[name] / total_cpu:5.1f} %{ms}")
    print("outside the forward pass, the innermost splitserve/aiohttp/asyncio function (share of the CPU time):")
    for fn, s in top.most_common(15):
        print(f"  {100 * s / total_cpu:5.1f} %  {fn}")


async def profile(session, who: str, url: str, pid: int, args, vocab: int, rng: random.Random) -> None:
    """py-spy on ``pid`` (the ``who``) while ``--profile-streams`` streams ask ``url``."""
    out = LOG_DIR / f"{who.split()[-1]}.pyspy.txt"
    stop = asyncio.Event()
    todo = itertools.takewhile(lambda _: not stop.is_set(),
                               specs(None, args.prompt_tokens, args.max_tokens, vocab, rng))
    load = asyncio.ensure_future(closed_loop(session, url, todo, args.profile_streams))
    await asyncio.sleep(3)  # the streams are decoding before sampling begins
    print(f"profiling the {who} (pid {pid}) under {args.profile_streams} streams to {url} for "
          f"{args.profile_seconds} s; load average {os.getloadavg()[0]:.1f}", flush=True)
    with open(LOG_DIR / "py-spy.log", "wb") as log:
        cpu0, t0 = thread_cpu_s(pid), time.perf_counter()
        spy = await asyncio.create_subprocess_exec(
            args.py_spy, "record", "--nonblocking", "--threads", "--format", "raw", "-o", str(out),
            "-d", str(args.profile_seconds), "-p", str(pid), stdout=log, stderr=log)
        await spy.wait()
        cpu1, t1 = thread_cpu_s(pid), time.perf_counter()
    stop.set()
    records = await load
    tokens = sum(rec.output_tokens for rec in records if rec.ok)
    during = sum(t0 <= t <= t1 for rec in records for t in rec.token_times)
    print(f"  (the profile's load: {len(records)} requests, {tokens} tokens; py-spy exited {spy.returncode}, "
          f"its log {LOG_DIR / 'py-spy.log'}; load average {os.getloadavg()[0]:.1f})", flush=True)
    if spy.returncode == 0 and out.exists():
        summarize_profile(who, out, {tid: cpu1[tid] - cpu0.get(tid, 0.0) for tid in cpu1}, during)


async def run_all(args, url: dict, pids: dict, vocab: int) -> None:
    rng = random.Random(0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600), trust_env=False) as session:
        for streams in map(int, args.streams.split(",")):
            print(f"{streams} concurrent streams, {args.rounds} rounds of {streams * args.requests_per_stream} "
                  f"requests a path:", flush=True)
            report(streams, await measure(session, url, pids, streams, args, vocab, rng))
        if args.profile:
            await profile(session, "decode worker", url["direct"], pids["decode"], args, vocab, rng)
        if args.profile_router:
            await profile(session, "router", url["router"], pids["router"], args, vocab, rng)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--backend", default="tcp", choices=["nixl", "tcp"], help="the pair's transfer (no KV moves here)")
    ap.add_argument("--streams", default="16,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threshold", type=int, default=160, help="the router's --pd-threshold-tokens")
    ap.add_argument("--idle-seconds", type=float, default=10.0, help="how long the idle CPU of each process is "
                    "measured before the load (0: not measured)")
    ap.add_argument("--profile", action="store_true", help="py-spy on the decode worker under direct streams")
    ap.add_argument("--profile-router", action="store_true", help="py-spy on the router under streams through it")
    ap.add_argument("--profile-streams", type=int, default=64)
    ap.add_argument("--profile-seconds", type=int, default=20)
    ap.add_argument("--py-spy", default="/tmp/pyspy/bin/py-spy")
    args = ap.parse_args()
    if args.prompt_tokens >= args.threshold:
        ap.error("--prompt-tokens must be below --threshold: the router must send every request to decode alone")
    if (args.profile or args.profile_router) and not os.access(args.py_spy, os.X_OK):
        ap.error(f"no py-spy at {args.py_spy}: python3 -m venv /tmp/pyspy && /tmp/pyspy/bin/pip install py-spy")

    print(f"CPU: {cpu_description()}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f} at the start",
          flush=True)
    ports = {k: free_port() for k in ("prefill", "bootstrap", "decode", "router")}
    common = ["--model", args.model, "--host", "127.0.0.1"]
    secret = ["--cluster-secret-file", write_secret_file(str(LOG_DIR / "cluster-secret"))]
    transfer = ["--transfer-backend", args.backend]
    procs = {
        "prefill": ttft.spawn("prefill", ["serve", *common, *secret, *transfer, "--role", "prefill",
                                          "--port", str(ports["prefill"]),
                                          "--bootstrap-port", str(ports["bootstrap"])]),
        "decode": ttft.spawn("decode", ["serve", *common, *secret, *transfer, "--role", "decode",
                                        "--port", str(ports["decode"]),
                                        "--allowed-prefill", f"127.0.0.1:{ports['bootstrap']}"]),
    }
    try:
        for name in list(procs):
            ttft.wait_healthy(f"http://127.0.0.1:{ports[name]}", procs[name])
        procs["router"] = ttft.spawn("router", [
            "router", "--port", str(ports["router"]), "--prefill", f"http://127.0.0.1:{ports['prefill']}",
            str(ports["bootstrap"]), "--decode", f"http://127.0.0.1:{ports['decode']}",
            "--pd-threshold-tokens", str(args.threshold)])
        ttft.wait_healthy(f"http://127.0.0.1:{ports['router']}", procs["router"])
        url = {"direct": f"http://127.0.0.1:{ports['decode']}", "router": f"http://127.0.0.1:{ports['router']}"}
        if args.idle_seconds > 0:
            idle_cpu({name: p.pid for name, p in procs.items()}, args.idle_seconds)
        vocab = 40000 if args.model == "smollm2" else 2000
        print(f"model {args.model}; {args.prompt_tokens}-token prompts (router threshold {args.threshold}: decode "
              f"alone), {args.max_tokens} tokens each, greedy; logs {LOG_DIR}", flush=True)
        asyncio.run(run_all(args, url, {"router": procs["router"].pid, "decode": procs["decode"].pid}, vocab))
        metrics = requests.get(url["router"] + "/metrics", timeout=10).text
        alone, split = ttft.decisions(metrics, "alone"), ttft.decisions(metrics, "split")
        print(f"the router sent {alone:.0f} requests to decode alone, {split:.0f} split; load average "
              f"{os.getloadavg()[0]:.2f} at the end", flush=True)
    finally:
        stop_all(procs.values())


if __name__ == "__main__":
    main()
