"""The supervisor of ``splitserve launch`` (:class:`Supervisor`): starts a list of children, waits
until each is healthy, keeps its workers alive, and stops everything cleanly. It runs any list of
:class:`~splitserve.launch.child.ChildSpec` (tests hand it plain ``python -c`` children).

Each child runs in its own session (process group), its output echoed with a ``[name]`` prefix and
its last lines kept. ``run`` waits until every child with a ``health_url`` answers 200 there (at
most ``ready_timeout_s``; else it names the unhealthy ones with their last lines and fails; a
child that exits before all are up stops everything), prints where each listens, then watches: a
child marked ``restart`` (a worker) that exits is started again as ``restart.py``'s policy says,
with one line saying which, why, the attempt and the delay, until its budget is used up (then the
others are stopped and ``run`` returns 1); any other child that exits does the same at once.
SIGINT or SIGTERM stops every child and ``run`` returns 0.

Stopping: SIGTERM to each child's process group, then SIGKILL to those still alive after
``stop_timeout_s`` (a second Ctrl-C skips the wait); a ``stop_last`` child (the etcd of
``--discovery local``) is stopped once the others exited. A child that exits has its group killed
at once. On Linux every child dies with launch even when launch is killed with SIGKILL
(``child.die_with_parent``, which takes no lock and allocates nothing between fork and exec, as
the output threads run); elsewhere a SIGKILL of launch may leave children.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace
from typing import Callable, Optional, Sequence, TextIO

from splitserve.auth import API_KEY_ENV
from splitserve.launch.child import Child, ChildSpec, die_with_parent, start
from splitserve.launch.restart import RestartPolicy, Restarts, role_to_restart

POLL_S = 0.2


class Supervisor:
    """Runs, watches and stops a list of children; :meth:`run` returns launch's exit code."""

    def __init__(self, specs: Sequence[ChildSpec], ready_timeout_s: float = 300.0, stop_timeout_s: float = 40.0,
                 out: TextIO = sys.stdout, echo: Optional[TextIO] = sys.stderr, title: str = "splitserve launch",
                 notes: Sequence[str] = (), restart: Optional[RestartPolicy] = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        """``restart``: how the children marked ``restart`` are started again (None, or a budget
        of 0: never; their exit stops everything). ``clock`` and ``sleep``: the time the restart
        delays are counted in, and how the watch waits between looks."""
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
        deadline = time.monotonic() + self.ready_timeout_s
        waiting = [c for c in self.children if c.spec.health_url]
        why: dict[str, str] = {}  # child name -> why its last check did not count
        while waiting:
            if self._signals:
                self.say(f"{self.title}: {self._signal_name()} before every process was up: stopping")
                return 0
            code = self._check_deaths()
            if code is not None:
                return code
            why = {c.spec.name: _not_ready(c.spec.health_url, c.spec.worker_id) for c in waiting}
            waiting = [c for c in waiting if why[c.spec.name] is not None]
            if waiting and time.monotonic() > deadline:
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
            self.sleep(POLL_S)

    def _check_deaths(self, restart: bool = False) -> Optional[int]:
        for c in self.children:
            if c.alive() or c.spec.name in self._due:
                continue
            if restart and c.spec.restart:
                if self._schedule(c):
                    continue
                return 1
            self.say(f"{self.title}: {c.spec.name} (pid {c.proc.pid}) {c.how_it_ended()}; its last lines:\n"
                     f"{c.last_lines()}\n{self.title}: stopping the other processes")
            return 1
        return None

    def _schedule(self, c: Child) -> bool:
        """``c`` exited: its restart is due after its delay (True, and one line says so), or its
        budget is used up (False, and the lines say so)."""
        c.signal_group(signal.SIGKILL)  # whatever it started in its group goes with it
        name, pid, how = c.spec.name, c.proc.pid, c.how_it_ended()
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


def _not_ready(url: str, worker_id: Optional[str] = None) -> Optional[str]:
    """None when ``url`` answers 200 (and, given ``worker_id``, as that worker), else why not."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
    try:
        with opener.open(url, timeout=1.0) as resp:
            if resp.status != 200:
                return f"answered {resp.status}"
            if worker_id is None:
                return None
            body = resp.read(65536)
    except urllib.error.HTTPError as exc:
        return f"answered {exc.code}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return f"no answer ({exc})"
    try:
        seen = json.loads(body).get("id")
    except (ValueError, AttributeError):
        seen = None
    return None if seen == worker_id else f"another process answers there, as {str(seen)[:130]!r}, not {worker_id!r}"
