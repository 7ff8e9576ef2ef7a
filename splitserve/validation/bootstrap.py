"""Who a request is and where its KV comes from (``rid``, the ``bootstrap_*`` fields,
``cache_salt``), and the fields only a router sends a worker (``stream_ids``, ``continuation``)."""

from __future__ import annotations

from typing import Any, Optional

from splitserve.engine.continuation import parse_continuation
from splitserve.engine.io import InvalidRequest
from splitserve.hosts import check_host
from splitserve.validation.headers import check_request_id
from splitserve.validation.values import opt

MAX_ROOM = 2**63


def bootstrap(body: dict) -> dict[str, Any]:
    """``rid``, ``bootstrap_host``, ``_port``, ``_room`` and ``cache_salt``, by
    ``ValidatedRequest``'s names (``user`` is read, not kept)."""
    opt(body, "user", "", str)  # accepted (OpenAI's end-user id), not used
    rid = check_request_id(opt(body, "rid", "", str), "rid")
    host = opt(body, "bootstrap_host", "", str)
    if host is not None:  # in the one form the router sends and the allow-lists compare
        try:
            host = check_host(host)
        except ValueError as exc:
            raise InvalidRequest(f"bootstrap_host must be a host name, an IPv4 address or an IPv6 address in "
                                 f"brackets: {exc}", "bootstrap_host") from None
    port = opt(body, "bootstrap_port", "", int, minimum=1, maximum=65535)
    room = opt(body, "bootstrap_room", "", int, minimum=0, maximum=MAX_ROOM - 1)
    cache_salt = opt(body, "cache_salt", "", str) or ""
    if len(cache_salt) > 256:
        raise InvalidRequest("cache_salt must be at most 256 characters", "cache_salt")
    return {"rid": rid, "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room,
            "cache_salt": cache_salt}


def router_fields(body: dict, vocab_size: Optional[int], endpoint: str, *, stream: bool, n: int,
                  max_tokens: int) -> dict[str, Any]:
    """``stream_ids`` and ``continuation`` (``engine/continuation.py``), checked against the
    request's ``stream``, ``n`` and ``max_tokens``; by ``ValidatedRequest``'s names."""
    ids = bool(opt(body, "stream_ids", "", bool))
    cont = parse_continuation(body.get("continuation"), endpoint, stream=stream, n=n, max_tokens=max_tokens,
                              vocab_size=vocab_size)
    return {"stream_ids": ids, "continuation": cont}
