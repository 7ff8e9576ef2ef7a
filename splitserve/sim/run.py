"""One seed, start to end: build the cluster, let the clients come, inject the faults, check
everything (``invariants.py``), and say what happened (:class:`Result`).

The run has three phases on the simulated clock: the clients arrive and the faults strike (the
scenario's ``arrival_s``); every client must then end within the router's ``request_timeout_s``
plus ``CLIENT_SLACK_S``; then the cluster is left alone for ``tombstone_s`` plus twice the
peer-silence bound, after which nothing may be left (``Checker.at_rest``) and the router's
outcome counters must equal what the clients saw. The first violation stops the run; its
:class:`Result` carries the violation and the trace of the events before it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import urlsplit

from splitserve.router.outcomes import Refusal, RouterOutcome
from splitserve.sim.clock import SimLoop, Streams
from splitserve.sim.cluster import Cluster
from splitserve.sim.invariants import CLIENT_SLACK_S, Checker, Trace
from splitserve.sim.losses import ARM_S, Losses
from splitserve.sim.network import LinkFaults, Partition
from splitserve.sim.scenario import FATAL, LOSS, Fault, Scenario
from splitserve.sim.workload import CURRENT, Client, draw_clients, reference_text, run_client

LEG_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate")
OVERLOAD_CODES = ("overloaded", "queue_full", "no_healthy_workers")
ROUTER_LEFT = ("hung_up", "stopped_reading")
LEAVING = {"hung_up": RouterOutcome.CLIENT_DISCONNECT, "stopped_reading": RouterOutcome.CLIENT_TIMEOUT}  # what the router counts


class FaultLog:
    """Faults injected, by kind, and their windows (what excuses a failed request)."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.windows: list[tuple] = []  # (kind, target, start, end), or (kind, target, [start, end]) while it grows
        self._starved: dict[str, list[float]] = {}
        self.starved_spells = 0
        self.effects: Counter = Counter()  # what the faults did, as seen where they act

    def handover_raised(self, worker) -> None:
        self.effects["hand-over raised"] += 1
        now = worker.loop.time()
        self.windows.append(("edge_error", worker.slot, now, now))

    def starved(self, worker, now: float) -> None:
        """``worker``'s engine had work it could not schedule (its pool exhausted): overload, one
        window per spell (counted as ``starved``, not a fault)."""
        last = self._starved.get(worker.slot)
        if last is not None and now - last[1] <= 0.1:
            last[1] = now
            return
        self.starved_spells += 1
        spell = self._starved[worker.slot] = [now, now]
        self.windows.append(("starved", worker.slot, spell))

    def window(self, kind: str, target, start: float, end: float) -> None:
        self.windows.append((kind, target, start, end))

    def excuses(self, slots: Optional[set], pairs: set, born: float, ended: float, settle: float) -> list[str]:
        """The kinds of the windows between ``born`` and ``ended`` (+ ``settle``) on one of
        ``slots`` or ``pairs`` (or on every worker); ``slots`` None: on any."""
        out = []
        for kind, target, *span in self.windows:
            start, end = span if len(span) == 2 else span[0]
            if start > ended or end + settle < born:
                continue
            if target == "*" or slots is None or target in slots or target in pairs:
                out.append(kind)
        return out


@dataclass
class Result:
    seed: int
    scenario: Scenario
    requests: int = 0
    endings: Counter = field(default_factory=Counter)
    sim_s: float = 0.0
    faults: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    trace: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    checks: int = 0
    starved: int = 0  # spells of an engine with work it could not schedule (overload)
    effects: Counter = field(default_factory=Counter)

    @property
    def ok(self) -> bool:
        return not self.violations

    def report(self) -> list[str]:
        """What a run prints: the same for the same seed in any process, but for the ``wall`` line."""
        s = self.scenario
        policy = "" if s.kv_failure_policy == "fail" else f" --kv-failure-policy {s.kv_failure_policy}"
        lines = [f"seed {self.seed}{policy}: {'quiet' if s.quiet else 'chaos'}, {s.prefills} prefill + {s.decodes} decode, "
                 f"{self.requests} requests over {s.arrival_s:.1f}s, simulated {self.sim_s:.1f}s, "
                 f"{self.checks} invariant checks",
                 "endings: " + ", ".join(f"{k} {v}" for k, v in sorted(self.endings.items())),
                 "faults: " + (", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) or "none"),
                 "effects: " + (", ".join(f"{k} {v}" for k, v in sorted(self.effects.items())) or "none"),
                 f"overload: {self.starved} spells of an engine loop with work it could not schedule"]
        if self.violations:
            lines.append(f"VIOLATION: {self.violations[0]}")
            lines.append(f"trace (the last {len(self.trace)} events):")
            lines += self.trace
            lines.append(f"replay: python -m splitserve.sim --seed {self.seed}{policy}")
        else:
            lines.append("ok: every invariant held")
        lines.append(f"wall {self.wall_s:.2f}s")
        return lines


@dataclass
class Totals:
    """What many seeds added up to (``python -m splitserve.sim --seeds``, the tests)."""

    seeds: int = 0
    requests: int = 0
    sim_s: float = 0.0
    checks: int = 0
    endings: Counter = field(default_factory=Counter)
    faults: Counter = field(default_factory=Counter)
    failed: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    starved: int = 0
    effects: Counter = field(default_factory=Counter)

    def add(self, result: Result) -> None:
        self.seeds += 1
        self.starved += result.starved
        self.effects.update(result.effects)
        self.requests += result.requests
        self.sim_s += result.sim_s
        self.checks += result.checks
        self.endings.update(result.endings)
        self.faults.update(result.faults)
        self.wall_s += result.wall_s
        if not result.ok:
            self.failed.append(result.seed)

    def report(self, wall_s: Optional[float] = None) -> list[str]:
        wall_s = self.wall_s if wall_s is None else wall_s
        hours = self.sim_s / 3600
        return [f"seeds {self.seeds}, simulated requests {self.requests}, simulated hours {hours:.2f}, "
                f"invariant checks {self.checks}, failing seeds {len(self.failed)}"
                + (f" {self.failed[:20]}" if self.failed else ""),
                "endings: " + ", ".join(f"{k} {v}" for k, v in sorted(self.endings.items())),
                "faults injected: " + (", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) or "none"),
                "their effects: " + (", ".join(f"{k} {v}" for k, v in sorted(self.effects.items())) or "none"),
                f"overload: {self.starved} spells of an engine loop with work it could not schedule",
                f"wall {wall_s:.1f}s: {hours / max(wall_s / 60, 1e-9):.2f} simulated hours per wall minute"]


class Run:
    def __init__(self, scenario: Scenario, trace_size: int = 80):
        self.s = scenario
        self.loop = SimLoop()
        self.streams = Streams(scenario.seed)
        self.trace = Trace(self.loop, trace_size)
        self.checker = Checker(scenario, self.trace)
        self.checker.loop = self.loop
        self.faults = FaultLog()
        self.cluster = Cluster(self.loop, self.streams, scenario, self.checker, self.faults, self.trace)
        self.checker.cluster = self.cluster
        self.cluster.tnet.on_land = self.checker.on_land
        self.cluster.net.default = LinkFaults(drop=scenario.drop, duplicate=scenario.duplicate, reorder=scenario.reorder)
        self.cluster.tnet.faults.notify_drop = scenario.notify_drop
        self.clients: list[Client] = []
        self.started: set[int] = set()  # clients whose request the router began to handle
        self._restarts: dict[str, float] = {}
        self.losses = Losses(self)

    # -- the run ----------------------------------------------------------------------------------

    def run(self) -> Result:
        wall = time.perf_counter()
        loop, s = self.loop, self.s
        asyncio.set_event_loop(loop)
        quiet = logging.getLogger("splitserve")
        level = quiet.level
        quiet.setLevel(logging.CRITICAL + 1)
        try:
            self._run()
        finally:
            quiet.setLevel(level)
            self._close()
        result = Result(seed=s.seed, scenario=s, requests=len(self.clients), sim_s=loop.time(),
                        violations=list(self.checker.violations), checks=self.checker.checks,
                        wall_s=time.perf_counter() - wall)
        result.endings = Counter(c.ending() for c in self.clients)
        result.faults = Counter(self.faults.counts)
        result.starved = self.faults.starved_spells
        net, tnet = self.cluster.net.counts, self.cluster.tnet.counts
        for kind, n in (("drop", net["dropped"]), ("duplicate", net["duplicated"]), ("reorder", net["reordered"]),
                        ("notify_drop", tnet["notify_dropped"]), ("write_refused", tnet["refused"]),
                        ("write_cut", tnet["cut"]), ("write_stalled", tnet["stalled"])):
            if n:
                result.faults[kind] = n
        result.effects = Counter(self.faults.effects)
        fallbacks = self.cluster.retired_fallbacks + sum(
            sum(w.role.fallbacks.values()) for w in self.cluster.workers.values()
            if w.kind == "decode" and getattr(w.role, "fallbacks", None) is not None)
        if fallbacks:
            result.effects["KV fallbacks (prompts recomputed on decode)"] = fallbacks
        migrations = self._counted("splitserve_router_migrations_total")
        if migrations:
            result.effects["answers continued on another decode (router migrations)"] = migrations
        for kind, n in (("frames cut by a partition", net["partitioned"]), ("of them held to the heal", net["held"]),
                        ("late writes landed", tnet["late"]), ("links closed", tnet["fenced"]),
                        ("transfer backend raised", tnet["crashes"])):
            if n:
                result.effects[kind] = n
        if result.violations:
            result.trace = self.trace.lines()
        return result

    def _counted(self, name: str) -> int:
        """The sum of the router's counter ``name`` over its labels."""
        registry = self.cluster.router.state.registry.collectors
        return int(sum(s.value for m in registry.collect() for s in m.samples if s.name == name))

    def _legs_followed(self) -> None:
        """Each leg the router opens for a client is noted on it (``Client.decodes``, ``.prefills``):
        the simulated session says so, in the client's context."""
        slot_at = {host: slot for slot, host in self.cluster.hosts.items()}

        def opened(method: str, url: str) -> None:
            client, parts = CURRENT.get(), urlsplit(url)
            slot = slot_at.get(parts.hostname)
            if client is not None and slot is not None and method == "POST" and parts.path in LEG_PATHS:
                (client.decodes if slot.startswith("decode") else client.prefills).append(slot)

        self.cluster.router.state.session.opened = opened

    def _run(self) -> None:
        loop, s, cluster = self.loop, self.s, self.cluster
        for slot in cluster.slots():
            cluster.start_worker(slot)
        self._legs_followed()
        pick = cluster.router.state.pick_workers
        host_slot = {host: slot for slot, host in cluster.hosts.items()}

        def picked(*args, **kw):
            result = pick(*args, **kw)
            client = CURRENT.get()
            if client is not None:
                if isinstance(result, Refusal):
                    client.refused = True
                else:
                    client.pair = (host_slot[result[0].host], host_slot[result[1].host])
            return result

        cluster.router.state.pick_workers = picked
        handle = cluster.router.handle

        async def handled(req):
            client = CURRENT.get()
            if client is not None:
                self.started.add(client.spec.n)
            await handle(req)

        cluster.router.handle = handled
        loop.run_until_complete(cluster.router.start())
        specs = draw_clients(self.streams("clients"), s)
        for spec in specs:
            loop.call_at(spec.at, self._start_client, spec)
        for fault in s.faults:
            loop.call_at(fault.at, self._strike, fault)
        last = max((sp.at for sp in specs), default=0.0)
        faults_over = max((f.end + (ARM_S if f.kind == LOSS else 0.0) for f in s.faults), default=0.0)
        if not self._phase(last + s.end_to_end_s + CLIENT_SLACK_S + 0.1):
            return
        self._check_clients()
        if self.checker.violations:
            return
        rest = max(loop.time(), faults_over + 1.0) + s.deadlines.tombstone_s + 2 * s.deadlines.peer_silence_s + 5.0
        if not self._phase(rest):
            return
        self.checker.at_rest(cluster)
        if not self.checker.violations:
            self._check_counters()

    def _phase(self, until: float) -> bool:
        self.loop.run_until(until)
        return not self.checker.violations

    def _close(self) -> None:
        """Stop everything: every process dies, every coroutine is cancelled and let finish (on
        the virtual clock, a few seconds at most), then the loop closes."""
        loop = self.loop
        for worker in list(self.cluster.workers.values()):
            worker.kill()
        for _ in range(5):
            tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
            if not tasks:
                break
            for task in tasks:
                task.cancel()
            try:
                loop.run_until(loop.time() + 1.0)
            except Exception:
                pass
        loop.close()
        asyncio.set_event_loop(None)

    # -- clients ----------------------------------------------------------------------------------

    def _start_client(self, spec) -> None:
        client = Client(spec, watch=self.losses.watch)
        self.clients.append(client)
        self.trace("client %s: %d-char prompt, max_tokens %d, %s%s", client.rid, len(spec.prompt), spec.max_tokens,
                   "stream" if spec.stream else "unary",
                   f", hangs up after {spec.hang_up_after:.3f}s" if spec.hang_up_after is not None else "")
        asyncio.ensure_future(run_client(client, self.cluster.router, self.loop, "sim"))
        bound = self.loop.time() + self.s.end_to_end_s + CLIENT_SLACK_S
        self.loop.call_at(bound, self._client_deadline, client)

    def _client_deadline(self, client: Client) -> None:
        if not client.eof and client.left is None:
            self.checker.violation(f"client {client.rid} ({client.pair}) has no answer "
                                   f"{self.s.end_to_end_s + CLIENT_SLACK_S:g}s after it asked")

    def _check_clients(self) -> None:
        d = self.s.deadlines
        settle = 2 * d.peer_silence_s + 3.0
        for client in self.clients:
            if client.problems:
                self.checker.violation(f"client {client.rid}: {', '.join(client.problems)}")
                return
            ending = client.ending()
            if ending == "none":
                self.checker.violation(f"client {client.rid} never got an ending")
                return
            if ending == "finished":  # greedy or seeded: the fake model's logits peak at one token
                want = reference_text(client.spec.prompt, client.spec.max_tokens, self.s.eos_every)
                got = client.text()
                if got != want:
                    self.checker.violation(f"client {client.rid} ({client.pair}, decodes {client.decodes}) got "
                                           f"{got!r}, the reference is {want!r}")
                    return
            if not ending.startswith("error:") or ending.split(":", 1)[1] in OVERLOAD_CODES:
                continue
            why = self._unexcused(client, ending, settle)
            if why is not None:
                self.checker.violation(why)
                return

    def _unexcused(self, client, ending: str, settle: float) -> Optional[str]:
        """Why ``client``'s error is a violation, or None: a fault touched a worker it was sent to
        (its pair, any leg's), or the decode it lost mid-answer left it no way (``losses.py``)."""
        ended = client.ended_at if client.ended_at is not None else self.loop.time()
        slots, pairs = None, set()
        if client.pair is not None or client.decodes:
            prefills = set(client.prefills) | ({client.pair[0]} if client.pair else set())
            decodes = set(client.decodes) | ({client.pair[1]} if client.pair else set())
            slots, pairs = prefills | decodes, {(p, d) for p in prefills for d in decodes}
        kinds = self.faults.excuses(slots, pairs, client.born, ended, settle)
        if any(kind != LOSS for kind in kinds):
            return None
        if not kinds:
            return (f"liveness: client {client.rid} ({client.pair}, born t={client.born:.3f}) ended {ending} at "
                    f"t={ended:.3f} with no fault touching its workers")
        unserved = self.losses.unserved(client, ended, settle)
        return None if unserved is None else (f"client {client.rid} ({client.pair}, decodes {client.decodes}, born "
                                              f"t={client.born:.3f}) ended {ending} at t={ended:.3f}, but {unserved}")

    def _check_counters(self) -> None:
        """The router's outcome counter against what each client saw, request by request (the
        router's record of each, ``state.recent``, says which outcome it counted):

        - a client with a whole answer was counted ``finished``; one with an error, a failure;
        - a client that left (hung up, stopped reading) before its answer ended was counted as
          leaving (``client_disconnect`` / ``client_timeout``), whatever the router was answering
          (a refusal, a worker's error) — never ``finished``, never a failure it did not see;
        - a refused request (no pair to pick) as the refusal;
        - a client that left before the router took its request: ``client_disconnect``;

        and every outcome's counter equals the number of requests recorded with it."""
        registry = self.cluster.router.state.registry.collectors
        recent = self.cluster.router.state.recent
        expected: Counter = Counter()
        for client in self.clients:
            if client.spec.n not in self.started:
                continue
            ending = client.ending()
            entry = recent.get(client.rid)
            if client.refused:
                got = LEAVING.get(ending, RouterOutcome.NO_WORKERS)
            elif entry is None:
                got = RouterOutcome.CLIENT_DISCONNECT if ending in ROUTER_LEFT else None
            else:
                got = RouterOutcome(entry["outcome"]) if entry.get("outcome") is not None else None
            if ending == "finished":
                ok = got is RouterOutcome.FINISHED
            elif ending in ROUTER_LEFT:
                ok = got in LEAVING.values()
            else:
                ok = got is not None and got is not RouterOutcome.FINISHED and got not in LEAVING.values()
            if not ok:
                left = f", left t={client.left_at:.4f}" if client.left_at is not None else ""
                self.checker.violation(
                    f"client {client.rid} ({client.pair}, born t={client.born:.4f}{left}, status {client.status}, "
                    f"{'ended' if client.eof else 'no end'}) saw {ending}, the router counted it {got and got.value}")
                return
            expected[got] += 1
        counted = {o.value: int(registry.get_sample_value("splitserve_router_requests_total", {"outcome": o.value}) or 0)
                   for o in RouterOutcome}
        if any(counted[o.value] != expected[o] for o in RouterOutcome):
            self.checker.violation(f"the router's outcome counters {counted} differ from its requests' outcomes "
                                   f"{ {o.value: n for o, n in expected.items()} }")

    # -- faults -------------------------------------------------------------------------------------

    def _strike(self, f: Fault) -> None:
        cluster, loop = self.cluster, self.loop
        self.faults.counts[f.kind] += 1
        settle_end = f.end
        self.trace("FAULT %s on %s for %.3fs %s", f.kind, f.target, f.duration, f.params or "")
        worker = cluster.workers.get(f.target) if isinstance(f.target, str) else None
        if worker is not None and not worker.alive:
            return  # dead already: its restart is on the way
        if f.kind == LOSS:
            self.losses.strike(f)
        elif f.kind == "kill":
            worker.kill()
            self.trace("%s killed", worker.name)
            self.restart_at(f.target, f.end)
        elif f.kind == "partition":
            (a, b), (one_way, from_decode) = f.target, f.params
            if from_decode:  # one way, decode's frames cut: prefill may forget a session decode keeps
                a, b = b, a
            cluster.net.partitions.append(Partition(cluster.hosts[a], cluster.hosts[b], f.at, f.end, one_way))
        elif f.kind == "wedge":
            worker.wedged_until = max(worker.wedged_until, f.end)
            self._watch_wedge(worker, f.at, f.end)
        elif f.kind in ("hang_transfer", "hang_control"):
            setattr(worker, "transfer_hung" if f.kind == "hang_transfer" else "control_hung", True)
            loop.call_at(f.end, self._operator_restart, worker)
            settle_end = f.end + 1.0
        elif f.kind == "crash_transfer":
            worker.crash_transfer()
        elif f.kind == "crash_control":
            worker.crash_control()
        elif f.kind == "forward_fail":
            worker.runner.fail_next += 1
        elif f.kind == "edge_error":
            worker.edge_errors = f.params[0]
            loop.call_at(f.end, setattr, worker, "edge_errors", 0.0)
        elif f.kind == "write_faults":
            tf = cluster.tnet.faults
            tf.refuse, tf.cut, tf.stall = f.params
            loop.call_at(f.end, self._writes_heal)
        if f.kind in FATAL:
            self.faults.window(f.kind, f.target, f.at, settle_end)

    def _writes_heal(self) -> None:
        tf = self.cluster.tnet.faults
        tf.refuse = tf.cut = tf.stall = 0.0

    def restart_at(self, slot: str, at: float) -> None:
        if slot in self._restarts:
            return
        self._restarts[slot] = at
        self.loop.call_at(at, self._restart, slot)

    def _restart(self, slot: str) -> None:
        self._restarts.pop(slot, None)
        if not self.cluster.workers[slot].alive:
            self.faults.effects["workers restarted"] += 1
            worker = self.cluster.start_worker(slot)
            self.trace("%s restarted", worker.name)

    def _operator_restart(self, worker) -> None:
        """A hung thread is never coming back: the operator restarts the worker."""
        if worker.alive and self.cluster.workers.get(worker.slot) is worker:
            worker.kill()
            self.trace("%s restarted by its operator (a hung thread)", worker.name)
            self._restart(worker.slot)

    def _watch_wedge(self, worker, start: float, end: float) -> None:
        """The bounds of a wedged loop (``docs/lifecycle.md``): while it stays wedged, its requests
        are answered within ``loop_stall_s`` + 0.5 s, and the router takes it out of rotation within
        ``loop_stall_s`` + ``health_interval_s`` x (``health_failures`` + 1)."""
        s = self.s
        answered_by = start + s.loop_stall_s + 0.5 + 0.5
        out_by = start + s.loop_stall_s + s.router["health_interval_s"] * (s.router["health_failures"] + 1) + 0.5

        def answered() -> None:
            if worker.alive and worker.wedged_until >= self.loop.time():
                held = worker.ae.awaited_rids()
                if held:
                    self.checker.violation(f"{worker.name} wedged since t={start:.3f}: requests {held[:5]} still "
                                           f"unanswered after loop_stall_s + 0.5s")

        def out_of_rotation() -> None:
            if worker.alive and worker.wedged_until >= self.loop.time():
                url = f"http://{worker.host}:8000"
                for w in self.cluster.router.state.workers.all():
                    if w.url == url and w.healthy:
                        self.checker.violation(f"{worker.name} wedged since t={start:.3f} is still in the router's "
                                               f"rotation")

        if end > answered_by:
            self.loop.call_at(answered_by, answered)
        if end > out_by:
            self.loop.call_at(out_by, out_of_rotation)


def run_seed(seed: int, requests: int = 300, quiet: Optional[bool] = None, scenario: Optional[Scenario] = None,
             trace_size: int = 80, kv_failure_policy: str = "fail") -> Result:
    """Run one seed (its scenario drawn from the seed unless given; decode's
    ``--kv-failure-policy`` as given)."""
    return Run(scenario or Scenario.draw(seed, requests, quiet, kv_failure_policy), trace_size).run()


def _run_one(args: tuple) -> Result:
    seed, requests, policy = args
    return run_seed(seed, requests=requests, kv_failure_policy=policy)


def run_many(seeds, requests: int = 300, processes: int = 1, on_result=None, pool=None,
             until: Optional[float] = None, kv_failure_policy: str = "fail") -> Totals:
    """Run ``seeds`` and add them up; ``on_result(result)`` sees each, in seed order.

    With ``processes`` > 1 each seed runs whole in one process of ``pool`` (a spawn pool of that
    many processes, made here and closed after unless given), ``2 * processes`` at a time; the
    totals do not depend on how many. ``seeds`` may be endless (``itertools.count()``) when
    ``until`` is given: no seed starts once ``time.perf_counter()`` has passed it (those under way
    finish and count)."""
    totals = Totals()
    for result in _results(iter(seeds), requests, processes, pool, until, kv_failure_policy):
        totals.add(result)
        if on_result is not None:
            on_result(result)
    return totals


def _results(seeds, requests: int, processes: int, pool, until: Optional[float], policy: str):
    def more() -> bool:
        return until is None or time.perf_counter() < until

    if processes <= 1 and pool is None:
        while more() and (seed := next(seeds, None)) is not None:
            yield run_seed(seed, requests=requests, kv_failure_policy=policy)
        return
    own = pool is None
    if own:
        import multiprocessing

        pool = multiprocessing.get_context("spawn").Pool(processes)
    window: deque = deque()
    try:
        while True:
            while len(window) < 2 * processes and more() and (seed := next(seeds, None)) is not None:
                window.append(pool.apply_async(_run_one, ((seed, requests, policy),)))
            if not window:
                return
            yield window.popleft().get()
    finally:
        if own:
            pool.terminate()
            pool.join()
