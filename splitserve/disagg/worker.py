"""A prefill or decode worker's engine: the engine loop (``engine/async_engine.py``) with the
role of its side (``prefill_role.py``, ``decode_role.py``), and the fault injection it may run with;
:func:`role_for` builds a role alone (a worker that switches its role starts another on its engine).

:func:`engine_for_role` is what ``splitserve serve --role prefill|decode`` builds: the same
:class:`~splitserve.engine.async_engine.AsyncEngine` (and so the same HTTP interface) as a
colocated worker, composed with another role.
"""

from __future__ import annotations

import logging
from typing import Optional

from splitserve.config import EngineConfig, ServerConfig
from splitserve.disagg.control import ControlFaults
from splitserve.disagg.faults import Faults, TokenFault
from splitserve.disagg.lifecycle import Deadlines
from splitserve.disagg.seams import Seams
from splitserve.disagg.transfer.thread import FaultConfig
from splitserve.engine.async_engine import AsyncEngine
from splitserve.transfer_backends import check_served

log = logging.getLogger(__name__)


def parse_faults(spec: str) -> Faults:
    """``--inject-faults`` (off when empty; read once at start), comma-separated:
    ``stall_writes``, ``stall_writes_after=N``, ``fail_writes``, ``notify_drop=P``, ``control_drop=P``, ``control_delay=P``,
    ``control_delay_s=S``, ``control_duplicate=P``, ``seed=N``, ``wedge_loop`` (the engine loop blocks
    as soon as it holds a room, until shutdown), ``hang_transfer`` (the transfer thread blocks once
    a write is in flight), ``block_zmq_io`` (the ZMQ I/O thread blocks for good as soon as a room
    arrives), ``kill_after_tokens=N`` / ``pause_after_tokens=N`` (the process SIGKILLs / SIGSTOPs
    itself once it has streamed N tokens of one choice of some request: ``faults.TokenFault``)."""
    transfer, control, wedge, block_io, tokens = {}, {}, False, False, None
    for item in filter(None, (x.strip() for x in spec.split(","))):
        key, _, value = item.partition("=")
        try:
            if key in ("stall_writes", "fail_writes") and not value:
                transfer[key] = True
            elif key == "wedge_loop" and not value:
                wedge = True
            elif key == "block_zmq_io" and not value:
                block_io = True
            elif key == "hang_transfer" and not value:
                transfer["hang"] = True
            elif key in ("control_drop", "control_delay", "control_duplicate", "control_delay_s"):
                control[key.removeprefix("control_")] = float(value)
            elif key == "stall_writes_after":
                transfer[key] = int(value)
            elif key == "notify_drop":
                transfer["notify_drop"] = float(value)
            elif key in ("kill_after_tokens", "pause_after_tokens") and tokens is None:
                tokens = TokenFault(key.split("_")[0], int(value))
            elif key == "seed":
                control["seed"] = transfer["seed"] = int(value)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"unknown fault {item!r}; see `splitserve serve --help`") from None
    return Faults(FaultConfig(**transfer), ControlFaults(**control), wedge, block_io, tokens)


def engine_for_role(config: EngineConfig, server: ServerConfig, deadlines: Deadlines,
                    incarnation: Optional[str] = None) -> AsyncEngine:
    """``incarnation``: the process start's id (the one its ``/health`` reports); drawn when None."""
    return AsyncEngine(config, role_for(server, deadlines, incarnation), loop_stall_s=server.loop_stall_s)


def role_for(server: ServerConfig, deadlines: Deadlines, incarnation: Optional[str] = None):
    """The role of ``server.role`` (prefill or decode), not started: what ``engine_for_role``
    composes with the engine loop, and what a worker switching its role (``POST /role``) starts on
    the engine it has. ValueError for a role or transfer backend that is neither."""
    from splitserve.disagg.decode_role import DecodeRole
    from splitserve.disagg.prefill_role import PrefillRole

    check_served(server.transfer_backend)
    cls = {"prefill": PrefillRole, "decode": DecodeRole}.get(server.role)
    if cls is None:
        raise ValueError(f"--role must be colocated, prefill or decode, got {server.role!r}")
    faults = parse_faults(server.inject_faults)
    if server.inject_faults:
        log.warning("fault injection is ON: %s", server.inject_faults)
    seams = Seams(incarnation=lambda: incarnation) if incarnation else Seams()
    return cls(server, deadlines.validate(), faults, seams)
