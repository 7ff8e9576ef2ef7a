"""The supervisor of ``splitserve launch`` (:class:`Supervisor`): starts a list of children, waits
until each is healthy, keeps its workers alive, and stops everything cleanly. It runs any list of
:class:`~splitserve.launch.child.ChildSpec` (tests hand it plain ``python -c`` children).

Each child runs in its own session (process group), its output echoed with a ``[name]`` prefix and
its last lines kept. ``run`` waits until every child with a ``health_url`` answers 200 there (at
most ``ready_timeout_s``; else it names the unhealthy ones with their last lines and fails; a
child that exits before all are up stops everything), prints where each listens, then watches: a
child marked ``restart`` (a worker) that exits, or that runs unhealthy and is stopped
(``health_watch.py``), is started again as ``restart.py``'s policy says, with one line saying which,
why, the attempt and the delay, until its budget is used up (then the others are stopped and
``run`` returns 1); any other child that exits does the same at once. SIGINT or SIGTERM stops
every child and ``run`` returns 0.

Stopping: SIGTERM to each child's process group, then SIGKILL to those still alive after
``stop_timeout_s`` (a second Ctrl-C skips the wait); a ``stop_last`` child (the etcd of
``--discovery local``) is stopped once the others exited. A child that exits has its group killed
at once. On Linux every child dies with launch even when launch is killed with SIGKILL
(``child.die_with_parent``: no lock, no allocation between fork and exec, as other threads run).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import Callable, Optional, Sequence, TextIO

from splitserve.auth import API_KEY_ENV
from splitserve.launch.child import Child, ChildSpec, die_with_parent, start
from splitserve.launch.health_probe import Answer, probe
from splitserve.launch.health_watch import HealthPolicy, HealthWatch
from splitserve.launch.restart import RestartPolicy, Restarts, role_to_restart

POLL_S = 0.2
READY_PROBE_S = 1.0  # one look while everything starts, when launch polls every POLL_S


class Supervisor:
    """Runs, watches and stops a list of children; :meth:`run` returns launch's exit code."""

    def __init__(self, specs: Sequence[ChildSpec], ready_timeout_s: float = 300.0, stop_timeout_s: float = 40.0,
                 out: TextIO = sys.stdout, echo: Optional[TextIO] = sys.stderr, title: str = "splitserve launch",
                 notes: Sequence[str] = (), restart: Optional[RestartPolicy] = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 health: Optional[HealthPolicy] = None, probe: Callable[[str, Optional[str], float], Answer] = probe):
        """``restart``: how the children marked ``restart`` are started again (None, or a budget
        of 0: never; their exit stops everything). ``health``: when such a child that runs but is
        not healthy is stopped (default :class:`HealthPolicy`). ``clock`` and ``sleep``: the time
        the waits, delays and health looks are counted in, and how the watch waits between looks;
        ``probe``: one look at a ``health_url`` (url, worker id, timeout)."""
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"child names must be unique: {names}")
        self.specs = list(specs)
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.out, self.echo = out, echo
        self.title = title
        self.notes = list(notes)  # more lines for the summary
        self.children: list[Child] = []
        self._signals: list[int] = []
        self._echo_lock = threading.Lock()
        self.restarts = Restarts(restart) if restart is not None and restart.budget > 0 else None
        self.clock, self.sleep = clock, sleep
        self._due: dict[str, tuple[float, tuple[str, ...]]] = {}  # name -> when it starts again, its argv
        self._preexec = None
        self.health = HealthWatch(health or HealthPolicy(), ready_timeout_s)
        self.probe = probe
        self._asking: dict[str, tuple[float, float, Future]] = {}  # name -> asked at (clock, real), the answer
        self._stopping: dict[str, tuple[float, str]] = {}  # name -> when to SIGKILL it, why it is stopped

    def say(self, text: str) -> None:
        with self._echo_lock:
            self.out.write(text + "\n")
            self.out.flush()

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = self._start_all()
            if code is None:
                code = self._wait_ready()
            if code is None:
                self._print_summary()
                code = self._watch()
            return code
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame) -> None:
        self._signals.append(signum)

    def _start_all(self) -> Optional[int]:
        """Start every child (None), or say which could not be started (1)."""
        self._preexec = die_with_parent(os.getpid())
        try:
            for spec in self.specs:
                self.children.append(start(spec, self.echo, self._echo_lock, self._preexec))
        except (OSError, subprocess.SubprocessError) as exc:
            self.say(f"{self.title}: cannot start {spec.name} ({' '.join(spec.argv)}): {exc}")
            return 1
        finally:  # the output threads start once the first forks are done
            for c in self.children:
                c.reader.start()
        return None

    def _wait_ready(self) -> Optional[int]:
        """None once every child is healthy, else the exit code to return."""
        deadline = self.clock() + self.ready_timeout_s
        waiting = [c for c in self.children if c.spec.health_url]
        why: dict[str, Optional[str]] = {}  # child name -> why its last check did not count
        while waiting:
            if self._signals:
                self.say(f"{self.title}: {self._signal_name()} before every process was up: stopping")
                return 0
            code = self._check_deaths()
            if code is not None:
                return code
            why = {c.spec.name: self.probe(c.spec.health_url, c.spec.worker_id, READY_PROBE_S).why for c in waiting}
            waiting = [c for c in waiting if why[c.spec.name] is not None]
            if waiting and self.clock() > deadline:
                for c in waiting:
                    self.say(f"{self.title}: {c.spec.name} (pid {c.proc.pid}) is not healthy after "
                             f"{self.ready_timeout_s:g} s ({c.spec.health_url}: {why[c.spec.name]}); its last "
                             f"lines:\n{c.last_lines()}")
                names = ", ".join(c.spec.name for c in waiting)
                self.say(f"{self.title}: gave up waiting for {names}; stopping everything")
                return 1
            if waiting:
                self.sleep(POLL_S)
        return None

    def _watch(self) -> int:
        now = self.clock()
        for c in self.children:
            if self._watched(c):
                self.health.started(c.spec.name, now, healthy=True)  # _wait_ready saw it healthy
        while True:
            if self._signals:
                dropped = f" (a restart of {', '.join(sorted(self._due))} is not done)" if self._due else ""
                self.say(f"{self.title}: {self._signal_name()}: stopping every process{dropped}")
                return 0
            code = self._check_deaths(restart=self.restarts is not None)
            if code is None:
                code = self._start_due()
            if code is not None:
                return code
            self._look_at_health()
            self._kill_overdue()
            self.sleep(POLL_S)

    def _watched(self, c: Child) -> bool:
        """A worker's health is watched once everything is up: the others' exit is all launch sees."""
        return c.spec.restart and c.spec.health_url is not None

    def _look_at_health(self) -> None:
        """Ask each watched worker that is due, in a thread of its own (a wedged worker's look
        takes its whole timeout: the watch goes on meanwhile); stop those the answers condemn."""
        now, timeout = self.clock(), self.health.policy.probe_timeout_s()
        for c in self.children:
            name = c.spec.name
            if not self._watched(c) or name in self._stopping or name in self._due or not c.alive():
                continue
            if name not in self._asking:
                if self.health.due(name, now):
                    self._asking[name] = (now, time.monotonic(), self._ask(c, timeout))
                continue
            asked_at, real_at, future = self._asking[name]
            if future.done():
                answer = future.result()
            elif time.monotonic() - real_at > 2 * timeout:  # a look that never returns is a failed one
                answer = Answer(f"no answer in {2 * timeout:g} s")
            else:
                continue
            del self._asking[name]
            verdict = self.health.record(name, asked_at, answer)
            if verdict is not None:
                self._stop_unhealthy(c, verdict, answer.why)

    def _ask(self, c: Child, timeout: float) -> Future:
        """One look at ``c``'s ``/health`` in a daemon thread; its answer in the future."""
        future: Future = Future()
        url, worker_id = c.spec.health_url, c.spec.worker_id

        def ask() -> None:
            try:
                future.set_result(self.probe(url, worker_id, timeout))
            except Exception as exc:  # a look that failed is a failed look, never a dead watch
                future.set_result(Answer(f"the check failed ({type(exc).__name__}: {exc})"))

        threading.Thread(target=ask, name=f"health-{c.spec.name}", daemon=True).start()
        return future

    def _stop_unhealthy(self, c: Child, verdict: str, why: Optional[str]) -> None:
        """SIGTERM ``c``'s group now, SIGKILL after ``stop_timeout_s``; its exit is handled as any."""
        self._stopping[c.spec.name] = (self.clock() + self.stop_timeout_s, verdict)
        self.say(f"{self.title}: {c.spec.name} (pid {c.proc.pid}) {verdict}; {c.spec.health_url} last said: {why}: "
                 f"stopping it (SIGTERM, then SIGKILL after {self.stop_timeout_s:g} s)")
        c.signal_group(signal.SIGTERM)

    def _kill_overdue(self) -> None:
        now = self.clock()
        for c in self.children:
            stop = self._stopping.get(c.spec.name)
            if stop is not None and now >= stop[0] and c.alive():
                self.say(f"{self.title}: {c.spec.name} (pid {c.proc.pid}) still running {self.stop_timeout_s:g} s "
                         "after SIGTERM: SIGKILL")
                c.signal_group(signal.SIGKILL)
                self._stopping[c.spec.name] = (float("inf"), stop[1])

    def _how(self, c: Child) -> str:
        """How ``c`` ended, and that launch stopped it when it did."""
        how = c.how_it_ended()
        return f"{how} after launch stopped it as unhealthy" if c.spec.name in self._stopping else how

    def _check_deaths(self, restart: bool = False) -> Optional[int]:
        for c in self.children:
            if c.alive() or c.spec.name in self._due:
                continue
            if restart and c.spec.restart:
                if self._schedule(c):
                    continue
                return 1
            self.say(f"{self.title}: {c.spec.name} (pid {c.proc.pid}) {self._how(c)}; its last lines:\n"
                     f"{c.last_lines()}\n{self.title}: stopping the other processes")
            return 1
        return None

    def _schedule(self, c: Child) -> bool:
        """``c`` exited: its restart is due after its delay (True, and one line says so), or its
        budget is used up (False, and the lines say so)."""
        c.signal_group(signal.SIGKILL)  # whatever it started in its group goes with it
        name, pid, how = c.spec.name, c.proc.pid, self._how(c)
        self._stopping.pop(name, None)
        self._asking.pop(name, None)
        policy = self.restarts.policy
        decision = self.restarts.after_exit(name, self.clock())
        if decision is None:
            self.say(f"{self.title}: {name} (pid {pid}) {how}; it was restarted {self.restarts.in_window(name)} "
                     f"times in the last {policy.window_s:g} s, the most --restart-budget allows: giving up; its "
                     f"last lines:\n{c.last_lines()}\n{self.title}: stopping the other processes")
            return False
        attempt, delay = decision
        launched = next(s for s in self.specs if s.name == name)
        argv, role = role_to_restart(launched.argv, launched.role_file, self._warn)
        self._due[name] = (self.clock() + delay, argv)
        self.say(f"{self.title}: {name} (pid {pid}) {how}: restarting it{f' as a {role} worker' * bool(role)} in "
                 f"{delay:g} s (restart {attempt}, at most {policy.budget} in {policy.window_s:g} s)")
        return True

    def _start_due(self) -> Optional[int]:
        """Start again the children whose delay passed (None), or say which could not be (1)."""
        now = self.clock()
        for name, (when, argv) in list(self._due.items()):
            if when > now:
                continue
            del self._due[name]
            i = next(i for i, c in enumerate(self.children) if c.spec.name == name)
            spec = replace(self.children[i].spec, argv=argv)
            try:
                child = start(spec, self.echo, self._echo_lock, self._preexec)
            except (OSError, subprocess.SubprocessError) as exc:
                self.say(f"{self.title}: cannot start {name} again ({' '.join(argv)}): {exc}; stopping the other "
                         "processes")
                return 1
            child.reader.start()
            self.children[i] = child
            self.health.started(name, self.clock())
            self.say(f"{self.title}: {name} started again: pid {child.proc.pid}")
        return None

    def _warn(self, text: str) -> None:
        self.say(f"{self.title}: warning: {text}")

    def _signal_name(self) -> str:
        return f"received {signal.Signals(self._signals[-1]).name}"

    def _print_summary(self) -> None:
        width = max(len(c.spec.name) for c in self.children)
        lines = [f"{self.title}: all {len(self.children)} processes are up"]
        for c in self.children:
            where = f"  {c.spec.url}" if c.spec.url else ""
            note = f"  ({c.spec.note})" if c.spec.note else ""
            lines.append(f"  {c.spec.name:<{width}}  pid {c.proc.pid}{where}{note}")
        router = next((c for c in self.children if c.spec.name == "router" and c.spec.url), None)
        if router is not None:
            url = router.spec.url
            key = " -H 'Authorization: Bearer <your API key>'" if (router.spec.env or {}).get(API_KEY_ENV) else ""
            lines.append(f"splitserve ready: {url}  try: curl {url}/v1/completions{key} -H 'Content-Type: "
                         f"application/json' -d '{{\"prompt\": \"Hello, my name is\", \"max_tokens\": 16}}'")
        lines += self.notes
        lines.append("Ctrl-C stops every process.")
        self.say("\n".join(lines))

    def _stop_all(self) -> None:
        seen = len(self._signals)
        deadline = time.monotonic() + self.stop_timeout_s
        for last in (False, True):  # the stop_last children once the others are gone
            group = [c for c in self.children if c.spec.stop_last == last]
            for c in group:
                if c.alive():
                    c.signal_group(signal.SIGTERM)
            while any(c.alive() for c in group) and time.monotonic() < deadline:
                if len(self._signals) > seen:
                    self.say(f"{self.title}: {self._signal_name()} again: killing now")
                    deadline = 0.0
                    break
                time.sleep(0.05)
        for c in self.children:
            if c.alive():
                self.say(f"{self.title}: {c.spec.name} (pid {c.proc.pid}) still running after SIGTERM: SIGKILL")
            c.signal_group(signal.SIGKILL)  # also takes down anything it started in its group
        for c in self.children:
            try:
                c.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.say(f"{self.title}: {c.spec.name} (pid {c.proc.pid}) did not exit after SIGKILL")
            if c.reader.is_alive():
                c.reader.join(timeout=1.0)
