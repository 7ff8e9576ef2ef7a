"""One child process of ``splitserve launch``: what to start (:class:`ChildSpec`) and the process
while it runs (:class:`Child`: its output echoed with a ``[name]`` prefix and its last lines kept,
how it ended, its process group signalled).

On Linux every child is started with ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` (:func:`die_with_parent`,
through ctypes, in the child between fork and exec), so the kernel sends it SIGTERM when launch
dies; a child whose parent died before the prctl took effect exits at once. The death signal is
tied to the thread that started the child: launch's main thread, alive until launch exits.
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Mapping, Optional, TextIO

TAIL_LINES = 30
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ChildSpec:
    name: str
    """Short unique name used in every message (``prefill-0``, ``router``)."""
    argv: tuple[str, ...]
    url: Optional[str] = None
    """Where it serves, for the summary."""
    health_url: Optional[str] = None
    """GET answering 200 means ready; None: ready once started."""
    note: str = ""
    """Extra words for the summary (``bootstrap port 8998``)."""
    env: Optional[Mapping[str, str]] = None
    """Extra environment variables (on top of launch's own)."""
    stop_last: bool = False
    """Stopped only once every other child has exited (or the stop bound passed): the etcd that
    the workers revoke their leases in as they stop."""
    worker_id: Optional[str] = None
    """The id its ``/health`` must answer with to count as ready (a worker): another process that
    answers 200 on its port is not it."""
    restart: bool = False
    """Started again when it exits once every child was up (a worker), as :class:`Supervisor`'s
    restart policy allows; otherwise its exit stops everything."""
    role_file: Optional[str] = None
    """Where the worker writes the role it serves in (``serve --role-file``): a restart takes
    that role (``--role``), so a worker switched by ``POST /role`` comes back switched."""


def start(spec: ChildSpec, echo: Optional[TextIO], echo_lock: threading.Lock, preexec=None) -> "Child":
    """Start ``spec`` in a session (process group) of its own, its stdout and stderr merged into
    a pipe; its output thread is not started yet (:attr:`Child.reader`: start it once no more
    forks with ``preexec`` are to come). OSError or SubprocessError when it cannot be started."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **dict(spec.env or {}))
    proc = subprocess.Popen(list(spec.argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=preexec)
    return Child(spec, proc, echo, echo_lock)


class Child:
    """One running child: its process, and the thread that echoes and keeps its output."""

    def __init__(self, spec: ChildSpec, proc: subprocess.Popen, echo: Optional[TextIO], echo_lock: threading.Lock):
        self.spec = spec
        self.proc = proc
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._echo, self._echo_lock = echo, echo_lock
        self.reader = threading.Thread(target=self._read, name=f"output-{spec.name}", daemon=True)

    def _read(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.tail.append(line)
            if self._echo is not None:
                with self._echo_lock:
                    self._echo.write(f"[{self.spec.name}] {line}\n")
                    self._echo.flush()
        self.proc.stdout.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def how_it_ended(self) -> str:
        rc = self.proc.returncode
        if rc is not None and rc < 0:
            try:
                return f"was killed by signal {signal.Signals(-rc).name}"
            except ValueError:
                return f"was killed by signal {-rc}"
        return f"exited with code {rc}"

    def last_lines(self) -> str:
        if self.reader.is_alive():
            self.reader.join(timeout=1.0)  # the last lines may still be in the pipe
        lines = list(self.tail)
        return "\n".join("    " + line for line in lines) if lines else "    (no output)"

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # its own session: the group id is its pid
        except (ProcessLookupError, PermissionError):
            pass


def die_with_parent(parent_pid: int):
    """A ``preexec_fn`` (Linux): SIGTERM this child when launch dies; exit if it already has."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec
