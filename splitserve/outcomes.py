"""How a request ends: one vocabulary from the engine loop to the HTTP answer and the metrics.

Every ending of a request is an :class:`Ending` — a :class:`Reason` and a human detail. The
reason decides everything else, once, here: the :class:`Outcome` (finished, aborted, failed), the
HTTP status a client gets (:attr:`Reason.http_status`), the OpenAI error body's ``code``
(``reason.value``) and the ``reason`` label of ``splitserve_requests_total``. Nothing converts a
failure's identity along the way; a ``RequestOutput`` carries its reason to the front end.

Outcomes and reasons are plain enums: ordering them raises ``TypeError``, so no code can let a
later state win over a terminal one with ``max()`` (``docs/lifecycle.md``, rule 2).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Outcome(enum.Enum):
    """Terminal. Absorbing: no event moves a request out of it."""

    FINISHED = "FINISHED"
    ABORTED = "ABORTED"
    FAILED = "FAILED"


class Reason(str, enum.Enum):
    """Why a request ended. Each reason belongs to exactly one outcome and one HTTP status."""

    # FINISHED
    TRANSFERRED = "transferred"
    """Prefill: every write landed and the first token was handed to decode."""
    STOP = "stop"
    """A stop token or stop string."""
    LENGTH = "length"
    """max_tokens reached."""
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
    QUEUE_FULL = "queue_full"
    """Refused at admission: the waiting queue is full (retry later)."""
    NOT_READY = "not_ready"
    """The worker is starting, draining or shutting down."""
    LOOP_STALLED = "loop_stalled"
    """The engine loop has not begun an iteration within ``--loop-stall-s``: this worker is wedged."""
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
    """Refused: invalid input, duplicate room, prompt mismatch between the two workers."""
    MODEL_NOT_FOUND = "model_not_found"
    """The request names a model this server does not serve."""
    INTERNAL_ERROR = "internal_error"
    """This worker broke (an engine, action or transfer-thread exception)."""

    @property
    def outcome(self) -> Outcome:
        return OUTCOME_OF[self]

    @property
    def http_status(self) -> int:
        """The status of an HTTP answer that ends with this reason (499: the client is gone)."""
        return HTTP_STATUS[self]


OUTCOME_OF: dict[Reason, Outcome] = {
    Reason.TRANSFERRED: Outcome.FINISHED,
    Reason.STOP: Outcome.FINISHED,
    Reason.LENGTH: Outcome.FINISHED,
    Reason.CLIENT_ABORT: Outcome.ABORTED,
    Reason.PEER_ABORT: Outcome.ABORTED,
    **{r: Outcome.FAILED for r in (
        Reason.BOOTSTRAP_TIMEOUT, Reason.OVERLOADED, Reason.QUEUE_FULL, Reason.NOT_READY, Reason.LOOP_STALLED,
        Reason.STALLED, Reason.TRANSFER_TIMEOUT, Reason.REQUEST_TIMEOUT, Reason.PEER_LOST, Reason.PEER_FAILED,
        Reason.TRANSFER_ERROR, Reason.INCOMPATIBLE_PEER, Reason.BAD_REQUEST, Reason.MODEL_NOT_FOUND,
        Reason.INTERNAL_ERROR)},
}

HTTP_STATUS: dict[Reason, int] = {
    Reason.TRANSFERRED: 200, Reason.STOP: 200, Reason.LENGTH: 200,
    Reason.CLIENT_ABORT: 499, Reason.PEER_ABORT: 499,
    Reason.BAD_REQUEST: 400, Reason.MODEL_NOT_FOUND: 404, Reason.QUEUE_FULL: 429,
    Reason.INTERNAL_ERROR: 500,
    Reason.PEER_LOST: 502, Reason.PEER_FAILED: 502, Reason.TRANSFER_ERROR: 502, Reason.INCOMPATIBLE_PEER: 502,
    Reason.OVERLOADED: 503, Reason.NOT_READY: 503, Reason.LOOP_STALLED: 503,
    Reason.BOOTSTRAP_TIMEOUT: 504, Reason.TRANSFER_TIMEOUT: 504, Reason.REQUEST_TIMEOUT: 504, Reason.STALLED: 504,
}


@dataclass(frozen=True)
class Ending:
    """How a request ended: the outcome follows from the reason; ``detail`` is for humans."""

    reason: Reason
    detail: str = ""

    @property
    def outcome(self) -> Outcome:
        return self.reason.outcome

    @property
    def from_peer(self) -> bool:
        """The peer ended it (so there is no point telling the peer)."""
        return self.reason in (Reason.PEER_ABORT, Reason.PEER_FAILED)

    @property
    def message(self) -> str:
        """What a client reads: ``reason: detail``."""
        return f"{self.reason.value}: {self.detail}" if self.detail else self.reason.value

    def __str__(self) -> str:
        return f"{self.outcome.value}({self.reason.value})" + (f": {self.detail}" if self.detail else "")
