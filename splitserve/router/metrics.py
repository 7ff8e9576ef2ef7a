"""The router's Prometheus metrics (prefix ``splitserve_router_``), on the process's own registry
(``docs/metrics.md`` lists every one).

- ``requests_total{outcome}``: every generation request, counted once when it ends, by its
  :class:`~splitserve.router.outcomes.RouterOutcome` (the label is its value).
- ``pd_decisions_total{decision}``: ``split``, ``alone`` (``split.py``), and ``fallback`` (a split
  request sent to decode alone after its prefill failed).
- ``retries_total{role,cause}``: legs tried again on another worker (``retry.CAUSES``), and
  ``retries_denied_total{reason}``: failed legs that qualified and were not (``retry.DENIALS``).
- ``migrations_total{reason}``: requests whose decode was lost after their answer began, continued
  on another decode worker (``migrate.REASONS``; ``attempts.Attempts.after``).
- ``requests_in_flight``: generation requests now inside the router.
- ``request_seconds{outcome}``: end-to-end latency, from receipt to the end of the answer.
- ``time_to_first_token_seconds{endpoint}`` and ``inter_token_latency_seconds{endpoint}``: what a
  streaming client sees, from the SSE events the router passes on (:class:`TokenTimes`).
- ``pairings_refused_total``: healthy decode workers left out of a request's pair because they
  differ from its prefill (``WorkerSet.pick_pair``).
- ``worker_healthy{role,url}`` and ``worker_in_flight{role,url}``: derived at scrape time from the
  worker objects the router routes with (one source of truth).
"""

from __future__ import annotations

import json
import re
import time
from typing import Optional

from splitserve.metrics import Registry
from splitserve.router.outcomes import RouterOutcome
from splitserve.router.migrate import REASONS
from splitserve.router.retry import CAUSES, DENIALS
from splitserve.router.split import DECISIONS
from splitserve.router.workers import WorkerSet

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)


class TokenTimes:
    """When each SSE event that carries generated tokens passed through (fed decode's bytes as
    they are written to the client, cut at any point). A token event: a completion chunk with
    text, a chat chunk with content, any ``/generate`` chunk; not the chat stream's opening
    role-only chunk, a usage chunk, an error or ``[DONE]``."""

    def __init__(self, started: float):
        self.started = started
        self.first: Optional[float] = None
        self.gaps: list[float] = []
        self._last: Optional[float] = None
        self._tail = b""

    def feed(self, chunk: bytes, now: Optional[float] = None) -> None:
        lines = (self._tail + chunk).split(b"\n")
        self._tail = lines.pop()
        for line in lines:
            if line.startswith(b"data: ") and _carries_tokens(line[6:].rstrip(b"\r")):
                self._token(time.monotonic() if now is None else now)

    def _token(self, now: float) -> None:
        if self.first is None:
            self.first = now
        else:
            self.gaps.append(now - self._last)
        self._last = now

    @property
    def ttft(self) -> Optional[float]:
        return self.first - self.started if self.first is not None else None


# The first choice of an event as splitserve's workers write it (compact JSON, keys in this order):
# a completion's text or a chat delta's content, and its first character (a quote: empty). An
# unquoted ``"choices":[`` is the key itself, never inside a string (there every quote is escaped).
# What does not match (another server's spacing or key order, ``/generate``) is parsed whole.
_FIRST_CHOICE = re.compile(rb'"choices":\[\{"index":\d+,'
                           rb'(?:"text":"(.)|"delta":\{(?:"role":"[a-z]+",)?(?:"content":"(.)|\}))', re.DOTALL)


def _carries_tokens(data: bytes) -> bool:
    if data == b"[DONE]" or data.startswith(b'{"error"'):
        return False
    m = _FIRST_CHOICE.search(data)
    if m is not None:  # on every streamed token: a regex where json.loads of each costs six times as much
        first = m.group(1) or m.group(2)
        return first is not None and first != b'"'
    try:
        event = json.loads(data)
    except ValueError:
        return False
    if "output_ids" in event:  # /generate: every chunk is the answer so far, one more token each
        return True
    choices = event.get("choices") or ()
    choice = choices[0] if choices and isinstance(choices[0], dict) else {}
    delta = choice.get("delta")
    return bool(delta.get("content")) if isinstance(delta, dict) else bool(choice.get("text"))


class RouterMetrics:
    def __init__(self, registry: Registry, workers: WorkerSet):
        self.requests = registry.counter("splitserve_router_requests_total",
                                         "Generation requests through the router, by outcome.", ["outcome"])
        for outcome in RouterOutcome:  # every outcome shows up as 0 before it first happens
            self.requests.labels(outcome=outcome.value)
        self.in_flight = registry.gauge("splitserve_router_requests_in_flight",
                                        "Generation requests now inside the router.")
        self.seconds = registry.histogram("splitserve_router_request_seconds",
                                          "End-to-end latency: from receipt to the end of the answer, by outcome.",
                                          ["outcome"], buckets=LATENCY_BUCKETS)
        self.ttft = registry.histogram("splitserve_router_time_to_first_token_seconds",
                                       "Streaming: from receipt to the first event with generated tokens passed to "
                                       "the client.", ["endpoint"], buckets=LATENCY_BUCKETS)
        self.itl = registry.batch_histogram("splitserve_router_inter_token_latency_seconds",
                                            "Streaming: time between two consecutive events with generated tokens "
                                            "passed to the client.", ["endpoint"], buckets=ITL_BUCKETS)
        self.retries = registry.counter("splitserve_router_retries_total",
                                        "Legs tried again on another worker of their role, with a new room, by the "
                                        "role and why the leg failed.", ["role", "cause"])
        self.retries_denied = registry.counter("splitserve_router_retries_denied_total",
                                               "Failed legs that could have been tried again and were not, by why "
                                               "not.", ["reason"])
        self.pd_decisions = registry.counter("splitserve_router_pd_decisions_total",
                                             "Requests split (prefill + decode) or sent to a decode worker alone, "
                                             "and split requests that fell back to decode alone.", ["decision"])
        for decision in DECISIONS:
            self.pd_decisions.labels(decision=decision)
        for role in ("prefill", "decode"):
            for cause in CAUSES:
                self.retries.labels(role=role, cause=cause)
        for reason in DENIALS:
            self.retries_denied.labels(reason=reason)
        self.migrations = registry.counter("splitserve_router_migrations_total",
                                           "Requests whose decode worker was lost after their answer began (a "
                                           "whole answer: after its leg was sent), continued on another decode "
                                           "worker, by why the leg was given up.", ["reason"])
        for reason in REASONS:
            self.migrations.labels(reason=reason)
        registry.derived_gauge("splitserve_router_worker_healthy", "1 if the worker is in rotation, else 0.",
                               ["role", "url"],
                               read=lambda: {(w.role, w.url): int(w.healthy) for w in workers.all()})
        registry.derived_counter("splitserve_router_pairings_refused_total",
                                 "Healthy decode workers left out of a request's pair because their model "
                                 "fingerprint, protocol version or transfer backend differs from its prefill's.",
                                 read=lambda: workers.refused_pairings)
        registry.derived_gauge("splitserve_router_worker_in_flight", "Request legs now open to the worker.",
                               ["role", "url"], read=lambda: {(w.role, w.url): w.in_flight for w in workers.all()})

    def record(self, outcome: RouterOutcome, seconds: float, endpoint: str = "",
               times: Optional[TokenTimes] = None) -> None:
        self.requests.labels(outcome=outcome.value).inc()
        self.seconds.labels(outcome=outcome.value).observe(seconds)
        if times is not None and times.ttft is not None:
            self.ttft.labels(endpoint=endpoint).observe(times.ttft)
            if times.gaps:
                self.itl.observe_many(times.gaps, endpoint)
