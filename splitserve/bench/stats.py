"""The benchmark's statistics, computed from recorded times alone (so tests feed them made-up ones).

Per request (a :class:`Record`), as vLLM's and SGLang's serving benchmarks define them:

- **TTFT**: from sending the request to the first event that carried generated tokens;
- **ITL**: the gaps between consecutive such events (an event may carry more than one token);
- **TPOT**: ``(e2e - TTFT) / (output tokens - 1)``, the mean time per token after the first;
- **e2e**: from sending to the end of the answer.

Over a run (:func:`summarize`): mean and percentiles of each (``numpy.percentile``, linear),
request and output-token throughput (completed requests, and their output tokens, over the run's
wall time: first send to last end), and **goodput**: completed requests per second that met every
SLO given (``ttft_ms:500 itl_ms:100 tpot_ms:50 e2e_ms:5000``; ``itl_ms`` holds for every gap of the
request, ``tpot_ms`` for its mean). Failed and cancelled requests count in neither throughput nor
the latencies; they are counted apart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np

SLO_METRICS = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")
DEFAULT_PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class Record:
    """One request as the client saw it; times are seconds on one clock (the run's)."""

    sent: float
    ended: float
    token_times: tuple[float, ...] = ()
    """When each event that carried generated tokens arrived."""
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: Optional[str] = None
    cancelled: bool = False
    """The client hung up on purpose (the workload's cancellation fraction)."""
    session: int = -1
    turn: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled

    @property
    def ttft(self) -> Optional[float]:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2e(self) -> float:
        return self.ended - self.sent

    @property
    def tpot(self) -> Optional[float]:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        return asdict(self)


def parse_slos(items: Iterable[str]) -> dict[str, float]:
    """``["ttft_ms:500", "itl_ms:100"]`` -> ``{"ttft_ms": 500.0, "itl_ms": 100.0}``; a clear error otherwise."""
    slos = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"an SLO is METRIC:MILLISECONDS with METRIC one of {', '.join(SLO_METRICS)}, not {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if not slos[name] > 0:
            raise ValueError(f"SLO {item!r}: the bound must be positive")
    return slos


def meets(r: Record, slos: dict[str, float]) -> bool:
    """A completed request met every SLO in ``slos`` (milliseconds)."""
    if not r.ok:
        return False
    for name, bound_ms in slos.items():
        bound = bound_ms / 1e3
        if name == "ttft_ms" and (r.ttft is None or r.ttft > bound):
            return False
        if name == "itl_ms" and any(gap > bound for gap in r.itls):
            return False
        if name == "tpot_ms" and r.tpot is not None and r.tpot > bound:
            return False
        if name == "e2e_ms" and r.e2e > bound:
            return False
    return True


def distribution(values: Sequence[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict:
    """Mean, std, min, max and percentiles of ``values`` in milliseconds (NaN when there are none)."""
    if not len(values):
        nan = float("nan")
        return {"n": 0, "mean": nan, "std": nan, "min": nan, "max": nan, **{f"p{p:g}": nan for p in percentiles}}
    ms = np.asarray(values, dtype=float) * 1e3
    out = {"n": int(ms.size), "mean": float(ms.mean()), "std": float(ms.std()), "min": float(ms.min()),
           "max": float(ms.max())}
    out.update({f"p{p:g}": float(np.percentile(ms, p)) for p in percentiles})
    return out


@dataclass
class Summary:
    duration_s: float
    completed: int
    failed: int
    cancelled: int
    request_throughput: float
    output_throughput: float
    input_throughput: float
    goodput: Optional[float]
    """Completed requests per second that met every SLO (None without SLOs)."""
    goodput_fraction: Optional[float]
    ttft_ms: dict = field(default_factory=dict)
    itl_ms: dict = field(default_factory=dict)
    tpot_ms: dict = field(default_factory=dict)
    e2e_ms: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)
    """The first few error messages."""

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(records: Sequence[Record], duration_s: Optional[float] = None, slos: Optional[dict] = None,
              percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> Summary:
    """The run's figures; ``duration_s`` defaults to the first send to the last end."""
    if duration_s is None:
        duration_s = (max(r.ended for r in records) - min(r.sent for r in records)) if records else 0.0
    ok = [r for r in records if r.ok]
    span = duration_s if duration_s > 0 else float("nan")
    good = sum(meets(r, slos) for r in ok) if slos else None
    return Summary(
        duration_s=duration_s, completed=len(ok), failed=sum(r.error is not None for r in records),
        cancelled=sum(r.cancelled and r.error is None for r in records),
        request_throughput=len(ok) / span, output_throughput=sum(r.output_tokens for r in ok) / span,
        input_throughput=sum(r.prompt_tokens for r in ok) / span,
        goodput=good / span if slos else None, goodput_fraction=(good / len(ok) if ok else 0.0) if slos else None,
        ttft_ms=distribution([r.ttft for r in ok if r.ttft is not None], percentiles),
        itl_ms=distribution([g for r in ok for g in r.itls], percentiles),
        tpot_ms=distribution([r.tpot for r in ok if r.tpot is not None], percentiles),
        e2e_ms=distribution([r.e2e for r in ok], percentiles),
        errors=[r.error for r in records if r.error is not None][:5],
    )
