"""PNG plots of benchmark runs (matplotlib, without a display): the latency CDFs of each run, and
request throughput and goodput against the request rate of a sweep."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from splitserve.bench.stats import Record

METRICS = (("TTFT", lambda r: [r.ttft] if r.ttft is not None else []), ("ITL", lambda r: r.itls),
           ("TPOT", lambda r: [r.tpot] if r.tpot is not None else []), ("e2e", lambda r: [r.e2e]))


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plots need matplotlib: pip install 'splitserve[bench]' (make install does)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_cdfs(runs: Sequence[tuple[str, Sequence[Record]]], path: Path, title: str = "") -> Path:
    """One panel per metric (TTFT, ITL, TPOT, e2e), one CDF line per run (``(label, records)``)."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (name, values_of) in zip(axes.flat, METRICS):
        for label, records in runs:
            values = sorted(v * 1e3 for r in records if r.ok for v in values_of(r))
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "latency CDFs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep(points: Sequence[tuple[float, float, float]], path: Path, title: str = "", slos: str = "") -> Path:
    """``(rate, request throughput, goodput)`` per run of a sweep: both against the offered rate."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    rates = [p[0] for p in points]
    ax.plot(rates, [p[1] for p in points], "o-", label="throughput (completed requests/s)")
    if any(p[2] is not None for p in points):
        ax.plot(rates, [p[2] if p[2] is not None else float("nan") for p in points], "s--",
                label=f"goodput ({slos})" if slos else "goodput")
    ax.plot(rates, rates, ":", color="grey", label="offered rate")
    ax.set_xlabel("request rate (requests/s, Poisson)")
    ax.set_ylabel("requests/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "throughput and goodput against the request rate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
