"""A supervisor script run in a process of its own (it installs signal handlers, and tests signal
it), with its output in a log folder; and whether the processes it started are gone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import Iterable

from conftest import CACHE_DIR, REPO, log_dir


class SupervisorRun:
    """``script`` run with ``args`` (``python -c script *args``), stdout and stderr in a new log
    folder named with ``prefix``."""

    def __init__(self, script: str, args: list[str], prefix: str):
        self.logdir = log_dir(prefix)
        env = dict(os.environ, PYTHONUNBUFFERED="1", SPLITSERVE_CACHE=str(CACHE_DIR))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        with open(self.logdir / "out.log", "wb") as out, open(self.logdir / "err.log", "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", script, *args], cwd=REPO, env=env, stdout=out,
                                         stderr=err, stdin=subprocess.DEVNULL)

    def out(self) -> str:
        return (self.logdir / "out.log").read_text(errors="replace")

    def pids(self) -> set[int]:
        """Every child pid a launch supervisor named: in its summary and at each restart."""
        text = self.out()
        return {int(p) for p in re.findall(r"^  \S+\s+pid (\d+)", text, re.M) + re.findall(r"started again: pid (\d+)",
                                                                                            text)}

    def err(self) -> str:
        return (self.logdir / "err.log").read_text(errors="replace")

    def wait_for_output(self, text: str, timeout: float) -> None:
        """Until stdout or stderr holds ``text``."""
        self._wait_until(lambda: text in self.out() or text in self.err(), repr(text), timeout)

    def wait_for_line(self, pattern: str, timeout: float, count: int = 1) -> None:
        """Until stdout holds ``pattern`` (a regular expression) ``count`` times."""
        self._wait_until(lambda: len(re.findall(pattern, self.out())) >= count, f"{pattern!r} {count} times", timeout)

    def _wait_until(self, said, what: str, timeout: float) -> None:
        """An AssertionError with both logs when the process ends or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if said():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"launch never said {what}\n--- stdout ---\n{self.out()}\n"
                             f"--- stderr ---\n{self.err()[-4000:]}")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"launch did not exit in {timeout}s\n{self.out()}\n{self.err()[-4000:]}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


def started_runs(make):
    """A fixture's body: yields a function that starts ``make(*args, **kwargs)`` and keeps it, and
    kills every run it started afterwards."""
    started: list = []

    def start(*args, **kwargs):
        started.append(make(*args, **kwargs))
        return started[-1]

    yield start
    for item in started:
        item.kill()


def running(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_all_gone(pids: Iterable[int], timeout: float = 5.0) -> None:
    pids = list(pids)
    assert pids, "no process to wait for"
    deadline = time.monotonic() + timeout
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if running(p)], f"still running: {pids}"
