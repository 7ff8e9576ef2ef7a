"""The request lifecycle of a disaggregated worker: pure state machines, events in, actions out.

Prefill side, one room (``prefill_table.py``)::

    BOOTSTRAPPING -> QUEUED -> PREFILLING -> TRANSFERRING -> FINISHED | ABORTED | FAILED(reason)

Decode side, one room (``decode_table.py``)::

    PREALLOC -> AWAITING_KV -> DECODING -> FINISHED | ABORTED | FAILED(reason)
    PREALLOC -> PREFILLING -> DECODING                       (decode alone, or its KV lost: recomputed)
    AWAITING_KV -> [RECLAIMING ->] PREFILLING -> DECODING    (its KV lost: recomputed)

Every allowed move, and the deadline of each live state, is declared once per role in
``transitions.py``; the tables check each move against it. The engine loop owns one table per role
and each iteration hands it the inbox's events (``table.handle(event, now)``) and the time
(``table.expire(now)``), carrying out the actions returned. Nothing in this package reads a clock,
sleeps, locks or does I/O: ``now`` is an argument, so tests drive every order of events with a
fake clock. The rules and the tests that prove each: ``docs/lifecycle.md``.
"""

from splitserve.disagg.lifecycle.actions import (
    Action, Cancel, CancelWrites, ComputePrompt, CountOutcome, DisconnectPeer, Enqueue, FreePages, KVFallback,
    LogTerminal, Moved, Notice, NoticeKind, NotifyClient, QuarantinePages, ReleaseQuarantine, ReservePages,
    ResetTransfer, SendToPeer, StartDecode, StartWrite,
)
from splitserve.disagg.lifecycle.deadlines import DeadlineHeap, Deadlines
from splitserve.disagg.lifecycle.decode_table import DecodeTable
from splitserve.disagg.lifecycle.events import (
    Admitted, ChunkDone, ClientAbort, DecodeStep, Finished, ForwardDone, FromPeer, KVLost, LocalFailure, PagesReserved,
    PeerHeard, PeerInfo, PeerLost, Preempted, PromptChunk, RequestArrived, Scheduled, WriteDone, WriteFailed,
)
from splitserve.disagg.lifecycle.peers import Peer, PeerTable
from splitserve.disagg.lifecycle.prefill_table import PrefillTable
from splitserve.disagg.lifecycle.states import (
    DecodeState, Ending, LifecycleError, Outcome, PrefillState, Reason, Role, is_terminal,
)
from splitserve.disagg.lifecycle.table import RoomTable
from splitserve.disagg.lifecycle.transitions import IllegalMove, Transitions, Waits

__all__ = [
    "Action", "Admitted", "Cancel", "CancelWrites", "ChunkDone", "ClientAbort", "ComputePrompt", "CountOutcome",
    "DeadlineHeap", "Deadlines", "DecodeState", "DecodeStep", "DecodeTable", "DisconnectPeer", "Ending",
    "Enqueue", "Finished", "ForwardDone", "FreePages", "FromPeer", "IllegalMove", "KVFallback",
    "KVLost", "LifecycleError", "LocalFailure", "LogTerminal", "Moved", "Notice", "NoticeKind",
    "NotifyClient", "Outcome", "PagesReserved", "Peer", "PeerHeard", "PeerInfo", "PeerLost",
    "PeerTable", "Preempted", "PrefillState", "PrefillTable", "PromptChunk", "QuarantinePages", "Reason",
    "ReleaseQuarantine", "RequestArrived", "ReservePages", "ResetTransfer", "Role", "RoomTable",
    "Scheduled", "SendToPeer", "StartDecode", "StartWrite", "Transitions", "Waits", "WriteDone",
    "WriteFailed", "is_terminal",
]
