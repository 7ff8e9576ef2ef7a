"""States and endings of a room (one request on one worker).

Prefill side, in order::

    BOOTSTRAPPING -> QUEUED -> PREFILLING -> TRANSFERRING -> (terminal)

Decode side, in order::

    PREALLOC -> AWAITING_KV -> DECODING -> (terminal)

Terminal, on both sides: ``Outcome.FINISHED``, ``Outcome.ABORTED``, ``Outcome.FAILED`` with a
:class:`Reason`. Live states and outcomes are different types, so "is it terminal?" is a type test
(:func:`is_terminal`), never a comparison of numbers. States are plain enums, so they have no
order at all: ``max()`` of two states raises TypeError instead of quietly letting a later state
win over a terminal one (DESIGN §2, rule 2).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Union


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class PrefillState(enum.Enum):
    BOOTSTRAPPING = "BOOTSTRAPPING"
    """The request is here; waiting for the decode worker's registration (its page ids)."""
    QUEUED = "QUEUED"
    """Registered; waiting for the scheduler to start its forward pass."""
    PREFILLING = "PREFILLING"
    """Chunks run; each finished chunk's full pages start transferring."""
    TRANSFERRING = "TRANSFERRING"
    """Forward pass done; waiting for the last write to complete."""


class DecodeState(enum.Enum):
    PREALLOC = "PREALLOC"
    """The request is here; waiting for KV pages and the prefill worker's bootstrap info."""
    AWAITING_KV = "AWAITING_KV"
    """Registered with prefill (pages reserved and sent); waiting for every write and the first token."""
    DECODING = "DECODING"
    """The KV has landed; generating tokens."""


class Outcome(enum.Enum):
    """Terminal. Absorbing: no event moves a room out of it."""

    FINISHED = "FINISHED"
    ABORTED = "ABORTED"
    FAILED = "FAILED"


State = Union[PrefillState, DecodeState, Outcome]


def is_terminal(state: State) -> bool:
    return isinstance(state, Outcome)


class Reason(str, enum.Enum):
    """Why a room ended. Each reason belongs to exactly one outcome (:data:`OUTCOME_OF`)."""

    # FINISHED
    TRANSFERRED = "transferred"
    """Prefill: every write landed and the first token was handed to decode."""
    STOP = "stop"
    """Decode: a stop token or stop string."""
    LENGTH = "length"
    """Decode: max_tokens reached."""
    # ABORTED
    CLIENT_ABORT = "client_abort"
    """The client (through the router) or an operator aborted the request."""
    PEER_ABORT = "peer_abort"
    """The peer worker told us the request was aborted there."""
    # FAILED
    BOOTSTRAP_TIMEOUT = "bootstrap_timeout"
    """Prefill: no registration from decode in time. Decode: no bootstrap info from prefill in time."""
    OVERLOADED = "overloaded"
    """Waited too long for a slot: the forward-pass queue (prefill) or KV pages (decode)."""
    STALLED = "stalled"
    """A running request made no progress (no chunk, no decode step) within its deadline."""
    TRANSFER_TIMEOUT = "transfer_timeout"
    """Prefill: the writes did not complete in time. Decode: the KV did not arrive in time."""
    REQUEST_TIMEOUT = "request_timeout"
    """The optional end-to-end deadline passed."""
    PEER_LOST = "peer_lost"
    """The peer missed its heartbeats, restarted (new incarnation), or its connection broke."""
    PEER_FAILED = "peer_failed"
    """The peer told us the request failed there (its reason is in the detail)."""
    TRANSFER_ERROR = "transfer_error"
    """A write failed, or what arrived does not belong to this room."""
    INCOMPATIBLE_PEER = "incompatible_peer"
    """The peer's bootstrap info differs in a field that must match (named in the detail)."""
    BAD_REQUEST = "bad_request"
    """Refused: duplicate room, prompt mismatch between the two workers, malformed registration."""
    INTERNAL_ERROR = "internal_error"
    """This worker broke (an engine or transfer-thread exception; DESIGN §2 rule 8)."""


OUTCOME_OF: dict[Reason, Outcome] = {
    Reason.TRANSFERRED: Outcome.FINISHED,
    Reason.STOP: Outcome.FINISHED,
    Reason.LENGTH: Outcome.FINISHED,
    Reason.CLIENT_ABORT: Outcome.ABORTED,
    Reason.PEER_ABORT: Outcome.ABORTED,
    **{r: Outcome.FAILED for r in (
        Reason.BOOTSTRAP_TIMEOUT, Reason.OVERLOADED, Reason.STALLED, Reason.TRANSFER_TIMEOUT,
        Reason.REQUEST_TIMEOUT, Reason.PEER_LOST, Reason.PEER_FAILED, Reason.TRANSFER_ERROR,
        Reason.INCOMPATIBLE_PEER, Reason.BAD_REQUEST, Reason.INTERNAL_ERROR)},
}

_ABORTS_FROM_PEER = {Reason.CLIENT_ABORT.value, Reason.PEER_ABORT.value}


@dataclass(frozen=True)
class Ending:
    """How a room ended: the outcome follows from the reason; ``detail`` is for humans."""

    reason: Reason
    detail: str = ""

    @property
    def outcome(self) -> Outcome:
        return OUTCOME_OF[self.reason]

    @property
    def from_peer(self) -> bool:
        """The peer ended it (so there is no point telling the peer)."""
        return self.reason in (Reason.PEER_ABORT, Reason.PEER_FAILED)

    def __str__(self) -> str:
        return f"{self.outcome.value}({self.reason.value})" + (f": {self.detail}" if self.detail else "")


def ending_from_peer(peer_reason: str) -> Ending:
    """Our ending when the peer tells us it ended the room with ``peer_reason`` (a Reason value)."""
    if peer_reason in _ABORTS_FROM_PEER:
        return Ending(Reason.PEER_ABORT, f"peer: {peer_reason}")
    return Ending(Reason.PEER_FAILED, f"peer: {peer_reason}")
