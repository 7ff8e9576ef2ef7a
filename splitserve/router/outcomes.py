"""How a request through the router ends: :class:`RouterOutcome`, the router's own vocabulary
beside the workers' ``Reason`` (``splitserve/outcomes.py``). Each request is counted once, by its
outcome, when it ends (``splitserve_router_requests_total{outcome}``: the label is the value)."""

from __future__ import annotations

import enum
from typing import Optional

from splitserve.client_writer import ClientLost


class RouterOutcome(str, enum.Enum):
    """A client that had gone before the answer — whatever it was — reached it counts as leaving
    (``CLIENT_DISCONNECT`` / ``CLIENT_TIMEOUT``), never as the failure it was not there to see."""

    FINISHED = "finished"
    """The decode worker's 2xx answer was passed through whole."""
    BAD_REQUEST = "bad_request"
    """Refused by the router's validation (400/404/413)."""
    NO_WORKERS = "no_workers"
    """503: no healthy prefill or decode worker."""
    PREFILL_FAILED = "prefill_failed"
    """The prefill leg failed first: its error was returned and the decode leg closed."""
    DECODE_FAILED = "decode_failed"
    """The decode worker answered an error, could not be reached, broke off its stream, or ended it
    without ``[DONE]``."""
    CLIENT_DISCONNECT = "client_disconnect"
    """The client closed its connection."""
    CLIENT_TIMEOUT = "client_timeout"
    """The client did not send its body within ``client_body_timeout_s`` (408), or stopped reading
    for ``client_write_timeout_s``."""
    TIMEOUT = "timeout"
    """``request_timeout_s`` passed (504)."""
    INTERNAL = "internal"
    """A bug (500)."""


def client_left(lost: Optional[ClientLost]) -> Optional[RouterOutcome]:
    """How a client that was lost counts (None when it was not)."""
    if lost is None:
        return None
    return RouterOutcome.CLIENT_TIMEOUT if lost.timed_out else RouterOutcome.CLIENT_DISCONNECT
