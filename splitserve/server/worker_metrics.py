"""The worker's metrics, registered on the app's own :class:`~splitserve.metrics.Registry`.

KV pages and queue sizes are derived gauges: they call ``engine.stats()`` when ``/metrics`` is
scraped, so they always show what the engine loop last published, never a copy kept in step by
hand. Counters and histograms are recorded by the HTTP handlers, one per request at its end.
"""

from __future__ import annotations

from splitserve.metrics import Registry

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class WorkerMetrics:
    def __init__(self, registry: Registry, engine, role: str):
        self.role = role
        self._engine = engine
        self._started = False

        registry.gauge("splitserve_ready", "1 when the worker accepts requests, 0 while loading or draining.",
                       callback=lambda: 1 if engine.ready and not engine.draining else 0)
        registry.gauge("splitserve_engine_loop_age_seconds",
                       "Seconds since the engine loop last began an iteration, read at scrape time (an idle loop "
                       "begins one at least every 0.5 s; past --loop-stall-s the worker is wedged).",
                       callback=lambda: round(engine.loop_age(), 3) if getattr(engine, "ready", False)
                       and hasattr(engine, "loop_age") else None)
        registry.gauge("splitserve_kv_pages_free", "Free KV cache pages.",
                       callback=lambda: self._stat("pages_free"))
        registry.gauge("splitserve_kv_pages_total", "KV cache pages in the pool.",
                       callback=lambda: self._stat("pages_total"))
        registry.gauge("splitserve_queue_requests", "Requests in each engine queue.", ["role", "queue"],
                       callback=lambda: {(role, q): n for q, n in (self._stat("queues") or {}).items()})
        registry.gauge("splitserve_lifecycle_entries",
                       "Prefill/decode bookkeeping that is not a live request: tombstones, pending registrations, "
                       "rooms holding memory after their end (held_writes, quarantined).", ["role", "kind"],
                       callback=lambda: {(role, k): n for k, n in (self._stat("lifecycle") or {}).items()})
        registry.gauge("splitserve_preemptions", "Sequences preempted for lack of KV pages since start (each "
                       "recomputes its KV when it runs again).", callback=lambda: self._stat("preemptions"))
        registry.gauge("splitserve_kv_pages_quarantined",
                       "Decode: KV pages kept out of use because a remote write may still land in them.",
                       callback=lambda: self._stat("pages_quarantined"))
        if role != "colocated":
            registry.gauge("splitserve_peers", "Prefill/decode: peers that live rooms depend on (live), and peers "
                           "declared lost and still remembered (lost).", ["role", "state"],
                           callback=lambda: {(role, k): n for k, n in (self._stat("peers") or {}).items()})
            registry.gauge("splitserve_peer_silence_seconds",
                           "Prefill/decode: seconds since each live peer was last heard from (declared lost after "
                           "heartbeat_interval_s x heartbeat_misses).", ["role", "peer"],
                           callback=lambda: {(role, k): v for k, v in (self._stat("peer_silence") or {}).items()})
            registry.gauge("splitserve_control_sessions", "Prefill/decode: control sessions with peers known now "
                           "(each silent one is ended after the peer-silence bound).", ["role"],
                           callback=lambda: self._of_role("control", "sessions"))
            registry.gauge("splitserve_control_ended_sessions", "Prefill: decode sessions that ended and are "
                           "remembered (never answered again; forgotten after --tombstone-s).", ["role"],
                           callback=lambda: self._of_role("control", "ended"))
            registry.gauge("splitserve_transfer_peers", "Prefill: peers with a transfer connection (a NIXL remote "
                           "agent each).", ["role"], callback=lambda: self._of_role("transfer_peers"))
            registry.gauge("splitserve_control_bad_frames_total", "Prefill/decode: control frames dropped "
                           "since start, by why (identity, frames, decode, incarnation, unregistered, ...).",
                           ["role", "why"],
                           callback=lambda: {(role, k): n for k, n in (self._stat("bad_frames") or {}).items()})
            registry.gauge("splitserve_thread_age_seconds", "Prefill/decode: seconds since each supervised thread "
                           "began its last iteration (past --loop-stall-s it hangs: /health fails).", ["role", "thread"],
                           callback=lambda: {(role, k): v for k, v in (self._stat("thread_age") or {}).items()})
            registry.gauge("splitserve_thread_restarts_total", "Prefill/decode: restarts of each supervised "
                           "thread since start (a crash that was caught).", ["role", "thread"],
                           callback=lambda: {(role, k): n for k, n in (self._stat("thread_restarts") or {}).items()})
        if role == "decode":
            registry.gauge("splitserve_receive_links_open", "Decode: receiving links open, one per prefill session.",
                           callback=lambda: self._stat("links_open"))
            registry.gauge("splitserve_receive_links_fenced",
                           "Decode: receiving links closed since start to fence a lost prefill session.",
                           callback=lambda: self._stat("links_fenced"))
        self.http_inflight = registry.gauge("splitserve_http_inflight_requests",
                                            "Generation requests the HTTP front end is serving now.")
        self.requests = registry.counter(
            "splitserve_requests_total",
            "Generation requests by terminal outcome (finished, aborted, failed) and reason.",
            ["role", "outcome", "reason"])
        self.http_requests = registry.counter("splitserve_http_requests_total", "HTTP requests by route and status.",
                                              ["path", "status"])
        self.prompt_tokens = registry.counter("splitserve_prompt_tokens_total", "Prompt tokens of finished requests.",
                                              ["role"])
        self.generation_tokens = registry.counter("splitserve_generation_tokens_total",
                                                  "Tokens generated (all requests, also failed ones).", ["role"])
        self.request_seconds = registry.histogram("splitserve_request_duration_seconds",
                                                  "Time from arrival to the end of a generation request.",
                                                  ["role", "endpoint", "outcome"], buckets=LATENCY_BUCKETS)
        self.state_seconds = registry.histogram("splitserve_state_seconds",
                                                "Prefill/decode: time a request spent in each lifecycle state.",
                                                ["role", "state"], buckets=LATENCY_BUCKETS)
        if role != "colocated":  # the lifecycle counts its rooms' ends, with the lifecycle's reasons
            engine.role.on_outcome = lambda outcome, reason: self.requests.labels(role, outcome, reason).inc()
            engine.role.on_state_time = lambda state, s: self.state_seconds.labels(role, state).observe(s)
        self.ttft_seconds = registry.histogram("splitserve_time_to_first_token_seconds",
                                               "Time from arrival to the first generated token.",
                                               ["role", "endpoint"], buckets=LATENCY_BUCKETS)

    def _of_role(self, key: str, part: str | None = None):
        """``{(role,): value}`` of one stat (or one part of it), nothing while there is none."""
        value = self._stat(key)
        if part is not None:
            value = (value or {}).get(part)
        return {(self.role,): value} if value is not None else None

    def _stat(self, key: str):
        """One field of ``engine.stats()``; None (no sample) until the engine has started."""
        if not self._started:
            if not self._engine.ready:
                return None
            self._started = True
        return self._engine.stats().get(key)

    def record(self, endpoint: str, outcome: str, reason: str, seconds: float, prompt_tokens: int = 0,
               completion_tokens: int = 0, ttft: float | None = None, submitted: bool = False) -> None:
        # a prefill/decode worker's lifecycle counts every request its engine took (above)
        if self.role == "colocated" or not submitted:
            self.requests.labels(role=self.role, outcome=outcome, reason=reason).inc()
        self.request_seconds.labels(role=self.role, endpoint=endpoint, outcome=outcome).observe(seconds)
        if outcome == "finished":
            self.prompt_tokens.labels(role=self.role).inc(prompt_tokens)
        if completion_tokens:
            self.generation_tokens.labels(role=self.role).inc(completion_tokens)
        if ttft is not None:
            self.ttft_seconds.labels(role=self.role, endpoint=endpoint).observe(ttft)
