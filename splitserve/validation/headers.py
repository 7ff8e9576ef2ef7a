"""The request headers both apps check: the request id and the router's deadline for a leg.

Each is single-valued: sent twice it is refused (:func:`one_header`), never read as its first or
its last, since a limit or an id given twice is ambiguous and whichever copy were taken, the other
would be what some reader of the request meant."""

from __future__ import annotations

import math
from typing import Optional, Protocol

from splitserve.engine.io import InvalidRequest

REQUEST_ID = "X-Request-Id"  # the header that carries a request id (the router's, on the OpenAI routes)
DEADLINE = "X-Splitserve-Deadline-S"  # the seconds a router gives a leg (docs/router.md, *Deadlines*)
MAX_DEADLINE_S = 1e6


class Headers(Protocol):
    """A request's headers as aiohttp gives them (a multidict: a name may come more than once)."""

    def getall(self, key: str, default: object = ...) -> list: ...


def one_header(headers: Headers, name: str) -> Optional[str]:
    """The value of header ``name``, None when absent; a 400 naming it when sent more than once."""
    values = headers.getall(name, [])
    if len(values) > 1:
        raise InvalidRequest(f"{name} may be sent once; this request sends it {len(values)} times", name)
    return values[0] if values else None


def check_deadline(text: Optional[str]) -> Optional[float]:
    """A deadline header's value: decimal seconds, finite, above 0 and at most ``MAX_DEADLINE_S``,
    in at most 32 characters; None stays None. Anything else is a 400 naming the header."""
    if text is None:
        return None
    try:
        value = float(text) if len(text) <= 32 and all(c in "0123456789.eE+-" for c in text) else math.nan
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_DEADLINE_S:  # NaN fails too
        raise InvalidRequest(f"{DEADLINE} must be a number of seconds above 0 and at most {MAX_DEADLINE_S:g}",
                             DEADLINE)
    return value


def check_request_id(rid: Optional[str], param: str) -> Optional[str]:
    """A request id (the ``rid`` field, or an ``X-Request-Id`` header): 1 to 256 printable
    characters without spaces; None stays None."""
    if rid is not None and (not rid or len(rid) > 256 or not rid.isprintable() or any(c.isspace() for c in rid)):
        raise InvalidRequest(f"{param} must be 1 to 256 printable characters without spaces", param)
    return rid
