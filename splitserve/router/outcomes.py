"""How a request through the router ends: :class:`RouterOutcome`, the router's own vocabulary
beside the workers' ``Reason`` (``splitserve/outcomes.py``). Each request is counted once, by its
outcome, when it ends (``splitserve_router_requests_total{outcome}``: the label is the value).

As a ``Reason`` does, an outcome names the HTTP status and error code of an answer the router
makes itself (:attr:`RouterOutcome.http_status`, :attr:`RouterOutcome.error_code`); such an answer
is a :class:`Refusal`. A worker's own answer passes through with the worker's status.

What a client reads of a failure the router saw is said in words (what happened, which role, the
request id), never the worker's address nor a library's exception text: those are the
:attr:`Refusal.detail`, for the router's log and the request's record (``/debug/requests/{rid}``,
admin only)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from aiohttp import web

from splitserve.client_writer import ClientLost
from splitserve.errors import error_body


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

    @property
    def http_status(self) -> int:
        """The status of an answer the router makes itself with this outcome."""
        return _ANSWERS[self][0]

    @property
    def error_code(self) -> Optional[str]:
        """The OpenAI-style ``error.code`` of that answer (None: the status's own)."""
        return _ANSWERS[self][1]


_ANSWERS = {
    RouterOutcome.FINISHED: (200, None),
    RouterOutcome.BAD_REQUEST: (400, None),
    RouterOutcome.NO_WORKERS: (503, "no_healthy_workers"),
    RouterOutcome.PREFILL_FAILED: (502, "worker_unreachable"),
    RouterOutcome.DECODE_FAILED: (502, "worker_unreachable"),
    RouterOutcome.CLIENT_DISCONNECT: (499, None),
    RouterOutcome.CLIENT_TIMEOUT: (408, "client_timeout"),
    RouterOutcome.TIMEOUT: (504, "timeout"),
    RouterOutcome.INTERNAL: (500, None),
}


@dataclass(frozen=True)
class Refusal:
    """An answer the router makes itself, not a worker's: how it counts, what the client reads
    (``message``: words, nothing internal) and what the operator reads (``detail``: the worker's
    address, the exception; the message when None). ``status`` and ``code`` default to the
    outcome's."""

    outcome: RouterOutcome
    message: str
    status: Optional[int] = None
    code: Optional[str] = None
    headers: Optional[dict] = None
    detail: Optional[str] = None

    @property
    def http_status(self) -> int:
        return self.status if self.status is not None else self.outcome.http_status

    @property
    def logged(self) -> str:
        """What the operator reads of it."""
        return self.detail if self.detail is not None else self.message

    def response(self, rid: Optional[str] = None) -> web.Response:
        """The answer: an OpenAI-style error body (its message names ``rid``, if given)."""
        status = self.http_status
        code = self.code if self.code is not None else self.outcome.error_code
        return web.json_response(error_body(for_client(self.message, rid), status, code=code), status=status,
                                 headers=self.headers)


def for_client(message: str, rid: Optional[str]) -> str:
    """A message the client reads, with the request id it can quote to an operator."""
    return f"{message} (request id {rid})" if rid else message


def no_workers(message: str, detail: Optional[str] = None) -> Refusal:
    """The refusal of a request with no worker to go to: a 503 the client may try again soon;
    ``message`` in words, ``detail`` naming the workers and why each is out."""
    return Refusal(RouterOutcome.NO_WORKERS, message, headers={"Retry-After": "1"}, detail=detail)


def client_left(lost: Optional[ClientLost]) -> Optional[RouterOutcome]:
    """How a client that was lost counts (None when it was not)."""
    if lost is None:
        return None
    return RouterOutcome.CLIENT_TIMEOUT if lost.timed_out else RouterOutcome.CLIENT_DISCONNECT
