"""Is the process's ZMQ I/O thread still moving? A loopback round trip through it, timed.

Every control socket of a worker (and the tcp transfer's) lives in one ZMQ context,
``zmq.Context.instance()``, whose I/O thread (``ZMQbg/IO/0``) moves every byte of every one of
them. That thread can block for good — libzmq sends a socket monitor's events blocking, and an
event whose reader is gone or behind blocks it (libzmq #3575; it froze a decode worker's whole
control plane once) — and then nothing in Python raises or stops beating: the control thread
polls on, its sockets just never move a frame. So it is watched from the outside, like the
engine loop: the control thread sends one small frame every ``PROBE_S`` from a PUSH socket to a
PULL socket bound on 127.0.0.1 (TCP, so the frame crosses the I/O thread; inproc would not) and
notes when one comes back. :meth:`IoProbe.age` is the time since a probe last came back: a blocked
I/O thread lets it grow, and ``/health`` fails past ``--loop-stall-s`` (``disagg/role.py``).

:func:`block_io_thread` is the fault that reproduces the blocking on purpose (``--inject-faults
block_zmq_io``), for the test that shows it is seen.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import zmq

log = logging.getLogger(__name__)

PROBE_S = 0.5  # how often a probe is sent; a healthy I/O thread keeps the age under about this
_blocked: list = []  # the fault's socket, kept: collected, it would close before its event comes


class IoProbe:
    """The loopback round trip of one ZMQ context; :meth:`step` on the control thread, :meth:`age`
    from any thread."""

    def __init__(self, context: Optional[zmq.Context] = None, clock: Callable[[], float] = time.monotonic):
        ctx = context or zmq.Context.instance()
        self.clock = clock
        self._pull = ctx.socket(zmq.PULL)
        self._push = ctx.socket(zmq.PUSH)
        for sock in (self._pull, self._push):
            sock.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 4)  # a blocked thread holds a few probes, never a pile
        self._pull.setsockopt(zmq.RCVHWM, 4)
        port = self._pull.bind_to_random_port("tcp://127.0.0.1")
        self._push.connect(f"tcp://127.0.0.1:{port}")
        self._back = self._sent = self.clock()

    def step(self) -> None:
        """Take the probes that came back; send the next one when it is due. Never blocks."""
        now = self.clock()
        while True:
            try:
                self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._back = now
        if now - self._sent >= PROBE_S:
            self._sent = now
            try:
                self._push.send(b"?", zmq.NOBLOCK)
            except zmq.Again:  # the few in flight have not come back: the age says so
                pass

    def age(self) -> float:
        """Seconds since a probe last came back (any thread may ask)."""
        return self.clock() - self._back

    def close(self) -> None:
        self._push.close(0)
        self._pull.close(0)


def block_io_thread(context: Optional[zmq.Context] = None) -> None:
    """Fault injection: block ``context``'s I/O thread for good, as libzmq #3575 did — a socket
    monitor whose reading end is closed before the monitor is stopped, then an event (connection
    attempts to a closed port, every 100 ms) that the I/O thread can never hand over."""
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_ALL)
    monitor.close(0)  # the reader gone, the monitor left running: its next event blocks the thread
    sock.connect("tcp://127.0.0.1:1")
    _blocked.append(sock)
    log.error("injected fault: the ZMQ I/O thread blocks now (until the process ends)")
