"""The worker's metrics, on the app's own :class:`~splitserve.metrics.Registry` (``docs/metrics.md``
lists every one).

Derived metrics read ``engine.stats()`` (a ``WorkerStats``: the engine's pools and queues and the
role's live counters, never a copy the engine loop publishes) and ``engine.debug_requests()`` (the rooms as
they are now) when ``/metrics`` is scraped. So a wedged engine loop shows: its age grows
(``splitserve_engine_loop_age_seconds``) and so does the count of requests past half their
deadline (``splitserve_requests_late``, computed from the clock at scrape time), while the queue
gauges stay where the loop left them. A label set (a peer, a thread, a state) is there exactly as
long as the structure that owns it has it: nothing is left behind when a peer goes.

Recorded: counters and histograms by the HTTP handlers (one per request at its end: outcome,
end-to-end latency, time to first token, the gaps between tokens), by the lifecycle
(``splitserve_requests_total`` of a prefill or decode worker, time in each state) and by the
role's timelines (queue time; a prefill worker's KV writes and transfers; failed transfers).

A prefill or decode worker has the metrics of both roles (it may become the other: ``POST /role``),
each series labelled with the role it has now (:meth:`WorkerMetrics.attach`); those of the role it
does not have are empty.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Mapping

from splitserve.disagg.lifecycle.transitions import BY_ROLE, Waits
from splitserve.engine.worker_stats import DecodeStats, RoleStats, WorkerStats
from splitserve.metrics import Registry

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
BYTES_BUCKETS = tuple(float(4 ** k * 4096) for k in range(11))  # 4 KiB .. 4 GiB
# the live states where a request waits rather than runs (requests_waiting / requests_running)
WAITING_STATES = frozenset({s.value for t in BY_ROLE.values() for s in t.waiting()} | {"waiting"})
COLOCATED_STATES = ("WAITING", "RUNNING")


def states_in(*kinds: Waits, colocated: str = "") -> str:
    """The live states of each role that wait for one of ``kinds`` (none given: the states whose
    work runs), from the transition table, for help texts: ``colocated: waiting; prefill:
    BOOTSTRAPPING and QUEUED; decode: ...``; ``colocated`` names the colocated worker's queue."""
    parts = [f"colocated: {colocated}"] if colocated else []
    for role, table in BY_ROLE.items():
        chosen = table.waiting(*kinds) if kinds else set(table.live_states()) - table.waiting()
        names = [s.value for s in table.live_states() if s in chosen]
        parts.append(f"{role.value}: " + (" and ".join(names) if len(names) < 3 else
                                          ", ".join(names[:-1]) + " and " + names[-1]))
    return "; ".join(parts)


@dataclass(frozen=True)
class Derived:
    """A metric read when ``/metrics`` is scraped."""

    kind: str
    """``gauge`` or ``counter``."""
    name: str
    help: str
    labels: tuple
    read: Callable
    """Called with the :class:`WorkerMetrics`: a value, ``{labels: value}``, or None (no sample)."""
    split: bool = False
    """Prefill and decode workers only."""


@dataclass(frozen=True)
class Recorded:
    """A metric the worker records into, kept as the attribute ``attr``."""

    attr: str
    kind: str
    """The :class:`~splitserve.metrics.Registry` method that makes it."""
    name: str
    help: str
    labels: tuple = ()
    buckets: tuple = ()
    split: bool = False


class WorkerMetrics:
    def __init__(self, registry: Registry, engine, role: str):
        self.role = role
        self._engine = engine
        self._started = False
        split = role != "colocated"
        for d in DERIVED:
            if split or not d.split:
                make = registry.derived_gauge if d.kind == "gauge" else registry.derived_counter
                make(d.name, d.help, d.labels, read=functools.partial(d.read, self))
        for r in RECORDED:
            if split or not r.split:
                make = getattr(registry, r.kind)
                setattr(self, r.attr, make(r.name, r.help, r.labels, **({"buckets": r.buckets} if r.buckets else {})))
        self.attach(getattr(engine, "role", None), role)

    def attach(self, role_object, role: str) -> None:
        """Count what ``role_object`` (the engine's role: at start, and the one a switch starts,
        before it starts) reports, labelled ``role`` from now on."""
        self.role = role
        if role != "colocated" and role_object is not None:
            # the lifecycle counts its rooms' ends, with the lifecycle's reasons
            role_object.on_outcome = lambda outcome, reason: self.requests.labels(role, outcome, reason).inc()
            role_object.on_state_time = lambda state, s: self.state_seconds.labels(role, state).observe(s)
        timelines = getattr(role_object, "timelines", None)
        if timelines is not None:
            timelines.observer = self

    # -- what the role's timelines report (on the engine loop; the metric objects are thread-safe) ----

    def queue_time(self, seconds: float) -> None:
        self.queue_seconds.labels(self.role).observe(seconds)

    def write_done(self, seconds: float) -> None:
        self.write_seconds.labels(self.role).observe(seconds)

    def transfer_done(self, seconds: float, nbytes: int) -> None:
        self.transfer_seconds.labels(self.role).observe(seconds)
        self.transfer_bytes.labels(self.role).observe(nbytes)

    def transfer_failed(self, reason: str) -> None:
        self.transfer_failures.labels(self.role, reason).inc()

    # -- derived -------------------------------------------------------------------------------

    def _usage(self):
        stats = self._stats()
        e = stats.engine if stats is not None else None
        if e is None or not e.pages_total:
            return None
        owned = e.pages_total - e.pages_free - e.pages_cached
        return {(self.role,): round(owned / e.pages_total, 6)}

    def _owned(self):
        owned = self._counted("pages_owned")
        return owned - (self._decode(lambda d: d.pages_quarantined) or 0) if owned is not None else None

    def _split_queues(self, waiting: bool):
        queues = self._queues()
        if queues is None:
            return None
        live = {q: n for q, n in queues.items() if q.isupper() or self.role == "colocated"}
        return {(self.role,): sum(n for q, n in live.items() if (q in WAITING_STATES) == waiting)}

    def _late(self):
        queues = self._queues()
        if queues is None:
            return None
        states = COLOCATED_STATES if self.role == "colocated" else [q for q in queues if q.isupper()]
        late = dict.fromkeys(states, 0)
        for row in self._engine.debug_requests():
            if row.get("late") and row.get("holding") is None:
                late[row["state"]] = late.get(row["state"], 0) + 1
        return {(self.role, state): n for state, n in late.items()}

    def _oldest_quarantine(self):
        if self._stats() is None:
            return None
        ages = [row["state_age_s"] for row in self._engine.debug_requests() if row.get("holding") == "quarantined"]
        return {(self.role,): round(max(ages), 3) if ages else 0}

    def _keyed(self, read: Callable[[RoleStats], Mapping | None]):
        """``{(role, k): v}`` of one of the role's stats that is a mapping (empty while there is none)."""
        stats = self._role_stats()
        return {(self.role, k): v for k, v in ((read(stats) if stats is not None else None) or {}).items()}

    def _loop_age(self):
        engine = self._engine
        return round(engine.loop_age(), 3) if getattr(engine, "ready", False) and hasattr(engine, "loop_age") else None

    def _of_role(self, read: Callable[[RoleStats], object]):
        """``{(role,): value}`` of one of the role's stats, nothing while there is none."""
        stats = self._role_stats()
        value = read(stats) if stats is not None else None
        return {(self.role,): value} if value is not None else None

    def _counted_of_role(self, name: str):
        """``{(role,): value}`` of one of the engine's counts, nothing while there is none."""
        value = self._counted(name)
        return {(self.role,): value} if value is not None else None

    def _stats(self) -> WorkerStats | None:
        """``engine.stats()``; None (no sample) until the engine has started."""
        if not self._started:
            if not self._engine.ready:
                return None
            self._started = True
        return self._engine.stats()

    def _role_stats(self) -> RoleStats | None:
        """A prefill or decode role's stats (``WorkerStats.role``); None while there are none."""
        stats = self._stats()
        return stats.role if stats is not None else None

    def _decode(self, read: Callable[[DecodeStats], object]):
        """One of a decode role's own stats; None while there is none (another role's worker)."""
        stats = self._role_stats()
        return read(stats.decode) if stats is not None and stats.decode is not None else None

    def _counted(self, name: str):
        """One field of the engine's counts (``EngineStats``); None until the engine has started."""
        stats = self._stats()
        return getattr(stats.engine, name) if stats is not None and stats.engine is not None else None

    def _errors(self, name: str):
        """The engine loop's ``loop_errors`` or ``request_errors``; None until it has started."""
        stats = self._stats()
        return getattr(stats, name) if stats is not None else None

    def _queues(self) -> dict | None:
        stats = self._stats()
        return stats.queues if stats is not None else None

    def record(self, endpoint: str, outcome: str, reason: str, seconds: float, prompt_tokens: int = 0,
               completion_tokens: int = 0, ttft: float | None = None, submitted: bool = False,
               gaps: tuple = ()) -> None:
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
        if gaps:
            self.itl_seconds.observe_many(gaps, self.role, endpoint)


DERIVED = (
    Derived("gauge", "splitserve_ready",
            "1 when the worker accepts requests, 0 while loading or draining.",
            (), lambda m: 1 if m._engine.ready and not m._engine.draining else 0),
    Derived("gauge", "splitserve_engine_loop_age_seconds",
            "Seconds since the engine loop last moved (began an iteration, or finished a decoder "
            "layer of a forward pass), read at scrape time (an idle loop begins one at least every "
            "0.5 s; past --loop-stall-s the worker is wedged).",
            (), lambda m: m._loop_age()),
    Derived("counter", "splitserve_engine_loop_errors_total",
            "Exceptions that escaped the role into the engine loop (each failed every live request "
            "through the role).",
            (), lambda m: m._errors("loop_errors")),
    Derived("counter", "splitserve_engine_unschedulable_steps_total",
            "Engine steps that had work and could schedule none of it (no KV pages for any: overload;"
            " the loop then waits for an event instead of spinning).",
            (), lambda m: m._counted("unschedulable_steps")),
    Derived("counter", "splitserve_engine_request_errors_total",
            "Exceptions while admitting one request on the engine loop (each failed that request "
            "alone).",
            (), lambda m: m._errors("request_errors")),
    Derived("gauge", "splitserve_kv_pages_free",
            "Free KV cache pages.",
            (), lambda m: m._counted("pages_free")),
    Derived("gauge", "splitserve_kv_pages_total",
            "KV cache pages in the pool.",
            (), lambda m: m._counted("pages_total")),
    Derived("gauge", "splitserve_kv_usage_ratio",
            "KV pages owned by requests over all pages (cached pages are reclaimable and do not "
            "count; quarantined ones do).",
            ("role",), lambda m: m._usage()),
    Derived("gauge", "splitserve_queue_requests",
            "Requests in each engine queue (colocated) or lifecycle state (prefill, decode).",
            ("role", "queue"), lambda m: {(m.role, k): v for k, v in (m._queues() or {}).items()}),
    Derived("gauge", "splitserve_requests_running",
            f"Requests in the forward batch ({states_in(colocated='running')}).",
            ("role",), lambda m: m._split_queues(False)),
    Derived("gauge", "splitserve_requests_waiting",
            f"Requests waiting ({states_in(Waits.QUEUE, Waits.PEER, colocated='waiting')}).",
            ("role",), lambda m: m._split_queues(True)),
    Derived("gauge", "splitserve_requests_late",
            "Live requests past half the time their state allows (its deadline), by state; computed "
            "from the clock at scrape time, so it grows while the engine loop is wedged.",
            ("role", "state"), lambda m: m._late()),
    Derived("gauge", "splitserve_lifecycle_entries",
            "Prefill/decode bookkeeping that is not a live request: tombstones, pending "
            "registrations, rooms holding memory after their end (held_writes, quarantined).",
            ("role", "kind"), lambda m: m._keyed(lambda r: r.lifecycle)),
    Derived("gauge", "splitserve_preemptions",
            "Sequences preempted for lack of KV pages since start (each recomputes its KV when it "
            "runs again).",
            (), lambda m: m._counted("preemptions")),
    Derived("gauge", "splitserve_kv_pages_quarantined",
            "Decode: KV pages kept out of use because a remote write may still land in them.",
            (), lambda m: m._decode(lambda d: d.pages_quarantined)),
    Derived("gauge", "splitserve_kv_pages_cached",
            "KV pages in the prefix cache that no request owns (evictable: they count as available).",
            (), lambda m: m._counted("pages_cached")),
    Derived("gauge", "splitserve_kv_pages_owned",
            "KV pages owned by requests (a cached page shared by several once), quarantined ones not "
            "included.",
            (), lambda m: m._owned()),
    Derived("counter", "splitserve_prefix_cache_hit_tokens_total",
            "Prompt tokens served from the prefix cache since start.",
            ("role",), lambda m: m._counted_of_role("cache_hit_tokens")),
    Derived("counter", "splitserve_prompt_tokens_computed_total",
            "Prompt tokens whose KV this worker computed since start.",
            ("role",), lambda m: m._counted_of_role("prompt_tokens_computed")),
    Derived("counter", "splitserve_kv_transfer_bytes_total",
            "KV bytes written to decode workers (prefill) or received from prefill workers (decode) "
            "since start.",
            ("role",), lambda m: m._of_role(lambda r: r.own.kv_transfer_bytes if r.own is not None else None)),
    Derived("gauge", "splitserve_peers",
            "Prefill/decode: peers that live rooms depend on (live), and peers declared lost and "
            "still remembered (lost).",
            ("role", "state"), lambda m: m._keyed(lambda r: r.peers), split=True),
    Derived("gauge", "splitserve_peer_silence_seconds",
            "Prefill/decode: seconds since each live peer was last heard from (declared lost after "
            "heartbeat_interval_s x heartbeat_misses).",
            ("role", "peer"), lambda m: m._keyed(lambda r: r.peer_silence), split=True),
    Derived("gauge", "splitserve_control_sessions",
            "Prefill/decode: control sessions with peers known now (each silent one is ended after "
            "the peer-silence bound).",
            ("role",), lambda m: m._of_role(lambda r: r.control_sessions), split=True),
    Derived("gauge", "splitserve_control_ended_sessions",
            "Prefill: decode sessions that ended and are remembered (never answered again; forgotten "
            "after --tombstone-s).",
            ("role",), lambda m: m._of_role(lambda r: r.control_ended), split=True),
    Derived("counter", "splitserve_control_sessions_refused_total",
            "Prefill: new decode sessions refused by the session limits since start, by why (limit: "
            "--max-control-sessions; per_address: --max-control-sessions-per-address; rate: "
            "--control-session-rate).",
            ("role", "why"), lambda m: m._keyed(lambda r: r.prefill and r.prefill.sessions_refused), split=True),
    Derived("gauge", "splitserve_transfer_peers",
            "Prefill: peers with a transfer connection (a NIXL remote agent each).",
            ("role",), lambda m: m._of_role(lambda r: r.transfer_peers), split=True),
    Derived("counter", "splitserve_control_bad_frames_total",
            "Prefill/decode: control frames dropped since start, by why (identity, frames, decode, "
            "incarnation, unregistered, ...).",
            ("role", "why"), lambda m: m._keyed(lambda r: r.bad_frames), split=True),
    Derived("gauge", "splitserve_thread_age_seconds",
            "Prefill/decode: seconds since each supervised thread began its last iteration (past "
            "--loop-stall-s it hangs: /health fails).",
            ("role", "thread"), lambda m: m._keyed(lambda r: r.thread_age), split=True),
    Derived("gauge", "splitserve_zmq_io_age_seconds",
            "Prefill/decode: seconds since the ZMQ I/O thread (it moves every control socket's bytes)"
            " last moved a loopback probe, sent every 0.5 s (past --loop-stall-s it is blocked: "
            "/health fails).",
            ("role",), lambda m: m._of_role(lambda r: r.zmq_io_age), split=True),
    Derived("counter", "splitserve_thread_restarts_total",
            "Prefill/decode: restarts of each supervised thread since start (a crash that was "
            "caught).",
            ("role", "thread"), lambda m: m._keyed(lambda r: r.thread_restarts), split=True),
    Derived("counter", "splitserve_lifecycle_notices_total",
            "Prefill/decode: lifecycle notices by kind (a rejected message, a tombstone, a transfer "
            "reset, a peer declared lost...).",
            ("role", "kind"), lambda m: m._keyed(lambda r: r.notices), split=True),
    Derived("counter", "splitserve_action_failures_total",
            "Prefill/decode: table actions that raised (each failed its room through the table).",
            ("role",), lambda m: m._of_role(lambda r: r.action_failures), split=True),
    Derived("gauge", "splitserve_kv_quarantine_oldest_seconds",
            "Decode: seconds since the oldest room holding quarantined pages ended (0 when none "
            "does).",
            ("role",), lambda m: m._oldest_quarantine(), split=True),
    Derived("gauge", "splitserve_receive_links_open",
            "Decode: receiving links open, one per prefill session.",
            (), lambda m: m._decode(lambda d: d.links_open), split=True),
    Derived("gauge", "splitserve_receive_links_fenced",
            "Decode: receiving links closed since start to fence a lost prefill session.",
            (), lambda m: m._decode(lambda d: d.links_fenced), split=True),
    Derived("counter", "splitserve_kv_fallback_total",
            "Decode: rooms that learned, before their first token, that their KV would not come, and "
            "recomputed their prompt here instead of failing (--kv-failure-policy recompute), by why "
            "(peer_lost, peer_failed, transfer_timeout, ...).",
            ("reason",), lambda m: {(k,): n for k, n in (m._decode(lambda d: d.kv_fallbacks) or {}).items()}, split=True),
    Derived("counter", "splitserve_decode_prompts_computed_total",
            "Decode: prompts computed on this worker (requests that came alone, and KV fallbacks).",
            (), lambda m: m._decode(lambda d: d.prompts_computed), split=True),
)
"""The metrics read at scrape time: ``read(m)`` of the :class:`WorkerMetrics` ``m``."""


RECORDED = (
    Recorded("http_inflight", "gauge", "splitserve_http_inflight_requests",
             "Generation requests the HTTP front end is serving now."),
    Recorded("requests", "counter", "splitserve_requests_total",
             "Generation requests by terminal outcome (finished, aborted, failed) and reason.",
             ("role", "outcome", "reason")),
    Recorded("http_requests", "counter", "splitserve_http_requests_total", "HTTP requests by route and status.",
             ("path", "status")),
    Recorded("prompt_tokens", "counter", "splitserve_prompt_tokens_total", "Prompt tokens of finished requests.",
             ("role",)),
    Recorded("generation_tokens", "counter", "splitserve_generation_tokens_total",
             "Tokens generated (all requests, also failed ones).", ("role",)),
    Recorded("request_seconds", "histogram", "splitserve_request_duration_seconds",
             "End-to-end latency: from arrival to the end of a generation request.",
             ("role", "endpoint", "outcome"), LATENCY_BUCKETS),
    Recorded("ttft_seconds", "histogram", "splitserve_time_to_first_token_seconds",
             "Time from arrival to the first generated token.", ("role", "endpoint"), LATENCY_BUCKETS),
    Recorded("itl_seconds", "batch_histogram", "splitserve_inter_token_latency_seconds",
             "Time between two consecutive deltas of generated tokens of one request.", ("role", "endpoint"),
             ITL_BUCKETS),
    Recorded("queue_seconds", "histogram", "splitserve_queue_time_seconds",
             "Time from arrival until the worker began the request's work, out of the states that wait for its "
             f"turn ({states_in(Waits.QUEUE, colocated='admitted')}).", ("role",), LATENCY_BUCKETS),
    Recorded("state_seconds", "histogram", "splitserve_state_seconds",
             "Prefill/decode: time a request spent in each lifecycle state.", ("role", "state"), LATENCY_BUCKETS,
             split=True),
    Recorded("transfer_seconds", "histogram", "splitserve_kv_transfer_seconds",
             "Prefill: from a request's first KV write started to its last one landed.", ("role",),
             LATENCY_BUCKETS, split=True),
    Recorded("write_seconds", "histogram", "splitserve_kv_transfer_write_seconds",
             "Prefill: one KV write, from its start to its landing (as the engine loop sees them).", ("role",),
             ITL_BUCKETS, split=True),
    Recorded("transfer_bytes", "histogram", "splitserve_kv_transfer_request_bytes",
             "Prefill: KV bytes written for one request.", ("role",), BYTES_BUCKETS, split=True),
    Recorded("transfer_failures", "counter", "splitserve_kv_transfer_failures_total",
             "Transfers that failed, by the reason the request failed (prefill: after its first write started; "
             "decode: while waiting for the KV).", ("role", "reason"), split=True),
)
"""The metrics the handlers and timelines record into, each an attribute of :class:`WorkerMetrics`."""
