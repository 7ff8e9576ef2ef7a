"""States and endings of a room (one request on one worker).

Prefill side, in order::

    BOOTSTRAPPING -> QUEUED -> PREFILLING -> TRANSFERRING -> (terminal)

Decode side, in order::

    PREALLOC -> AWAITING_KV -> DECODING -> (terminal)
    PREALLOC -> PREFILLING -> DECODING                      a request sent to decode alone
    PREALLOC | AWAITING_KV -> [RECLAIMING ->] PREFILLING    its KV will not come: recomputed here

Terminal, on both sides: ``Outcome.FINISHED``, ``Outcome.ABORTED``, ``Outcome.FAILED`` with a
:class:`Reason` (``splitserve/outcomes.py``: one vocabulary from here to the HTTP answer). Live
states and outcomes are different types, so "is it terminal?" is a type test
(:func:`is_terminal`), never a comparison of numbers. States are plain enums, so they have no
order at all: ``max()`` of two states raises TypeError instead of quietly letting a later state
win over a terminal one (``docs/lifecycle.md``, rule 2).
"""

from __future__ import annotations

import enum
from typing import Union

from splitserve.outcomes import OUTCOME_OF, Ending, Outcome, Reason  # noqa: F401 (the lifecycle's vocabulary)


class LifecycleError(RuntimeError):
    """A broken invariant of the lifecycle's own code: a check that raises, so ``python -O``
    keeps it (as the page allocator's do). Never caused by a peer or a client: what they send
    that does not fit is refused and counted before anything changes."""


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
    RECLAIMING = "RECLAIMING"
    """The room's KV will not come (its prefill was lost, failed or too slow) and a write of it
    may still land in its pages: waiting until none can (prefill settles its writes, or is
    declared lost and fenced) before the prompt is computed here, into those same pages."""
    PREFILLING = "PREFILLING"
    """The prompt runs on this worker, into the room's own pages: the request came with no
    prefill (decode alone), or its KV will not come and it is recomputed here."""
    DECODING = "DECODING"
    """The KV has landed (or was computed here); generating tokens."""


State = Union[PrefillState, DecodeState, Outcome]


def is_terminal(state: State) -> bool:
    return isinstance(state, Outcome)


_ABORTS_FROM_PEER = {Reason.CLIENT_ABORT.value, Reason.PEER_ABORT.value}
_KNOWN_REASONS = {r.value for r in Reason}


def ending_from_peer(peer_reason: str) -> Ending:
    """Our ending when the peer tells us it ended the room with ``peer_reason`` (a Reason value;
    anything else from the network is named as unknown, never echoed at length)."""
    if peer_reason in _ABORTS_FROM_PEER:
        return Ending(Reason.PEER_ABORT, f"peer: {peer_reason}")
    said = peer_reason if peer_reason in _KNOWN_REASONS else f"an unknown reason {peer_reason[:40]!r}"
    return Ending(Reason.PEER_FAILED, f"peer: {said}")
