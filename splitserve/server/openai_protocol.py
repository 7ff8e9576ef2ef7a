"""The JSON shapes of the HTTP API: OpenAI completions and chat (whole answers and stream chunks),
SGLang's ``/generate``, and the OpenAI error body. Pure functions of plain values, no I/O, so the
router can build the same shapes.

An answer is accumulated from engine deltas in :class:`Accumulator`; builders take it (or one
delta) and return a dict ready for ``json.dumps``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from splitserve.engine.io import EngineError, RequestOutput
from splitserve.outcomes import Reason

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


def ended_error_body(out: RequestOutput) -> dict:
    """The error body of a request that failed or was aborted: its reason is the code."""
    return error_body(out.error or "the engine ended the request without an answer", out.status,
                      code=out.reason.value if out.reason is not None else None)


@dataclass
class Accumulator:
    """A request's answer so far, built from its engine deltas."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    error: Optional[RequestOutput] = None  # the failed last delta, if any
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: Optional[float] = None
    last_token_at: Optional[float] = None
    token_gaps: list[float] = field(default_factory=list)
    """Seconds between consecutive deltas that carried tokens (the inter-token latencies)."""

    def add(self, out: RequestOutput) -> None:
        if out.token_ids:
            now = time.monotonic()
            if self.first_token_at is None:
                self.first_token_at = now
            else:
                self.token_gaps.append(now - self.last_token_at)
            self.last_token_at = now
        self.text.append(out.text)
        self.token_ids.extend(out.token_ids)
        if out.prompt_tokens:
            self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = max(self.completion_tokens, out.completion_tokens, len(self.token_ids))
        if out.finished:
            if out.error is not None:
                self.error = out
            else:
                self.finish_reason = out.finish_reason or "stop"

    @property
    def full_text(self) -> str:
        return "".join(self.text)

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def completion_response(rid: str, model: str, created: int, acc: Accumulator) -> dict:
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": acc.full_text, "logprobs": None, "finish_reason": acc.finish_reason}],
            "usage": acc.usage()}


def chat_response(rid: str, model: str, created: int, acc: Accumulator) -> dict:
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": acc.full_text},
                         "logprobs": None, "finish_reason": acc.finish_reason}],
            "usage": acc.usage()}


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: Optional[str]) -> dict:
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: Optional[str]) -> dict:
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(endpoint: str, rid: str, model: str, created: int, acc: Accumulator) -> dict:
    """The last chunk when ``stream_options.include_usage``: empty ``choices``, the usage."""
    if endpoint == "chat":
        return {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [], "usage": acc.usage()}
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": model,
            "choices": [], "usage": acc.usage()}


def generate_meta(rid: str, acc: Accumulator, started: float) -> dict:
    """SGLang's ``meta_info``; ``finish_reason`` is ``{"type": "stop"|"length"}`` (or null)."""
    meta = {"id": rid, "prompt_tokens": acc.prompt_tokens, "completion_tokens": acc.completion_tokens,
            "finish_reason": {"type": acc.finish_reason} if acc.finish_reason else None,
            "e2e_latency": round(time.monotonic() - started, 6)}
    return meta


def generate_response(rid: str, acc: Accumulator, started: float) -> dict:
    return {"text": acc.full_text, "output_ids": list(acc.token_ids), "meta_info": generate_meta(rid, acc, started)}


def generate_chunk(rid: str, acc: Accumulator, started: float) -> dict:
    """A streamed ``/generate`` chunk. As SGLang by default, ``text`` and ``output_ids`` are
    cumulative (the whole answer so far), so a client keeps the last chunk."""
    return generate_response(rid, acc, started)
