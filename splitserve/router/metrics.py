"""The router's Prometheus metrics (prefix ``splitserve_router_``), on the process's own registry.

- ``requests_total{outcome}``: every generation request, counted once when it ends. Outcomes:
  ``finished`` (the decode worker's 2xx answer was passed through whole), ``bad_request`` (refused
  by the router's validation: 400/404), ``no_workers`` (503: no healthy prefill or decode worker),
  ``prefill_failed`` (the prefill leg failed first: its error was returned and the decode leg
  closed), ``decode_failed`` (the decode worker answered an error, could not be reached, or broke
  off its stream, or ended it without ``[DONE]``), ``client_disconnect``, ``client_timeout`` (the
  client did not send its body within ``client_body_timeout_s``, 408, or stopped reading for
  ``client_write_timeout_s``), ``timeout`` (``request_timeout_s`` passed), ``internal`` (a bug).
- ``requests_in_flight``: generation requests now inside the router.
- ``request_seconds{outcome}``: time from receipt to the end of the answer.
- ``worker_healthy{role,url}`` and ``worker_in_flight{role,url}``: derived at scrape time from the
  worker objects the router routes with (one source of truth).
"""

from __future__ import annotations

from splitserve.metrics import Registry
from splitserve.router.workers import WorkerSet

OUTCOMES = ("finished", "bad_request", "no_workers", "prefill_failed", "decode_failed", "client_disconnect",
            "client_timeout", "timeout", "internal")


class RouterMetrics:
    def __init__(self, registry: Registry, workers: WorkerSet):
        self.requests = registry.counter("splitserve_router_requests_total",
                                         "Generation requests through the router, by outcome.", ["outcome"])
        for outcome in OUTCOMES:  # every outcome shows up as 0 before it first happens
            self.requests.labels(outcome=outcome)
        self.in_flight = registry.gauge("splitserve_router_requests_in_flight",
                                        "Generation requests now inside the router.")
        self.seconds = registry.histogram("splitserve_router_request_seconds",
                                          "Time from receipt to the end of the answer, by outcome.", ["outcome"])
        registry.gauge("splitserve_router_worker_healthy", "1 if the worker is in rotation, else 0.",
                       ["role", "url"], callback=lambda: {(w.role, w.url): int(w.healthy) for w in workers.all()})
        registry.gauge("splitserve_router_worker_in_flight", "Request legs now open to the worker.",
                       ["role", "url"], callback=lambda: {(w.role, w.url): w.in_flight for w in workers.all()})

    def record(self, outcome: str, seconds: float) -> None:
        self.requests.labels(outcome=outcome).inc()
        self.seconds.labels(outcome=outcome).observe(seconds)
