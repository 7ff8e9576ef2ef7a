"""Events: what the engine loop feeds into a room table, each with the current time beside it.

Other threads never call a table: they post these to the engine loop's inbox (docs/design.md, rule 1).
The HTTP front end posts ``RequestArrived`` and ``ClientAbort``; the ZMQ listener posts
``FromPeer`` (a decoded control message), ``PeerHeard`` (heartbeat answers) and ``PeerLost``; the
transfer thread posts ``WriteDone`` / ``WriteFailed``; the engine itself posts the rest as its
scheduler and model make progress. The passage of time is not an event: call
``table.expire(now)`` every loop iteration.

Pages are KV page ids. ``pages_ready`` counts *pages of the prompt* (0..n_pages), in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from splitserve.disagg.lifecycle.peers import Peer
from splitserve.disagg.lifecycle.states import Reason

# -- both sides --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestArrived:
    """The request reached this worker (tokenized) with its ``bootstrap_room``. ``alone``
    (decode): it came with no prefill (no bootstrap fields; ``room`` is a local id): decode
    computes its prompt itself. ``deadline_s``: the seconds its sender gives it from now (the
    router's remaining deadline, checked finite and positive); it can only end the room sooner
    than ``request_timeout_s`` would, as ``request_timeout``."""

    room: int
    rid: str
    prompt_len: int
    alone: bool = False
    deadline_s: Optional[float] = None


@dataclass(frozen=True)
class ClientAbort:
    """The client disconnected or an operator aborted (the router sends it to both workers). May
    come before the request (a tombstone refuses it later) or after its end (a logged no-op)."""

    room: int
    detail: str = ""


@dataclass(frozen=True)
class LocalFailure:
    """This worker cannot go on with the room: ``overloaded`` (admission refused after arrival),
    ``bad_request``, ``internal_error`` (an engine or transfer-thread exception, rule 8)..."""

    room: int
    reason: Reason
    detail: str = ""


@dataclass(frozen=True)
class FromPeer:
    """A control message (``splitserve.disagg.protocol``) received from ``peer``. The engine
    builds ``peer`` from the socket's peer name and the message's ``incarnation``."""

    peer: Peer
    msg: Any


@dataclass(frozen=True)
class PeerHeard:
    """A heartbeat answer from ``peer``. ``fresh``: it answers our own ping, so ``peer`` is the
    incarnation running now under its name, and any older incarnation is declared lost."""

    peer: Peer
    fresh: bool = True


@dataclass(frozen=True)
class PeerLost:
    """The engine knows ``peer`` is gone (its connection broke, a supervisor said so)."""

    peer: Peer
    detail: str = ""


# -- prefill side ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scheduled:
    """The scheduler took the QUEUED room into a batch and allocated ``pages`` (n_pages of them)
    for its prompt's KV. These pages now belong to the room until it is released."""

    room: int
    pages: tuple[int, ...]


@dataclass(frozen=True)
class ChunkDone:
    """A prefill chunk finished: the first ``pages_ready`` pages of the prompt are full."""

    room: int
    pages_ready: int


@dataclass(frozen=True)
class ForwardDone:
    """The whole prompt ran; ``first_token`` was sampled. Every page may now be written."""

    room: int
    first_token: int
    first_logprobs: bytes = b""  # its logprobs when the request asks for them (TokenLogprob.to_bytes)


@dataclass(frozen=True)
class WriteDone:
    """The transfer thread polled write ``write_id`` DONE: its bytes have landed."""

    room: int
    write_id: int


@dataclass(frozen=True)
class WriteFailed:
    """Write ``write_id`` polled FAILED, or was torn down by a ResetTransfer. Post it only once
    the write can no longer land (a released but unsettled write is not failed)."""

    room: int
    write_id: int
    error: str = ""


# -- decode side -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PagesReserved:
    """The engine gave the room ``pages`` (at least n_pages) for its prompt's KV; they now belong to
    it. The first ``cached_tokens`` (a whole number of pages) are in them already — pages of this
    worker's prefix cache, shared and read-only: never a write target; only the rest is registered
    with prefill for writing."""

    room: int
    pages: tuple[int, ...]
    cached_tokens: int = 0


@dataclass(frozen=True)
class PeerInfo:
    """The prefill worker's bootstrap info is in hand (fetched once per incarnation, cached).
    ``mismatch`` names the first field that differs from ours, or is None when compatible."""

    room: int
    peer: Peer
    mismatch: Optional[str] = None


@dataclass(frozen=True)
class DecodeStep:
    """The room produced a token. ``new_pages``: pages the step allocated; they belong to the room."""

    room: int
    new_pages: tuple[int, ...] = ()


@dataclass(frozen=True)
class Finished:
    """Generation ended normally: ``reason`` is Reason.STOP or Reason.LENGTH."""

    room: int
    reason: Reason

    def __post_init__(self):
        if self.reason not in (Reason.STOP, Reason.LENGTH):
            raise ValueError(f"Finished needs Reason.STOP or Reason.LENGTH, got {self.reason}")


@dataclass(frozen=True)
class PromptChunk:
    """A chunk of a ``PREFILLING`` room's prompt ran on this worker (its stall deadline starts again)."""

    room: int


@dataclass(frozen=True)
class Admitted:
    """Decode: the scheduler admitted the room's sequence into the batch (``StepReport.admitted``):
    its turn came, so its progress bound (``prefill_stall_s``, ``decode_stall_s``) starts now."""

    room: int


@dataclass(frozen=True)
class Preempted:
    """Decode: the engine took the room's sequence's pages for another (``StepReport.preempted``):
    it waits for its turn again, bounded by ``queue_s`` until :class:`Admitted` comes again."""

    room: int


@dataclass(frozen=True)
class KVLost:
    """Someone who knows says the room's KV will not come (the router: its prefill leg was refused
    or failed before prefill accepted the room). Under ``recompute`` decode computes the prompt
    itself, else the room fails ``peer_failed``."""

    room: int
    detail: str = ""


def describe(event: object) -> str:
    """An event's name as a timeline shows it (``Moved.cause``)."""
    if isinstance(event, str):
        return event
    if isinstance(event, FromPeer):
        return f"{type(event.msg).__name__} from {event.peer}"
    if isinstance(event, LocalFailure):
        return f"LocalFailure({event.reason.value})"
    return type(event).__name__
