"""A whole cluster in one process: prefill and decode workers and a router, each running the
project's real code on the simulated loop (``clock.py``), joined by the simulated network
(``network.py``, ``transfer.py``, ``http.py``; ``docs/lifecycle.md``, *The simulator*).

A :class:`SimWorker` is one worker *process*: the real :class:`~splitserve.engine.async_engine.AsyncEngine`
with the real role and the real HTTP state and handlers, built through the seams (``Seams``,
``ModelParts``, the clocks). Its three threads are callbacks on the loop: the **engine loop** runs
``iterate_once(wait=False)`` when its inbox gets an event (after a wake-up latency from the seed),
when the engine has work (after the last step's simulated cost), else after ``role.wait_s(now)``;
the **control** and **transfer** threads run their ``step()`` when something is handed to them and
every ``tick_s``, an exception escaping a step going to the thread's ``crashed`` and the step
resuming after ``RESTART_PAUSE_S``, as ``SupervisedThread.run`` does.

Faults act on these: a **wedged** engine loop does not iterate, a **hung** thread does not step, a
**stopped** process (SIGSTOP) runs none of its threads and nothing it sends over HTTP arrives until
it goes on, a **kill** drops the process on the floor (its sockets vanish, its links close, its
HTTP connections break), and a **restart** builds a new process at the same address, with a new
incarnation.
"""

from __future__ import annotations

import asyncio
import logging
import queue
from functools import partial
from typing import Callable, Optional

from aiohttp import web

from splitserve.config import EngineConfig, RouterConfig, ServerConfig, WorkerAddress
from splitserve.disagg.decode_role import DecodeRole
from splitserve.disagg.lifecycle import Deadlines
from splitserve.disagg.prefill_role import PrefillRole
from splitserve.disagg.seams import Seams
from splitserve.disagg.supervised import RESTART_PAUSE_S
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.engine import LLMEngine
from splitserve.engine.role import IDLE_WAIT_S
from splitserve.metrics import Registry
from splitserve.router import app as router_app
from splitserve.router.state import ROOM_BITS
from splitserve.router.workers import HealthChecker
from splitserve.server import app as worker_app
from splitserve.server.state import STATE
from splitserve.server.watchdog import loop_watchdog
from splitserve.server.tokenize_lanes import TokenizeLanes
from splitserve.sim.clock import InlineExecutor
from splitserve.sim.http import Session, prepare_app, serve
from splitserve.sim.losses import off_by
from splitserve.sim.model import Cost, FakeModel, fake_parts

log = logging.getLogger(__name__)

HTTP_PORT = 8000
BOOTSTRAP_PORT = 8998
ITERATION_S = 0.00005  # an engine loop iteration that runs no forward pass
SPIN_S = 0.001  # how often a loop with work it cannot schedule comes back (the real one waits <= 50 ms)


class _WakingInbox(queue.SimpleQueue):
    """The engine loop's inbox; a put wakes the simulated loop (as it wakes a blocked ``get``)."""

    def __new__(cls, wake: Callable[[], None]):
        inbox = super().__new__(cls)
        inbox.wake = wake
        return inbox

    def put(self, item, block=True, timeout=None):
        super().put(item, block, timeout)
        self.wake()


class _Activity:
    """One simulated thread's next run: the earliest time asked for wins."""

    def __init__(self, loop, run: Callable[[], None]):
        self.loop = loop
        self.run = run
        self.at: Optional[float] = None
        self.handle = None

    def at_or_before(self, when: float) -> None:
        if self.at is not None and self.at <= when:
            return
        if self.handle is not None:
            self.handle.cancel()
        self.at = when
        self.handle = self.loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self.at = self.handle = None
        self.run()

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
        self.at = self.handle = None


class SimWorker:
    """One worker process (module docstring)."""

    def __init__(self, cluster: "Cluster", kind: str, index: int, generation: int):
        self.cluster = cluster
        self.kind, self.index, self.generation = kind, index, generation
        self.slot = f"{kind}{index}"
        self.name = f"{self.slot}.{generation}"
        self.host = cluster.hosts[self.slot]
        self.loop = loop = cluster.loop
        self.rng = cluster.streams(f"worker/{self.name}")
        self.alive = True
        self.wedged_until = 0.0
        self.stopped_until = 0.0  # SIGSTOP: nothing of this process runs before then
        self.control_hung = self.transfer_hung = False
        self.busy_until = 0.0
        self.connections: set = set()
        self.in_engine = False
        self.edge_errors = 0.0  # chance that a call from the engine loop into a thread raises
        sim = cluster.config
        self.engine_act = _Activity(loop, self._engine_run)
        self.control_act = _Activity(loop, self._control_run)
        self.transfer_act = _Activity(loop, self._transfer_run)
        self.control_pause = self.transfer_pause = 0.0

        prefills = ",".join(f"{host}:{BOOTSTRAP_PORT}" for slot, host in cluster.hosts.items()
                            if slot.startswith("prefill"))  # decode takes bootstrap addresses of these only
        server = ServerConfig(host=self.host, port=HTTP_PORT, role=kind, bootstrap_port=BOOTSTRAP_PORT,
                              transfer_backend="fake", loop_stall_s=sim.loop_stall_s,
                              advertise_host=cluster.advertise.get(self.slot), allowed_prefill=prefills,
                              kv_failure_policy=sim.kv_failure_policy)
        engine_config = sim.engine_config(kind)
        self.tview = cluster.tnet.view(self)
        seams = Seams(incarnation=cluster.new_incarnation, transfer_opts={"network": self.tview},
                      bind=lambda host, port: cluster.net.bind(host, port, self.wake_control),
                      dial=lambda address, ident: cluster.net.dial(self.host, address, ident, self.wake_control),
                      io_probe=lambda: None, control_wake=self.wake_control, threads=False)
        role_cls = PrefillRole if kind == "prefill" else DecodeRole
        self.role = role = role_cls(server, sim.deadlines, seams=seams)
        role.clock = loop.time
        self.inbox = _WakingInbox(self.wake_engine)
        self.ae = ae = AsyncEngine(engine_config, role, loop_stall_s=sim.loop_stall_s, inbox=self.inbox)
        ae.clock = loop.time
        self.model = FakeModel(Cost(sim.step_s, sim.token_s), eos_every=sim.eos_every)
        ae.engine = LLMEngine(engine_config, fake_parts(self.model))
        self.runner = ae.engine.runner
        self.runner.on_fail = lambda: cluster.faults.effects.__setitem__(
            "forward passes failed", cluster.faults.effects["forward passes failed"] + 1)
        cluster.checker.on_worker(self)  # before the role builds anything (it wraps the allocator)
        role.start(ae)
        ae.start_loop(loop, thread=False)
        for thread in (role.control, role.transfer):
            thread.alive = lambda: self.alive
        self._wrap_edges()
        self.app = prepare_app(worker_app.create_app(ae, server), self._finding)
        self.state = self.app[STATE]
        self.state.tokenize = TokenizeLanes(executor=InlineExecutor())
        self._watchdog = loop_watchdog(self.app)
        asyncio.ensure_future(self._watchdog.__anext__())
        self.engine_act.at_or_before(loop.time())
        self.control_act.at_or_before(loop.time())
        self.transfer_act.at_or_before(loop.time())

    @property
    def incarnation(self) -> str:
        return self.role.incarnation

    # -- the edges between the engine loop and the threads ------------------------------------

    def _wrap_edges(self) -> None:
        """The engine loop hands work to the threads through queues: each put wakes the thread
        (and, with the ``edge_error`` fault, may raise, as a broken queue would)."""
        transfer, control = self.role.transfer, self.role.control
        submit, send, forget = transfer.submit, control.send, control.forget

        def check() -> None:
            if self.in_engine and self.edge_errors and self.rng.random() < self.edge_errors:
                self.cluster.faults.handover_raised(self)
                raise RuntimeError("simulated: handing work to a thread failed")

        def t_submit(cmd) -> None:
            check()
            submit(cmd)
            self.wake_transfer()

        def c_send(peer, msg) -> None:
            check()
            send(peer, msg)

        def c_forget(peer) -> None:
            check()
            forget(peer)

        transfer.submit, control.send, control.forget = t_submit, c_send, c_forget

    # -- waking the simulated threads ---------------------------------------------------------

    def _latency(self) -> float:
        return self.cluster.config.wake_s * self.rng.random()

    def wake_engine(self) -> None:
        if self.alive:
            self.engine_act.at_or_before(max(self.busy_until, self.loop.time() + self._latency()))

    def wake_control(self) -> None:
        if self.alive:
            self.control_act.at_or_before(max(self.control_pause, self.loop.time() + self._latency()))

    def wake_transfer(self) -> None:
        if self.alive:
            self.transfer_act.at_or_before(max(self.transfer_pause, self.loop.time() + self._latency()))

    # -- the simulated threads ------------------------------------------------------------------

    def _engine_run(self) -> None:
        if not self.alive:
            return
        now = self.loop.time()
        if now < self.stopped_until:
            self.engine_act.at_or_before(self.stopped_until)
            return
        if now < self.wedged_until:
            self.cluster.faults.effects["engine-loop wakeups held by a wedge"] += 1
            self.engine_act.at_or_before(self.wedged_until)
            return
        self.runner.cost_s = 0.0
        self.in_engine = True
        try:
            self.ae.iterate_once(wait=False)
        finally:
            self.in_engine = False
        self.busy_until = now + max(self.runner.cost_s, ITERATION_S)
        self.cluster.checker.after_iteration(self, now)
        engine = self.ae.engine
        if engine.has_work() and not self.runner.cost_s:
            # work, but nothing the scheduler could run (the pool is exhausted): the real loop waits
            # for an event or its next deadline (at most the role's 50 ms); here it comes back every
            # SPIN_S, sooner, and the requests it holds are excused for failing (overload, not a fault)
            self.cluster.faults.starved(self, now)
            self.engine_act.at_or_before(max(self.busy_until, now + SPIN_S))
        elif engine.has_work() or not self.inbox.empty():
            self.engine_act.at_or_before(self.busy_until)
        else:
            self.engine_act.at_or_before(max(self.busy_until, now + self._idle_wait(now)))

    def _idle_wait(self, now: float) -> float:
        """How long an idle engine loop waits before its next iteration (an event wakes it
        sooner): until the role's next deadline, at most ``IDLE_WAIT_S``. (The real role caps its
        wait at 50 ms; here an idle loop with nothing due sleeps longer — so that idle time costs
        little — which a real loop descheduled for a while also does. Nothing is due meanwhile, and
        the liveness it reads from its threads is taken before any deadline is judged.)"""
        due = self.role.table.next_due()
        wait = IDLE_WAIT_S if due is None else max(0.001, min(IDLE_WAIT_S, due - now))
        return wait * (0.5 + 0.5 * self.rng.random())

    def _control_run(self) -> None:
        if not self.alive:
            return
        if self.control_hung:
            self.cluster.faults.effects["control steps held by a hang"] += 1
            return
        now = self.loop.time()
        if now < self.stopped_until:
            self.control_act.at_or_before(self.stopped_until)
            return
        control = self.role.control
        try:
            control.step()
        except Exception as exc:
            control.crashed(exc)
            self.cluster.faults.effects["control thread crashed"] += 1
            self.control_pause = now + RESTART_PAUSE_S
            self.control_act.at_or_before(self.control_pause)
            return
        self.control_act.at_or_before(now + self.cluster.config.tick_s * (0.5 + self.rng.random()))

    def _transfer_run(self) -> None:
        if not self.alive:
            return
        if self.transfer_hung:
            self.cluster.faults.effects["transfer steps held by a hang"] += 1
            return
        now = self.loop.time()
        if now < self.stopped_until:
            self.transfer_act.at_or_before(self.stopped_until)
            return
        transfer = self.role.transfer
        try:
            busy = transfer.step()
        except Exception as exc:
            transfer.crashed(exc)
            self.cluster.faults.effects["transfer thread crashed"] += 1
            self.transfer_pause = now + RESTART_PAUSE_S
            self.transfer_act.at_or_before(self.transfer_pause)
            return
        gap = self._latency() if busy else self.cluster.config.tick_s * 2 * (0.5 + self.rng.random())
        self.transfer_act.at_or_before(now + gap)

    # -- HTTP -----------------------------------------------------------------------------------

    async def handle(self, req: web.Request) -> None:
        """What aiohttp's server does with a request to this worker (``http.serve``)."""
        await serve(self.app, req)

    def _finding(self, what: str) -> None:
        if self.alive:
            self.cluster.checker.violation(f"{self.name}: {what}")

    # -- faults ---------------------------------------------------------------------------------

    def crash_transfer(self) -> None:
        """The transfer thread's next backend call raises (prefill: a write or a poll; decode:
        reading its links' notifications)."""
        if self.kind == "prefill":
            self.tview.fail_next += 1
        else:
            links, notifications = self.role.links, self.role.links.notifications

            def once():
                links.notifications = notifications
                raise RuntimeError("simulated transfer-thread crash (notifications raised)")

            links.notifications = once
        self.wake_transfer()

    def crash_control(self) -> None:
        """The control thread's next receive raises."""
        control = self.role.control
        if self.kind == "prefill":
            control.endpoint.fail_recv += 1
        else:
            for conn in control.connections()[:1]:
                conn.fail_recv += 1
        self.wake_control()

    def stop(self, until: float) -> None:
        """SIGSTOP until ``until`` (then SIGCONT): its threads do not run, its HTTP answers wait."""
        self.stopped_until = max(self.stopped_until, until)

    def kill(self) -> None:
        """kill -9: nothing of this process runs again; what it held in the network goes."""
        if not self.alive:
            return
        self.alive = False
        for act in (self.engine_act, self.control_act, self.transfer_act):
            act.cancel()
        control = self.role.control
        if self.kind == "prefill":
            control.endpoint.close()
        else:
            for conn in control.connections():
                conn.close()
        self.cluster.tnet.kill(self)
        for conn in list(self.connections):
            conn.broken()
        self.connections.clear()
        asyncio.ensure_future(self._watchdog.aclose())


class SimRouter:
    """The router process: the real app (``router/app.py``: its routes, middlewares and
    ``RouterState``) and the real ``HealthChecker``, with the simulated session to the workers
    (``http.Session``) and rooms drawn from the seed."""

    def __init__(self, cluster: "Cluster", config: RouterConfig):
        self.cluster = cluster
        self.app = router_app.create_app(config)
        self.state = self.app[router_app.ROUTER]
        self.state.session = Session(cluster.loop, cluster.worker_at,
                                     rewrite=partial(off_by, k=cluster.config.resend_off_by))
        rng = cluster.streams("router/rooms")
        self.state.new_room = lambda: rng.getrandbits(ROOM_BITS)
        prepare_app(self.app, lambda what: cluster.checker.violation(f"router: {what}"))
        self.checker = HealthChecker(self.state.workers, self.state.session, config.health_interval_s,
                                     config.health_failures)

    async def start(self) -> None:
        """What the app's startup does (``_session_and_health_checks``), on the simulated session."""
        await self.checker.check_all()
        asyncio.ensure_future(self._checks())

    async def _checks(self) -> None:
        await asyncio.sleep(self.checker.interval_s)
        await self.checker.run()

    async def handle(self, request: web.Request) -> None:
        await serve(self.app, request)


class Cluster:
    """The world of one seed: the loop, the networks, the workers and the router."""

    def __init__(self, loop, streams, config, checker, faults, trace):
        from splitserve.sim.network import Network
        from splitserve.sim.transfer import TransferNet

        self.loop = loop
        self.streams = streams
        self.config = config
        self.checker = checker
        self.faults = faults
        self.trace = trace
        self.net = Network(loop, streams("network"), trace)
        self.tnet = TransferNet(loop, streams("transfer"), self.net, trace)
        self._incarnations = streams("incarnations")
        self.hosts = {f"prefill{i}": f"10.0.0.{i + 1}" for i in range(config.prefills)}
        self.hosts.update({f"decode{i}": f"10.0.1.{i + 1}" for i in range(config.decodes)})
        self.advertise: dict[str, str] = {}
        if config.shared_decode_name:  # two decodes that advertise one address (docs/lifecycle.md, sessions)
            self.advertise = {f"decode{i}": "10.0.1.100" for i in range(config.decodes)}
        self.workers: dict[str, SimWorker] = {}  # slot -> the process there now (alive or dead)
        self.generations: dict[str, int] = {}
        self.by_address: dict[str, SimWorker] = {}
        self.retired_fallbacks = 0  # KV fallbacks of decode workers since replaced (killed, restarted)
        router_config = config.router_config(
            prefill=tuple(WorkerAddress(f"http://{self.hosts[f'prefill{i}']}:{HTTP_PORT}", BOOTSTRAP_PORT)
                          for i in range(config.prefills)),
            decode=tuple(WorkerAddress(f"http://{self.hosts[f'decode{i}']}:{HTTP_PORT}")
                         for i in range(config.decodes)))
        self.router = SimRouter(self, router_config)

    def new_incarnation(self) -> str:
        return f"{self._incarnations.getrandbits(64):016x}"

    def start_worker(self, slot: str) -> SimWorker:
        kind = "prefill" if slot.startswith("prefill") else "decode"
        index = int(slot[len(kind):])
        old = self.workers.get(slot)
        if old is not None and kind == "decode" and getattr(old.role, "fallbacks", None) is not None:
            self.retired_fallbacks += sum(old.role.fallbacks.values())
        generation = self.generations.get(slot, -1) + 1
        self.generations[slot] = generation
        worker = SimWorker(self, kind, index, generation)
        self.workers[slot] = worker
        self.by_address[f"{worker.host}:{HTTP_PORT}"] = worker
        self.trace(f"{worker.name} started, incarnation {worker.incarnation}")
        return worker

    def worker_at(self, address: str) -> Optional[SimWorker]:
        worker = self.by_address.get(address)
        return worker if worker is not None and worker.alive else None

    def slots(self) -> list[str]:
        return [f"prefill{i}" for i in range(self.config.prefills)] + \
               [f"decode{i}" for i in range(self.config.decodes)]
