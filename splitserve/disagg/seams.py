"""Where a disaggregated role meets the world outside its process, as parameters: production
passes the defaults, the simulator (``splitserve/sim/``) its own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass(frozen=True)
class Seams:
    """Where a role meets the world outside its process. Production uses the defaults; the
    simulator (``splitserve/sim/``) passes its own — simulated sockets, a simulated transfer
    network, incarnations drawn from its seed — and ``threads=False``: it drives each thread's
    ``step()`` itself instead of starting it."""

    incarnation: Optional[Callable[[], str]] = None
    """Draws this process's incarnation id (default ``bootstrap.new_incarnation``, a uuid4)."""
    bind: Optional[Callable] = None
    """Prefill: ``bind(host, port)`` -> the control endpoint (default a ZMQ ROUTER)."""
    dial: Optional[Callable] = None
    """Decode: ``dial(address, identity)`` -> one session's control connection (default a ZMQ DEALER)."""
    transfer_opts: dict = field(default_factory=dict)
    """Extra options for the transfer backend and the receiving links."""
    links: Optional[Callable] = None
    """Decode: ``links(backend, agent_prefix, buffer, **opts)`` -> its receiving links (default
    ``transfer.links.ReceiveLinks``)."""
    io_probe: Optional[Callable] = None
    """``io_probe()`` -> what watches the ZMQ I/O thread (default ``control.io_probe.IoProbe`` on the
    process's context; a simulator, which has no ZMQ, returns None)."""
    control_wake: Optional[Callable[[], None]] = None
    """How the engine loop wakes the control thread (default: a byte down its wake pipe)."""
    threads: bool = True
    """Start the control and transfer threads."""
