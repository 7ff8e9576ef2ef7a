"""Actions: what a room table asks the engine loop to do. Execute them in the order given.

The order matters in one place: ``DisconnectPeer`` comes before the ``FreePages`` /
``ReleaseQuarantine`` of that peer's rooms, because tearing the connection down is what makes
sure none of its writes can still land.

Every move of a room is one ``Moved``. Every terminal transition emits exactly one
``NotifyClient``, one ``LogTerminal`` and one ``CountOutcome`` (docs/design.md, rule 7). Everything else worth a line and a counter (a rejected
message, a tombstone, a transfer reset) is a ``Notice``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional, Union

from splitserve.disagg.lifecycle.peers import Peer
from splitserve.disagg.lifecycle.states import Ending, Outcome, Reason, Role, State


@dataclass(frozen=True)
class SendToPeer:
    """Send control message ``msg`` (a ``splitserve.disagg.protocol`` message) to ``peer``.
    ``KVDone`` may travel as the notification of an empty write: every write has completed."""

    peer: Peer
    msg: Any


# -- work for the engine -------------------------------------------------------------------------


@dataclass(frozen=True)
class Enqueue:
    """Prefill: put the room in the forward-pass queue (answer with ``Scheduled``)."""

    room: int
    rid: str


@dataclass(frozen=True)
class ReservePages:
    """Decode: reserve ``n_pages`` KV pages for the room (answer with ``PagesReserved``)."""

    room: int
    n_pages: int


@dataclass(frozen=True)
class Cancel:
    """Drop the room from every engine queue and batch; a no-op where it is absent. Frees
    nothing: pages given to a room are its own until ``FreePages`` / ``ReleaseQuarantine``."""

    room: int
    rid: str


@dataclass(frozen=True)
class StartDecode:
    """Decode: the room's KV has landed; start generating after ``first_token``."""

    room: int
    rid: str
    first_token: int
    first_logprobs: bytes = b""  # from prefill, with the token (the engine checks them)


@dataclass(frozen=True)
class ComputePrompt:
    """Decode: compute the room's prompt here, into the pages the room holds (those past its cached
    prefix), then generate from it as if the KV had come: the room came alone, or its KV will not
    come (``KVFallback`` came first). No write of a prefill can reach those pages any more."""

    room: int
    rid: str
    reason: Optional[Reason] = None
    """Why its KV will not come (a fallback), or None: it came alone."""


@dataclass(frozen=True)
class KVFallback:
    """Decode: the room learned, before its first token, that its KV will not come (``reason``);
    it recomputes the prompt instead of failing (``--kv-failure-policy recompute``). Counted in
    ``splitserve_kv_fallback_total{reason}``."""

    room: int
    rid: str
    reason: Reason
    detail: str = ""


# -- transfer --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StartWrite:
    """Prefill: write ``src_pages[i]`` (ours) to ``dst_pages[i]`` (the peer's), for every i; the
    transfer thread answers with ``WriteDone`` or ``WriteFailed`` for ``write_id``."""

    room: int
    write_id: int
    peer: Peer
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]


@dataclass(frozen=True)
class CancelWrites:
    """Prefill: the room ended; stop these writes where the backend can. Keep reporting each
    one's ``WriteDone`` / ``WriteFailed`` once it has settled."""

    room: int
    write_ids: tuple[int, ...]


@dataclass(frozen=True)
class ResetTransfer:
    """Prefill: these writes have not settled ``write_drain_s`` after the room ended. Tear down the
    transfer connection to ``peer`` (so nothing in flight can land), then report ``WriteFailed``
    for every write to it. Repeated every ``write_drain_s`` while they stay unsettled."""

    peer: Peer
    room: int
    write_ids: tuple[int, ...]


@dataclass(frozen=True)
class DisconnectPeer:
    """``peer`` is declared lost: close the control and transfer connections to that incarnation,
    so that none of its writes can land, and forget its transfer metadata. ``rooms``: the rooms
    bound to it, whose memory the actions after this one free (a decode whose fence fails keeps
    theirs quarantined instead)."""

    peer: Peer
    detail: str
    rooms: tuple[int, ...] = ()


# -- memory ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FreePages:
    """Return these pages to the allocator. Emitted once per page, when its room is released."""

    room: int
    pages: tuple[int, ...]


@dataclass(frozen=True)
class QuarantinePages:
    """Decode: the room ended but the peer may still write into these pages. Keep them out of the
    allocator (count them as quarantined) until ``ReleaseQuarantine``."""

    room: int
    pages: tuple[int, ...]


@dataclass(frozen=True)
class ReleaseQuarantine:
    """Decode: no write can land in these quarantined pages any more; return them to the allocator."""

    room: int
    pages: tuple[int, ...]


# -- the end of a request, and what an operator sees ------------------------------------------------


@dataclass(frozen=True)
class NotifyClient:
    """Answer the request's HTTP call: success, or the error for ``ending``."""

    rid: str
    room: int
    ending: Ending


@dataclass(frozen=True)
class LogTerminal:
    """One log line at the end of a request. ``last_state`` is None for a request refused on arrival."""

    role: Role
    rid: str
    room: int
    last_state: Optional[State]
    age_s: float
    ending: Ending

    def line(self) -> str:
        last = self.last_state.value if self.last_state is not None else "-"
        return (f"{self.role.value} request {self.rid} room={self.room} ended {self.ending} "
                f"last_state={last} age={self.age_s:.3f}s")


@dataclass(frozen=True)
class CountOutcome:
    """Increment ``splitserve_requests_total{role, outcome, reason}``."""

    role: Role
    outcome: Outcome
    reason: Reason


@dataclass(frozen=True)
class Moved:
    """Room ``room`` moved from ``before`` (None: it arrived) to ``after`` (a live state, or its
    outcome when it ended, with its ``ending``) after ``seconds`` in ``before``; ``cause``: what
    moved it (the event, ``deadline``). Every move is one its role's ``transitions`` declare,
    checked before it is made. Timelines and the time-in-state histogram are read from these."""

    room: int
    before: Optional[State]
    after: State
    cause: str
    seconds: float = 0.0
    ending: Optional[Ending] = None


class NoticeKind(str, enum.Enum):
    WRONG_PEER = "wrong_peer"
    """A message for a room from a peer that does not own it: rejected."""
    DUPLICATE_REGISTRATION = "duplicate_registration"
    """A second registration for a room from its own peer: ignored."""
    FROM_LOST_PEER = "from_lost_peer"
    """A message from a peer already declared lost: rejected (never acted on)."""
    STALE_INCARNATION = "stale_incarnation"
    """A registration meant for an earlier incarnation of this worker: rejected."""
    LATE_MESSAGE = "late_message"
    """A message for a room that has ended, is no longer known, or is past the state the message
    is for (a duplicate): nothing to do."""
    UNEXPECTED_MESSAGE = "unexpected_message"
    """A message type this side never receives."""
    OUT_OF_ORDER = "out_of_order"
    """An engine event the room's state does not expect (pages it carried are freed at once)."""
    DUPLICATE_WRITE_REPORT = "duplicate_write_report"
    """A WriteDone/WriteFailed for a write that is not in flight."""
    ABORT_AFTER_END = "abort_after_end"
    """An abort for a room that has already ended: a logged no-op."""
    TOMBSTONE = "tombstone"
    """An abort or failure for a room not seen yet: remembered, so that its request is refused."""
    PENDING_EXPIRED = "pending_registration_expired"
    """A registration that came before its request waited too long; decode was told."""
    TRANSFER_RESET = "transfer_reset"
    """A terminal room's writes did not settle in time: the transfer connection is reset."""
    PEER_LOST = "peer_lost"
    """A peer was declared lost; its rooms fail."""
    CAPPED = "capped"
    """A peer's message that would make us hold more than a cap allows (a pending registration, a
    tombstone for a room never seen; per peer and in total): dropped, nothing changed."""


@dataclass(frozen=True)
class Notice:
    """One log line and one count (``splitserve_lifecycle_notices_total{role, kind}``)."""

    role: Role
    kind: NoticeKind
    room: Optional[int]
    detail: str = ""


Action = Union[
    SendToPeer, Enqueue, ReservePages, Cancel, StartDecode, ComputePrompt, KVFallback, StartWrite, CancelWrites, ResetTransfer,
    DisconnectPeer, FreePages, QuarantinePages, ReleaseQuarantine, NotifyClient, LogTerminal,
    CountOutcome, Moved, Notice,
]
