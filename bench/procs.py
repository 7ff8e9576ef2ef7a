"""What the benches share to run servers: a free port, and stopping what they started (SIGTERM to
every process, then a bounded wait each, then SIGKILL), so no bench leaves a server behind."""

from __future__ import annotations

import signal
import socket
import subprocess
from typing import Iterable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_all(procs: Iterable[subprocess.Popen], timeout: float = 30.0) -> None:
    """SIGTERM every process still running, then wait up to ``timeout`` for each, killing what is
    left: all are signalled first, so their shutdowns overlap."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
