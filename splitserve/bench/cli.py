"""The ``splitserve bench`` command: its options and what it prints and writes."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

DESCRIPTION = """\
A serving benchmark against any OpenAI-compatible endpoint (a splitserve router or worker, vLLM,
SGLang, ...), measured the way their own benchmarks do: streaming requests, TTFT, ITL, TPOT and
end-to-end percentiles, request and output-token throughput, goodput under SLOs.

Load: --request-rate R (Poisson arrivals; a comma-separated list is a sweep) or, without it, a
closed loop of --concurrency clients. Workloads: random prompts (--workload random) or multi-turn
agentic sessions whose context grows (--workload agentic); --cancel-fraction F of the requests hang
up early. A warm-up is sent first and not counted.

  splitserve bench --base-url http://127.0.0.1:8000 --num-requests 100 --concurrency 8
  splitserve bench --request-rate 1,2,4 --goodput ttft_ms:500 itl_ms:100 --result-json out.json --plot-dir plots
  splitserve bench --workload agentic --num-requests 8 --turns 4 --cancel-fraction 0.1
"""


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    ap.add_argument("--model", default=None, help="the model name to send (default: the server's first /v1/models)")
    ap.add_argument("--workload", default="random", choices=["random", "agentic"])
    ap.add_argument("--endpoint", default="completions", choices=["completions", "chat"],
                    help="random workload: /v1/completions or /v1/chat/completions (agentic: always chat)")
    ap.add_argument("--num-requests", type=int, default=100,
                    help="requests measured (agentic: sessions) per run (default: %(default)s)")
    ap.add_argument("--request-rate", default=None,
                    help="Poisson arrivals per second (inf: all at once); a comma-separated list is a sweep "
                         "(default: closed loop at --concurrency)")
    ap.add_argument("--concurrency", type=int, default=8, help="closed loop: clients (default: %(default)s)")
    ap.add_argument("--max-concurrency", type=int, default=None, help="Poisson: requests in flight at most")
    ap.add_argument("--input-len", type=int, default=256, help="prompt tokens (agentic: words of the first turn)")
    ap.add_argument("--output-len", type=int, default=64, help="tokens per answer (default: %(default)s)")
    ap.add_argument("--range-ratio", type=float, default=0.0, help="lengths drawn within ± this fraction")
    ap.add_argument("--prompt-format", default="ids", choices=["ids", "text"],
                    help="random prompts as token ids (exact lengths) or as words (any server)")
    ap.add_argument("--turns", type=int, default=4, help="agentic: turns per session (default: %(default)s)")
    ap.add_argument("--turn-len", type=int, default=32, help="agentic: words of each later user message")
    ap.add_argument("--think-time-s", type=float, default=0.5, help="agentic: pause between an answer and the next turn")
    ap.add_argument("--cancel-fraction", type=float, default=0.0, help="requests the client hangs up on early")
    ap.add_argument("--warmup", type=int, default=4, help="warm-up requests, not counted (default: %(default)s)")
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                    help="do not send ignore_eos (answers may then end before --output-len)")
    ap.add_argument("--goodput", nargs="*", default=[], metavar="METRIC:MS",
                    help="SLOs for goodput: ttft_ms, itl_ms (every gap), tpot_ms, e2e_ms, e.g. ttft_ms:500 itl_ms:100")
    ap.add_argument("--percentiles", default="50,90,95,99", help="percentiles shown (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=600.0, help="bound on each request (default: %(default)s)")
    ap.add_argument("--label", default=None, help="a name for this run in the JSON and the plots")
    ap.add_argument("--result-json", type=Path, default=None, help="write the results (and every record) here")
    ap.add_argument("--plot-dir", type=Path, default=None, help="write PNG plots here (latency CDFs; a sweep's "
                                                                 "throughput and goodput against the rate)")


def _rates(text):
    if text is None:
        return [None]
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"splitserve bench: --request-rate takes numbers, not {text!r}") from None
    if not rates or not all(r > 0 for r in rates):
        raise SystemExit("splitserve bench: --request-rate must be positive")
    return rates


def main(args: argparse.Namespace) -> int:
    import asyncio

    from splitserve.bench import load as loads
    from splitserve.bench.client import Target
    from splitserve.bench.stats import parse_slos, summarize
    from splitserve.bench.workload import Workload

    try:
        slos = parse_slos(args.goodput)
        percentiles = [float(p) for p in args.percentiles.split(",")]
        workload = Workload(kind=args.workload, input_len=args.input_len, output_len=args.output_len,
                            range_ratio=args.range_ratio, prompt_format=args.prompt_format,
                            endpoint="chat" if args.workload == "agentic" else args.endpoint, turns=args.turns,
                            turn_len=args.turn_len, think_s=args.think_time_s, cancel_fraction=args.cancel_fraction,
                            seed=args.seed).check()
    except ValueError as exc:
        print(f"splitserve bench: {exc}", file=sys.stderr)
        return 2
    if args.num_requests < 1 or args.concurrency < 1:
        print("splitserve bench: --num-requests and --concurrency must be at least 1", file=sys.stderr)
        return 2
    base = args.base_url.rstrip("/")
    model = args.model or _served_model(base)
    target = Target(base, model, args.ignore_eos)
    label = args.label or base
    print(f"splitserve bench: {base} model {model}  workload {workload.kind}  input {workload.input_len}  "
          f"output {workload.output_len}  {args.num_requests} {'sessions' if workload.kind == 'agentic' else 'requests'}"
          f"  cancel {workload.cancel_fraction:g}  SLOs {' '.join(args.goodput) or '-'}", flush=True)
    results = []
    for rate in _rates(args.request_rate):
        load = loads.Load(requests=args.num_requests, rate=rate, concurrency=args.concurrency,
                          max_concurrency=args.max_concurrency, warmup=args.warmup, timeout_s=args.timeout_s)
        run = asyncio.run(loads.run(target, workload, load))
        summary = summarize(run.records, run.duration_s, slos, percentiles)
        results.append((rate, run, summary))
        print(report(rate, load, summary, percentiles), flush=True)
    if args.result_json is not None:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(_finite({
            "label": label, "base_url": base, "model": model, "workload": workload.__dict__, "slos_ms": slos,
            "runs": [{"rate": rate, "concurrency": None if rate is not None else args.concurrency,
                      "started_at": run.started_at, "summary": summary.to_dict(),
                      "records": [r.to_dict() for r in run.records]} for rate, run, summary in results],
        }), indent=1, allow_nan=False))
        print(f"results: {args.result_json}")
    if args.plot_dir is not None:
        from splitserve.bench import plots

        args.plot_dir.mkdir(parents=True, exist_ok=True)
        runs = [(f"{label} " + (f"rate {rate:g}/s" if rate is not None else f"concurrency {args.concurrency}"),
                 run.records) for rate, run, _ in results]
        print(f"plot: {plots.latency_cdfs(runs, args.plot_dir / 'latency_cdf.png', title=label)}")
        if len(results) > 1 and results[0][0] is not None:
            points = [(rate, s.request_throughput, s.goodput) for rate, _, s in results]
            print(f"plot: {plots.sweep(points, args.plot_dir / 'throughput_goodput.png', label, ' '.join(args.goodput))}")
    failed = sum(s.failed for _, _, s in results)
    return 1 if failed and not any(s.completed for _, _, s in results) else 0


def report(rate, load, s, percentiles) -> str:
    head = f"rate {rate:g}/s (Poisson)" if rate is not None else f"concurrency {load.concurrency} (closed loop)"
    lines = [f"\n== {head}: {s.completed} completed, {s.failed} failed, {s.cancelled} cancelled "
             f"in {s.duration_s:.2f} s",
             f"   requests/s {s.request_throughput:.3f}   output tokens/s {s.output_throughput:.1f}   "
             f"input tokens/s {s.input_throughput:.1f}"]
    if s.goodput is not None:
        lines.append(f"   goodput {s.goodput:.3f} requests/s ({s.goodput_fraction:.1%} of the completed ones met the SLOs)")
    cols = ["mean"] + [f"p{p:g}" for p in percentiles]
    lines.append("   " + f"{'ms':<6}" + "".join(f"{c:>10}" for c in cols))
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        d = getattr(s, name)
        lines.append("   " + f"{name[:-3].upper():<6}" + "".join(f"{d[c]:>10.1f}" for c in cols))
    for error in s.errors[:3]:
        lines.append(f"   error: {error}")
    return "\n".join(lines)


def _served_model(base: str):
    import urllib.request

    try:
        with urllib.request.urlopen(base + "/v1/models", timeout=10) as resp:
            data = json.loads(resp.read()).get("data") or []
            return data[0]["id"] if data else None
    except Exception as exc:
        raise SystemExit(f"splitserve bench: cannot ask {base}/v1/models for the model ({exc}); "
                         "pass --model or check --base-url") from None


def _finite(value):
    """JSON has no NaN or infinity: they become null (a rate of inf stays as the string "inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value == math.inf else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
