"""The error vocabulary of the HTTP layer, below both apps (a worker and the router) and the
engine: the exceptions a request is refused with at submission, each with its
:class:`~splitserve.outcomes.Reason` (and so its HTTP status), and the OpenAI error body every
refusal is answered with. ``engine/io.py`` and ``server/openai_protocol.py`` re-export them.
"""

from __future__ import annotations

from typing import Optional

from splitserve.outcomes import Reason

FLUSH_WAIT_S = 30.0
"""How long ``POST /flush_cache`` (and an admin abort) waits for the engine loop (one step of a
long prompt can take seconds); the router gives a worker's flush that and a margin."""


class EngineError(Exception):
    """Raised at submission; ``reason`` says why, and with it the HTTP status the front end
    answers with."""

    reason = Reason.INTERNAL_ERROR

    @property
    def status(self) -> int:
        return self.reason.http_status

    @property
    def code(self) -> str:
        return self.reason.value


class Overloaded(EngineError):
    reason = Reason.QUEUE_FULL


class NotReady(EngineError):
    reason = Reason.NOT_READY


class InvalidRequest(EngineError):
    """Bad input. ``param`` names the offending field, as in OpenAI's error body; an unknown
    model is ``Reason.MODEL_NOT_FOUND`` (404)."""

    def __init__(self, message: str, param: Optional[str] = None, reason: Reason = Reason.BAD_REQUEST):
        super().__init__(message)
        self.param = param
        self.reason = reason


# HTTP status -> OpenAI error ``type`` and default ``code`` (the client maps the status to its
# exception class: 400 BadRequestError, 404 NotFoundError, 429 RateLimitError, >=500 InternalServerError).
_ERROR_TYPES = {429: "rate_limit_error", 499: "client_closed_request", 503: "service_unavailable", 504: "timeout"}
_ERROR_CODES = {400: "invalid_value", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
                429: "overloaded", 499: "aborted", 500: "internal_error", 503: "not_ready", 504: "timeout"}


def error_body(message: str, status: int, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}`` as OpenAI answers errors."""
    return {"error": {"message": message, "type": _error_type(status), "param": param,
                      "code": code or _ERROR_CODES.get(status, "internal_error")}}


def _error_type(status: int) -> str:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


def engine_error_body(exc: EngineError) -> dict:
    """A refusal at submission; a bad request gets OpenAI's own code (``invalid_value``)."""
    code = None if exc.reason is Reason.BAD_REQUEST else exc.code
    return error_body(str(exc), exc.status, getattr(exc, "param", None), code)
