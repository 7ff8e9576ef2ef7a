"""The prefix cache on an agentic load, through the router: what it saves, and where routing helps.

A fixed workload, drawn from ``--seed``: 16 conversations that share a 1,536-token system prompt;
each has 3 to 6 turns of a 64-token user message and a 128-token answer (``ignore_eos``), and each
turn resends the whole conversation so far (its earlier answers' token ids included, as an agent
does). The conversations run side by side, a turn at a time: every live conversation's turn ``t``
is sent at once, and turn ``t + 1`` starts when all of them ended. 10% of the turns hang up
mid-answer (after a random number of streamed chunks); a conversation whose client hung up ends.
Prompts are token ids sent to ``/generate``, so their lengths are exact and an answer comes back
as the very ids the next turn sends.

Set-ups, each started by ``splitserve launch``, one after the other in one run:

  cache     1 prefill + 1 decode, prefix cache on (the default)
  no-cache  the same with ``--no-prefix-cache`` on both workers
  aware     2 prefill + 2 decode, cache on, ``--policy cache_aware``
  rr        2 prefill + 2 decode, cache on, ``--policy round_robin``

Read off every worker's ``/metrics`` before and after (turns 2 and later are the difference from
a snapshot taken when turn 1 ended): prompt tokens computed, prompt tokens served from the cache
(the hit rate is cached / prompt tokens sent, per role), KV bytes transferred, requests per
worker; and on the client side TTFT p50/p90 and output tokens/s. Printed: cache / no-cache on
turns 2 and later (targets: KV bytes and prompt tokens computed at most 0.25x), and aware against
rr (a higher hit rate; load still spread: the busiest worker of a role has at most 2x the requests
of the least busy). Usage::

    .venv/bin/python bench/agentic.py [--model smollm2|tiny|PATH] [--setups cache,no-cache,aware,rr]
        [--conversations 16] [--system-tokens 1536] [--turn-tokens 64] [--answer-tokens 128]
        [--min-turns 3] [--max-turns 6] [--hang-up 0.1] [--seed 0] [--backend nixl|tcp]
        [--worker-args="..."]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import aiohttp
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import free_port  # noqa: E402
from serving import Deployment  # noqa: E402

from splitserve.metrics import parse_exposition  # noqa: E402

SETUPS = {
    "cache": dict(prefill=1, decode=1, policy="round_robin", cache=True),
    "no-cache": dict(prefill=1, decode=1, policy="round_robin", cache=False),
    "aware": dict(prefill=2, decode=2, policy="cache_aware", cache=True),
    "rr": dict(prefill=2, decode=2, policy="round_robin", cache=True),
}
# This bench measures the cache, not overload: on a 2-core CPU shared with other work a cache-off turn
# of 16 prompts of ~2,000 tokens of SmolLM2 waits minutes for prefill, past the default bounds (60 s
# queued, 30 s per step), which would refuse it as overloaded — as they should in production.
GENEROUS = ("--loop-stall-s 600 --bootstrap-s 1800 --queue-s 1800 --prefill-stall-s 600 --kv-wait-s 3600 "
            "--decode-stall-s 600 --prealloc-s 1800 --pending-registration-s 1800 --tombstone-s 7200")
TOKEN_IDS = (100, 1000)  # ordinary tokens of any vocabulary of the supported models (tiny: 1,024)


@dataclass
class Conversation:
    """One client's conversation: the ids it sends next, its turns left, when it hangs up."""

    ids: list[int]
    turns: int
    hang_ups: dict[int, int]  # turn -> chunks read before hanging up
    alive: bool = True


@dataclass
class Turn:
    turn: int
    prompt_tokens: int
    ttft_s: Optional[float] = None
    output_tokens: int = 0
    hung_up: bool = False
    error: Optional[str] = None


def conversations(args: argparse.Namespace) -> list[Conversation]:
    rng = random.Random(args.seed)
    system = [rng.randrange(*TOKEN_IDS) for _ in range(args.system_tokens)]
    out = []
    for _ in range(args.conversations):
        turns = rng.randint(args.min_turns, args.max_turns)
        hang_ups = {t: rng.randrange(args.answer_tokens // 2) for t in range(turns) if rng.random() < args.hang_up}
        out.append(Conversation(list(system), turns, hang_ups))
    return out


def user_message(args: argparse.Namespace, seed: int, conv: int, turn: int) -> list[int]:
    rng = random.Random(f"{seed}/{conv}/{turn}")
    return [rng.randrange(*TOKEN_IDS) for _ in range(args.turn_tokens)]


async def one_turn(session: aiohttp.ClientSession, url: str, conv: Conversation, turn: int, prompt: list[int],
                   answer_tokens: int) -> tuple[Turn, list[int]]:
    """Send one turn, stream its answer; the answer's ids (empty when it hung up or failed)."""
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": answer_tokens, "ignore_eos": True, "temperature": 0}}
    rec, ids, chunks = Turn(turn, len(prompt)), [], 0
    hang_after = conv.hang_ups.get(turn)
    start = time.monotonic()
    try:
        async with session.post(url + "/generate", json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec, []
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    rec.error = str(event["error"])[:200]
                    return rec, []
                ids = event.get("output_ids", ids)
                if ids and rec.ttft_s is None:
                    rec.ttft_s = time.monotonic() - start
                chunks += 1
                if hang_after is not None and chunks > hang_after:
                    rec.hung_up = True  # leaving the block closes the connection: the client hangs up
                    break
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.output_tokens = len(ids)
    return rec, [] if rec.hung_up or rec.error else ids


async def run_workload(url: str, args: argparse.Namespace, after_first_turn) -> tuple[list[Turn], float]:
    convs = conversations(args)
    records: list[Turn] = []
    timeout = aiohttp.ClientTimeout(total=1800, sock_read=600)
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for turn in range(max(c.turns for c in convs)):
            live = [(i, c) for i, c in enumerate(convs) if c.alive and turn < c.turns]
            prompts = [c.ids + user_message(args, args.seed, i, turn) for i, c in live]
            results = await asyncio.gather(*(one_turn(session, url, c, turn, p, args.answer_tokens)
                                             for (_, c), p in zip(live, prompts)))
            for (_, c), prompt, (rec, answer) in zip(live, prompts, results):
                records.append(rec)
                if rec.hung_up or rec.error:
                    c.alive = False
                else:
                    c.ids = prompt + answer
            if turn == 0:
                after_first_turn()
    return records, time.monotonic() - started


# -- what the workers say ----------------------------------------------------------------------------


@dataclass
class Scrape:
    """The counters of every worker at one moment, by worker URL."""

    values: dict[str, dict[str, float]] = field(default_factory=dict)

    @classmethod
    def of(cls, workers: dict[str, str], headers: dict[str, str]) -> "Scrape":
        s = cls()
        for url, role in workers.items():
            samples = parse_exposition(requests.get(url + "/metrics", headers=headers, timeout=10).text)
            total = lambda name: sum(v for (n, _), v in samples.items() if n == name)  # noqa: E731
            s.values[url] = {
                "computed": total("splitserve_prompt_tokens_computed_total"),
                "hit": total("splitserve_prefix_cache_hit_tokens_total"),
                "kv_bytes": total("splitserve_kv_transfer_bytes_total"),
                "requests": total("splitserve_requests_total"),
            }
        return s

    def minus(self, other: "Scrape") -> "Scrape":
        return Scrape({u: {k: v - other.values[u][k] for k, v in vals.items()} for u, vals in self.values.items()})

    def total(self, key: str, urls) -> float:
        return sum(self.values[u][key] for u in urls)


@dataclass
class Result:
    name: str
    turns: list[Turn]
    wall_s: float
    later: Scrape  # turns 2 and later
    whole: Scrape
    roles: dict[str, str]

    def urls(self, role: str) -> list[str]:
        return [u for u, r in self.roles.items() if r == role]

    def prompt_tokens(self, later_only: bool) -> int:
        return sum(t.prompt_tokens for t in self.turns if t.turn > 0 or not later_only)

    def ttft_ms(self, q: float) -> float:
        values = sorted(t.ttft_s for t in self.turns if t.ttft_s is not None)
        return 1000 * values[min(len(values) - 1, int(q / 100 * len(values)))] if values else float("nan")

    def hit_rate(self, role: str) -> float:
        return self.whole.total("hit", self.urls(role)) / max(1, self.prompt_tokens(False))

    def balance(self, role: str) -> float:
        counts = [self.whole.values[u]["requests"] for u in self.urls(role)]
        return max(counts) / max(1, min(counts))


def start(name: str, args: argparse.Namespace) -> tuple[Deployment, dict[str, str]]:
    setup = SETUPS[name]
    port = free_port()
    argv = ["launch", "--model", args.model, "--port", str(port), "--transfer-backend", args.backend,
            "--num-prefill", str(setup["prefill"]), "--num-decode", str(setup["decode"]), "--policy", setup["policy"]]
    worker_args = args.worker_args + ("" if setup["cache"] else " --no-prefix-cache")
    argv += [f"--worker-args={worker_args}"]  # with "=": the value starts with a dash
    dep = Deployment(name, argv, port, name)
    dep.wait_healthy(args.ready_timeout_s)
    workers = requests.get(dep.url + "/workers", timeout=10)
    if workers.status_code == 200:  # the router lists its workers
        roles = {w["url"]: w["role"] for w in workers.json()["workers"]}
    else:  # read them off launch's summary, which names every worker and its URL once all are up
        roles, deadline = {}, time.monotonic() + 30
        while len(roles) < setup["prefill"] + setup["decode"] and time.monotonic() < deadline:
            time.sleep(0.2)
            for line in dep.log.read_text().splitlines():
                for role in ("prefill", "decode"):
                    if f" {role}-" in line and "http://" in line:
                        roles[line[line.index("http://"):].split()[0]] = role
    return dep, roles


def operator_headers(dep: Deployment, patience_s: float = 30) -> dict[str, str]:
    """The operators' key launch drew (its workers are always keyed): its summary names the file."""
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        found = re.search(r"the operators' key \(admin\) is in (\S+) while launch runs", dep.log.read_text())
        if found:
            return {"Authorization": f"Bearer {Path(found[1]).read_text().split()[0]}"}
        time.sleep(0.2)
    raise SystemExit(f"{dep.name}: launch named no operators' key file; see {dep.log}")


def measure(name: str, args: argparse.Namespace) -> Result:
    dep, roles = start(name, args)
    try:
        # one request first: the first forward pass of a fresh worker builds its kernels and caches
        asyncio.run(warm_up(dep.url, args))
        flush(dep.url)
        headers = operator_headers(dep)
        before = Scrape.of(roles, headers)
        marks: list[Scrape] = []
        turns, wall = asyncio.run(run_workload(dep.url, args, lambda: marks.append(Scrape.of(roles, headers))))
        after = Scrape.of(roles, headers)
    finally:
        dep.stop()
    errors = [t.error for t in turns if t.error]
    if errors:
        raise SystemExit(f"{name}: {len(errors)} of {len(turns)} turns failed, e.g. {errors[0]}; see {dep.log}")
    return Result(name, turns, wall, after.minus(marks[0]), after.minus(before), roles)


def flush(url: str, patience_s: float = 300) -> None:
    """Flush every worker's cache through the router; a worker in a long step answers 503: again."""
    deadline = time.monotonic() + patience_s
    while True:
        resp = requests.post(url + "/flush_cache", timeout=60)
        if resp.status_code == 200:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"/flush_cache answered {resp.status_code}: {resp.text[:500]}")
        time.sleep(2)


async def warm_up(url: str, args: argparse.Namespace) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for _ in range(2):  # round robin: every worker of each role once
            warm = Conversation([7] * 32, 1, {})
            await one_turn(session, url, warm, 0, warm.ids, 4)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}x" if b else "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--backend", default="nixl", choices=["nixl", "tcp"])
    ap.add_argument("--setups", default=",".join(SETUPS), help="which set-ups, comma-separated (default: all)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=1536)
    ap.add_argument("--turn-tokens", type=int, default=64)
    ap.add_argument("--answer-tokens", type=int, default=128)
    ap.add_argument("--min-turns", type=int, default=3)
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--hang-up", type=float, default=0.1, help="share of turns whose client hangs up mid-answer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ready-timeout-s", type=float, default=600)
    ap.add_argument("--worker-args", default=GENEROUS,
                    help="options for every worker (default: bounds generous enough for a cache-off run on a shared "
                         "CPU: %(default)s)")
    args = ap.parse_args()
    names = args.setups.split(",")
    unknown = [n for n in names if n not in SETUPS]
    if unknown:
        ap.error(f"unknown set-up {unknown[0]!r}; choose from {', '.join(SETUPS)}")

    print(f"model {args.model}  backend {args.backend}  {args.conversations} conversations  system prompt "
          f"{args.system_tokens}  turns {args.min_turns}-{args.max_turns} of {args.turn_tokens} + "
          f"{args.answer_tokens}  hang-ups {args.hang_up:.0%}  seed {args.seed}", flush=True)
    results: dict[str, Result] = {}
    for name in names:
        r = results[name] = measure(name, args)
        hung = sum(t.hung_up for t in r.turns)
        out = sum(t.output_tokens for t in r.turns)
        print(f"  {name:<9} {len(r.turns)} turns ({hung} hung up)  wall {r.wall_s:.1f} s  output "
              f"{out / r.wall_s:.1f} tokens/s  TTFT p50 {r.ttft_ms(50):.0f} ms p90 {r.ttft_ms(90):.0f} ms  "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)
        later = r.later
        print(f"            turns 2+: prompt tokens sent {r.prompt_tokens(True)}, computed "
              f"{later.total('computed', r.urls('prefill')):.0f}, KV bytes "
              f"{later.total('kv_bytes', r.urls('prefill')):.0f}; hit rate prefill {r.hit_rate('prefill'):.1%}, "
              f"decode {r.hit_rate('decode'):.1%}; requests per prefill "
              f"{[int(r.whole.values[u]['requests']) for u in r.urls('prefill')]}, per decode "
              f"{[int(r.whole.values[u]['requests']) for u in r.urls('decode')]}", flush=True)

    if "cache" in results and "no-cache" in results:
        on, off = results["cache"], results["no-cache"]
        p_on, p_off = on.urls("prefill"), off.urls("prefill")
        kv = ratio(on.later.total("kv_bytes", p_on), off.later.total("kv_bytes", p_off))
        computed = ratio(on.later.total("computed", p_on), off.later.total("computed", p_off))
        print(f"\ncache / no-cache, turns 2 and later: KV bytes transferred {kv} (target <= 0.25x), prompt tokens "
              f"computed {computed} (target <= 0.25x); TTFT p50 {ratio(on.ttft_ms(50), off.ttft_ms(50))}, p90 "
              f"{ratio(on.ttft_ms(90), off.ttft_ms(90))}; wall {ratio(on.wall_s, off.wall_s)}")
    if "aware" in results and "rr" in results:
        aware, rr = results["aware"], results["rr"]
        for role in ("prefill", "decode"):
            print(f"cache_aware / round_robin, {role}: hit rate {aware.hit_rate(role):.1%} vs "
                  f"{rr.hit_rate(role):.1%}; busiest / least busy worker {aware.balance(role):.2f} vs "
                  f"{rr.balance(role):.2f} (bound 2)")
        kv = ratio(aware.later.total("kv_bytes", aware.urls("prefill")), rr.later.total("kv_bytes", rr.urls("prefill")))
        computed = ratio(aware.later.total("computed", aware.urls("prefill")),
                         rr.later.total("computed", rr.urls("prefill")))
        print(f"cache_aware / round_robin, turns 2 and later: KV bytes {kv}, prompt tokens computed {computed}; "
              f"TTFT p50 {ratio(aware.ttft_ms(50), rr.ttft_ms(50))}, wall {ratio(aware.wall_s, rr.wall_s)}")


if __name__ == "__main__":
    main()
