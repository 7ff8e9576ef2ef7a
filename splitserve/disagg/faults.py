"""The fault injection a disaggregated worker may run with (``--inject-faults``, parsed by
``worker.py``; off by default), and the one fault struck from the HTTP side: a decode worker that
dies (``kill_after_tokens=N``) or stops (``pause_after_tokens=N``) once it has streamed N tokens
of one choice of some request, so that a test cuts a stream at a token, not at a time."""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger(__name__)


class TokenFault:
    """Strike once: after the write that brought one choice of a request to ``after`` tokens
    streamed, the process SIGKILLs itself (``kill``: gone at once, no shutdown, as the kernel's
    OOM killer ends it) or SIGSTOPs itself (``pause``: alive and silent, every thread stopped,
    until someone sends SIGCONT)."""

    SIGNALS = {"kill": signal.SIGKILL, "pause": signal.SIGSTOP}

    def __init__(self, action: str, after: int, strike=None):
        if action not in self.SIGNALS or after < 1:
            raise ValueError(f"{action}_after_tokens needs a positive count")
        self.action, self.after = action, after
        self.struck = False
        self._strike = strike or (lambda sig: os.kill(os.getpid(), sig))  # a test's seam

    def streamed(self, rid: str, tokens: int) -> None:
        """Request ``rid`` has streamed ``tokens`` tokens of one choice (its write done)."""
        if self.struck or tokens < self.after:
            return
        self.struck = True
        log.critical("INJECTED FAULT %s_after_tokens=%d: request %s streamed %d tokens; %s this process now",
                     self.action, self.after, rid, tokens, "killing" if self.action == "kill" else "stopping")
        self._strike(self.SIGNALS[self.action])


@dataclass(frozen=True)
class Faults:
    """Fault injection of a disaggregated worker (``--inject-faults``; off by default)."""

    transfer: object = None  # transfer.thread.FaultConfig
    control: object = None  # control.ControlFaults
    wedge_loop: bool = False
    block_zmq_io: bool = False
    tokens: Optional[TokenFault] = None
