"""What disaggregation is for on one host: decode's inter-token latency while long prompts arrive.

Streaming chats (short prompts, ``--chat-output`` tokens each, Poisson arrivals at ``--chat-rate``)
with long prompts (``--long-prompt`` tokens, ``--long-output`` tokens each) arriving among them at
a fixed rate (evenly spaced over the chats' expected span), against

  colocated  ``splitserve serve``: one worker, chunked prefill (``--max-batch-tokens`` a step), so a
             long prompt's chunks share the engine's steps with the chats' decoding
  split      ``splitserve launch --router-args "--pd-threshold-tokens 0"``: the router, 1 prefill and 1
             decode worker on split CPUs, every request split (a long prompt never runs on decode)
  routed     the same pair with the router's own choice (its default ``--pd-threshold-tokens``): a
             chat's short prompt runs on the decode worker alone (no wait behind a long prompt on
             the prefill core, no transfer), a long prompt is split

one after the other in one run (only one is up at a time), the same requests at the same times
(``--deployments`` picks them; split is always first).
The long prompts' rate is sized from the prefill capacity measured first, on the split deployment's
prefill worker (long prompts alone, one at a time, 1 token each: prompt tokens / TTFT), at
``--long-load`` of it (default half: the prefill worker kept below saturation; at least one long
prompt, so on a slow machine the share printed is above the one asked). Prints the model,
the sizes and rates, then for each deployment the chats' ITL p50/p99/max, TTFT p50/p99 and goodput
(chats a second meeting every ``--slo``; default TTFT <= 3 s and every gap <= 250 ms), the long
prompts' TTFT p50, and the ratios split / colocated (targets: ITL p99 <= 0.5x, goodput >= 1x); a
PNG of the chats' latency CDFs (``--plot``). A long prompt's chunk steps stretch the gaps of the
chats decoding at that moment: their share of all the chats' gaps follows the long prompts' rate
and their chunks a prompt (``--max-batch-tokens``), not the chat rate, and where it is under 1 %
the p99 does not see them; the worst gap (max) is what a long prompt costs the chats it meets. The load average is
printed at each step: on a machine shared with other work, read the figures with it. Usage::

    .venv/bin/python bench/interference.py [--model smollm2] [--chats 32] [--chat-rate 0.5]
        [--chat-prompt 64] [--chat-output 128] [--long-prompt 2048] [--long-output 8]
        [--long-load 0.5] [--max-batch-tokens 512] [--slo ttft_ms:3000 --slo itl_ms:250] [--plot PATH]
        [--deployments split,colocated,routed]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import free_port  # noqa: E402
from serving import LOG_DIR, Deployment  # noqa: E402

from splitserve.bench.client import Target, send  # noqa: E402
from splitserve.bench.load import Load, run  # noqa: E402
from splitserve.bench.plots import latency_cdfs  # noqa: E402
from splitserve.bench.stats import Record, Summary, parse_slos, summarize  # noqa: E402
from splitserve.bench.workload import Maker, Workload  # noqa: E402


DEPLOYMENTS = ("split", "colocated", "routed")


def command(name: str, args: argparse.Namespace, port: int) -> list[str]:
    if name == "colocated":
        return ["serve", "--model", args.model, "--host", "127.0.0.1", "--port", str(port),
                "--max-batch-tokens", str(args.max_batch_tokens), "--chunked-prefill"]
    router = ["--router-args", "--pd-threshold-tokens 0"] if name == "split" else []  # routed: its default
    return ["launch", "--model", args.model, "--port", str(port), "--transfer-backend", args.backend, *router,
            "--worker-args", f"--max-batch-tokens {args.max_batch_tokens}"]


def load_average() -> str:
    return f"load average {os.getloadavg()[0]:.1f}"


async def prefill_capacity(target: Target, args: argparse.Namespace) -> float:
    """Prompt tokens a second of long prompts sent one at a time, 1 token each (after one unmeasured)."""
    maker = Maker(Workload(input_len=args.long_prompt, output_len=1, seed=99).check())
    ttfts = []
    async with aiohttp.ClientSession(trust_env=False, timeout=aiohttp.ClientTimeout(total=600)) as session:
        for i in range(1 + args.calibrate):
            record, _ = await send(session, target, maker.random_request(), time.perf_counter)
            if not record.ok:
                raise SystemExit(f"calibration request failed: {record.error}")
            if i:
                ttfts.append(record.ttft)
    return args.long_prompt / statistics.median(ttfts)


async def evenly(target: Target, longs: Workload, n: int, window_s: float) -> list[Record]:
    """``n`` long prompts at even intervals over the window (the middle of each of n slots)."""
    maker, records = Maker(longs), []
    async with aiohttp.ClientSession(trust_env=False, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        t0 = time.perf_counter()
        clock = lambda: time.perf_counter() - t0  # noqa: E731

        async def one(at: float) -> None:
            await asyncio.sleep(at)
            record, _ = await send(session, target, maker.random_request(), clock)
            records.append(record)

        await asyncio.gather(*(one(window_s * (k + 0.5) / n) for k in range(n)))
    return records


async def mixed(target: Target, chats: Workload, chat_load: Load, longs: Workload, n_long: int, window_s: float):
    """Both streams at once: the chats on their Poisson clock (the same draws for every deployment),
    the long prompts evenly over the chats' expected window."""
    return await asyncio.gather(run(target, chats, chat_load), evenly(target, longs, n_long, window_s))


def worst_gap_ms(records: list[Record]) -> float:
    return 1000 * max((gap for r in records if r.ok for gap in r.itls), default=float("nan"))


def row(name: str, chats: Summary, longs: Summary, worst: float) -> str:
    goodput = f"{chats.goodput:.3f}/s ({chats.goodput_fraction:.0%})"
    return (f"{name:<10} {chats.itl_ms['p50']:>9.1f} {chats.itl_ms['p99']:>9.1f} {worst:>9.0f} "
            f"{chats.ttft_ms['p50']:>10.0f} "
            f"{chats.ttft_ms['p99']:>10.0f} {goodput:>16} {chats.completed:>6} {longs.ttft_ms['p50']:>13.0f} "
            f"{longs.completed:>6}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--backend", default="nixl", choices=["nixl", "tcp"])
    ap.add_argument("--chats", type=int, default=32, help="chats measured per deployment")
    ap.add_argument("--chat-rate", type=float, default=0.5, help="chats a second (Poisson)")
    ap.add_argument("--chat-prompt", type=int, default=64, help="words of a chat's message")
    ap.add_argument("--chat-output", type=int, default=128)
    ap.add_argument("--long-prompt", type=int, default=2048, help="tokens of a long prompt")
    ap.add_argument("--long-output", type=int, default=8)
    ap.add_argument("--long-load", type=float, default=0.5,
                    help="long prompts' share of the measured prefill capacity (default: half)")
    ap.add_argument("--calibrate", type=int, default=2, help="long prompts timed alone for the capacity")
    ap.add_argument("--max-batch-tokens", type=int, default=512, help="every worker's step budget")
    ap.add_argument("--slo", action="append", default=None, help="METRIC:MS (default ttft_ms:3000, itl_ms:250)")
    ap.add_argument("--plot", default=None, help="PNG of the chats' latency CDFs (default: in the log folder)")
    ap.add_argument("--deployments", default=",".join(DEPLOYMENTS),
                    help=f"comma-separated, of {', '.join(DEPLOYMENTS)} (split is always measured first: its "
                         "prefill worker sizes the long prompts)")
    args = ap.parse_args()
    wanted = {d.strip() for d in args.deployments.split(",") if d.strip()}
    if wanted - set(DEPLOYMENTS) or "colocated" not in wanted:
        ap.error(f"--deployments: of {', '.join(DEPLOYMENTS)}, colocated among them (the ratios are against it)")
    names = [d for d in DEPLOYMENTS if d in wanted or d == "split"]
    slos = parse_slos(args.slo or ["ttft_ms:3000", "itl_ms:250"])
    chats = Workload(input_len=args.chat_prompt, output_len=args.chat_output, endpoint="chat",
                     prompt_format="text", seed=1).check()
    longs = Workload(input_len=args.long_prompt, output_len=args.long_output, seed=2).check()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"model {args.model}  {cpus} CPUs  chats: {args.chats} at {args.chat_rate}/s, {args.chat_prompt}-word "
          f"messages, {args.chat_output} tokens out  long prompts: {args.long_prompt} tokens, {args.long_output} out  "
          f"--max-batch-tokens {args.max_batch_tokens}  SLO {slos}  logs {LOG_DIR}", flush=True)

    results: dict[str, tuple[Summary, Summary, list[Record]]] = {}
    long_rate = n_long = window = None
    for name in names:  # split first: its prefill worker's capacity sizes the long prompts
        port = free_port()
        dep = Deployment(name, command(name, args, port), port, name)
        try:
            dep.wait_healthy()
            target = Target(dep.url)
            if long_rate is None:
                capacity = asyncio.run(prefill_capacity(target, args))
                window = args.chats / args.chat_rate  # the chats' expected span
                n_long = max(1, round(window * args.long_load * capacity / args.long_prompt))
                long_rate = n_long / window
                print(f"prefill capacity (split, prefill worker): {capacity:.0f} prompt tokens/s -> {n_long} long "
                      f"prompts evenly over the chats' {window:.0f} s: {long_rate:.3f}/s, "
                      f"{long_rate * args.long_prompt / capacity:.0%} of it (asked: {args.long_load:.0%}); "
                      f"{load_average()}", flush=True)
            warm = Load(requests=2, concurrency=1, warmup=0)
            asyncio.run(run(target, chats, warm))
            chat_run, long_records = asyncio.run(mixed(target, chats, Load(requests=args.chats, rate=args.chat_rate,
                                                                            warmup=0), longs, n_long, window))
        finally:
            dep.stop()
        c, lo = summarize(chat_run.records, chat_run.duration_s, slos), summarize(long_records)
        if c.failed or lo.failed:  # counted against goodput and shown; the run goes on
            print(f"  {name}: {c.failed} chats and {lo.failed} long prompts failed, e.g. {(c.errors + lo.errors)[0]}; "
                  f"see {dep.log}", flush=True)
        results[name] = (c, lo, chat_run.records)
        print(f"  {name} done: {load_average()}", flush=True)

    print("\nthe chats' ITL and TTFT (ms) and goodput; the long prompts' TTFT (ms)")
    print(f"{'':<10} {'ITL p50':>9} {'ITL p99':>9} {'ITL max':>9} {'TTFT p50':>10} {'TTFT p99':>10} "
          f"{'goodput':>16} "
          f"{'chats':>6} {'long TTFT p50':>13} {'longs':>6}")  # chats, longs: completed
    for name, (c, lo, recs) in results.items():
        print(row(name, c, lo, worst_gap_ms(recs)))
    cc, _, crecs = results["colocated"]
    for name in (n for n in results if n != "colocated"):
        sc, _, srecs = results[name]
        print(f"\n{name} / colocated: chats' ITL p99 {sc.itl_ms['p99'] / cc.itl_ms['p99']:.2f}x (target <= 0.5x), "
              f"ITL max {worst_gap_ms(srecs) / worst_gap_ms(crecs):.2f}x, "
              f"ITL p50 {sc.itl_ms['p50'] / cc.itl_ms['p50']:.2f}x, "
              f"TTFT p99 {sc.ttft_ms['p99'] / cc.ttft_ms['p99']:.2f}x, "
              f"goodput {sc.goodput / cc.goodput if cc.goodput else float('inf'):.2f}x (target >= 1x)")
    plot = Path(args.plot) if args.plot else LOG_DIR / "interference.png"
    latency_cdfs([(f"{name} chats", recs) for name, (_, _, recs) in results.items()], plot,
                 f"{args.model}: chats with {args.long_prompt}-token prompts arriving at {long_rate:.3f}/s")
    print(f"plot: {plot}")


if __name__ == "__main__":
    main()
