"""``splitserve bench`` against a second, independent client on the same load: does it measure
what another client sees?

The second client is the ``openai`` Python SDK (``AsyncOpenAI``: httpx and the SDK's own SSE
decoder), timed here with its own code: TTFT is from just before ``completions.create`` to the
first chunk whose ``text`` is not empty, a request's output tokens are its usage chunk's
``completion_tokens``, throughput is completed requests (and their output tokens) over its first
send to its last end; percentiles by ``statistics``. Nothing of ``splitserve/bench/`` (its
client, load loop or statistics) is used for it: only the workload's shape is shared (random
token-id prompts of ``--input-len``, ``--output-len`` tokens with ``ignore_eos``, drawn by
:class:`~splitserve.bench.workload.Maker` from another seed, so no prompt is sent twice and
no prefix cache can favour one client).

Both run **at the same time** against one server (``--base-url``: a ``splitserve launch``
router, a ``splitserve serve`` worker, any OpenAI-compatible server), ``--concurrency``
closed-loop clients each, ``--requests`` each after a warm-up: the server is shared between them
and each sees the same conditions, so on a machine whose load changes from one minute to the
next the two are still compared under one load. ``--rounds`` times; printed: each round, and the
ratios openai SDK / splitserve bench of TTFT p50, TTFT mean, requests/s and output tokens/s
(median over rounds, with min-max). Usage::

    .venv/bin/python bench/agree.py --base-url http://127.0.0.1:8000 [--rounds 3] [--requests 16]
        [--concurrency 2] [--input-len 256] [--output-len 32]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import openai

from splitserve.bench.client import Target
from splitserve.bench.load import Load, run
from splitserve.bench.stats import summarize
from splitserve.bench.workload import Maker, Workload


async def openai_run(base: str, model: str, specs: list, warm: list, concurrency: int) -> dict:
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
    rows: list[tuple[float, float, float, int]] = []  # sent, first token, ended, output tokens

    async def one(spec, keep: bool) -> None:
        sent = time.perf_counter()
        first, tokens = None, 0
        stream = await client.completions.create(
            model=model, prompt=spec.prompt, max_tokens=spec.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text and first is None:
                first = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        ended = time.perf_counter()
        if first is None or tokens != spec.max_tokens:
            raise RuntimeError(f"openai client: {tokens} of {spec.max_tokens} tokens, first token {first}")
        if keep:
            rows.append((sent, first, ended, tokens))

    async def clients(todo: list, n: int, keep: bool) -> None:
        it = iter(todo)

        async def worker() -> None:
            for spec in it:
                await one(spec, keep)

        await asyncio.gather(*(worker() for _ in range(n)))

    try:
        await clients(warm, max(1, min(concurrency, 4)), False)
        await clients(specs, concurrency, True)
    finally:
        await client.close()
    span = max(r[2] for r in rows) - min(r[0] for r in rows)
    ttft = [(r[1] - r[0]) * 1e3 for r in rows]
    return {"requests_s": len(rows) / span, "tokens_s": sum(r[3] for r in rows) / span,
            "ttft_p50": statistics.median(ttft), "ttft_mean": statistics.fmean(ttft),
            "ttft_p90": statistics.quantiles(ttft, n=10, method="inclusive")[-1]}


async def bench_run(base: str, model: str, workload: Workload, args) -> dict:
    load = Load(requests=args.requests, concurrency=args.concurrency, warmup=args.warmup)
    result = await run(Target(base, model), workload, load)
    s = summarize(result.records, result.duration_s)
    if s.failed:
        raise SystemExit(f"splitserve bench: {s.failed} requests failed, e.g. {s.errors[0]}")
    return {"requests_s": s.request_throughput, "tokens_s": s.output_throughput, "ttft_p50": s.ttft_ms["p50"],
            "ttft_mean": s.ttft_ms["mean"], "ttft_p90": s.ttft_ms["p90"]}


async def together(base: str, model: str, workload: Workload, args, seed: int) -> tuple[dict, dict]:
    mine = Workload(**{**workload.__dict__, "seed": seed})
    other = Maker(Workload(**{**workload.__dict__, "seed": seed + 1}))
    specs = [other.random_request() for _ in range(args.requests)]
    warm = [other.random_request() for _ in range(args.warmup)]
    return tuple(await asyncio.gather(bench_run(base, model, mine, args),
                                      openai_run(base, model, specs, warm, args.concurrency)))


def spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="default: the server's first /v1/models")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    base = args.base_url.rstrip("/")
    model = args.model or openai.OpenAI(base_url=base + "/v1", api_key="none").models.list().data[0].id
    workload = Workload(input_len=args.input_len, output_len=args.output_len)
    print(f"{base} model {model}: splitserve bench and the openai SDK at the same time, {args.concurrency} "
          f"closed-loop clients and {args.requests} requests each, prompt {args.input_len} token ids, "
          f"{args.output_len} tokens out (ignore_eos), {args.rounds} rounds", flush=True)
    runs: dict[str, list[dict]] = {"bench": [], "openai": []}
    for r in range(args.rounds):
        got = asyncio.run(together(base, model, workload, args, seed=args.seed + 2 * r))
        for name, one in zip(("bench", "openai"), got):
            runs[name].append(one)
            print(f"  round {r + 1} {name:<7} {one['requests_s']:6.3f} req/s  {one['tokens_s']:7.1f} tok/s  TTFT "
                  f"p50 {one['ttft_p50']:7.1f} ms  mean {one['ttft_mean']:7.1f} ms  p90 {one['ttft_p90']:7.1f} ms",
                  flush=True)
    print("\nopenai SDK / splitserve bench (median over rounds, min-max):")
    for key, label in (("ttft_p50", "TTFT p50"), ("ttft_mean", "TTFT mean"), ("requests_s", "requests/s"),
                       ("tokens_s", "output tokens/s")):
        ratios = [o[key] / b[key] for b, o in zip(runs["bench"], runs["openai"])]
        print(f"  {label:<16} {spread(ratios, '.3f')}x   bench {spread([b[key] for b in runs['bench']], '.1f')}"
              f"   openai {spread([o[key] for o in runs['openai']], '.1f')}")


if __name__ == "__main__":
    main()
