"""The fault injection a disaggregated worker may run with (``--inject-faults``, parsed by
``worker.py``; off by default)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Faults:
    """Fault injection of a disaggregated worker (``--inject-faults``; off by default)."""

    transfer: object = None  # transfer.thread.FaultConfig
    control: object = None  # control.ControlFaults
    wedge_loop: bool = False
    block_zmq_io: bool = False
