"""What a client may read of a failure: words and a request id, never a worker's internals."""

from __future__ import annotations

import re

INTERNALS = (
    re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}\b"),  # an IPv4 address
    re.compile(r"\blocalhost\b"),
    re.compile(r"#[0-9a-f]{8,}"),  # a peer's incarnation (``host:port#incarnation/session``)
    re.compile(r"\b\w+(?:Error|Exception)\b"),  # an exception class's name
    re.compile(r"Traceback|File \""),
)


def internals_in(message: str, *ports: int) -> list[str]:
    """The pieces of ``message`` that name a worker's internals: an address, one of ``ports``, an
    incarnation, an exception class, a traceback (empty when there is none)."""
    found = [m.group(0) for pattern in INTERNALS for m in pattern.finditer(message)]
    words = re.sub(r"\(request id [^)]*\)", "", message)  # a drawn id may hold a port's digits
    return found + [str(p) for p in ports if re.search(rf"(?<!\d){p}(?!\d)", words)]


def assert_in_words(error: dict, code: str, *ports: int) -> None:
    """``error`` (an OpenAI error object) has ``code`` and a message with none of the internals."""
    assert error["code"] == code, error
    leaked = internals_in(error["message"], *ports)
    assert not leaked, f"the client read {leaked}: {error}"


def logged_ending(worker, rid: str, reason: str, timeout: float = 10.0) -> str:
    """The worker's log line of request ``rid``'s end with ``reason`` (its detail: what the
    client did not read), waited for up to ``timeout`` seconds."""
    from helpers.waiting import wait_for

    def line() -> str:
        return next((ln for ln in worker.stderr().splitlines()
                     if f" request {rid} " in ln and f"({reason})" in ln and " ended " in ln), "")

    return wait_for(f"the log line of {rid}'s end ({reason})", line, timeout,
                    on_fail=lambda: worker.stderr()[-3000:])
