"""One look at a child's ``/health`` for ``splitserve launch`` (:func:`probe`): healthy, or why not,
in words for a log line, with the status the worker named (``loading``, ``draining``, ``stalled``).

The answer is read as untrusted input even from our own child (another process may hold its port):
a bounded body, a status kept only when it is a short lowercase word.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Optional

MAX_BODY = 65536
_STATUS = re.compile(r"[a-z_]{1,32}")


@dataclass(frozen=True)
class Answer:
    why: Optional[str] = None
    """None: healthy (200, and as the expected worker); else why not, e.g. ``answered 503 ("stalled")``."""
    status: str = ""
    """The ``status`` the body named, when it named a plain word."""

    @property
    def healthy(self) -> bool:
        return self.why is None

    @property
    def draining(self) -> bool:
        """The worker says it drains (a role switch, or its way out): bounded by its own
        ``--drain-timeout-s``, so not a wedge."""
        return self.status == "draining"


def probe(url: str, worker_id: Optional[str] = None, timeout_s: float = 1.0) -> Answer:
    """GET ``url``: healthy when it answers 200 (and, given ``worker_id``, as that worker)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
    try:
        with opener.open(url, timeout=timeout_s) as resp:
            code, body = resp.status, resp.read(MAX_BODY)
    except urllib.error.HTTPError as exc:
        status = _status_of(_read(exc))
        return Answer(f"answered {exc.code}" + (f' ("{status}")' if status else ""), status)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return Answer(f"no answer ({exc})")
    if code != 200:
        return Answer(f"answered {code}")
    if worker_id is None:
        return Answer()
    try:
        seen = json.loads(body).get("id")
    except (ValueError, AttributeError):
        seen = None
    if seen == worker_id:
        return Answer(None, _status_of(body))
    return Answer(f"another process answers there, as {str(seen)[:130]!r}, not {worker_id!r}")


def _read(exc: urllib.error.HTTPError) -> bytes:
    """The error's body (bounded), its connection closed."""
    try:
        return exc.read(MAX_BODY)
    except (OSError, ValueError, AttributeError):  # timed out, broke off, or none: the code is the answer
        return b""
    finally:
        try:
            exc.close()
        except (OSError, ValueError, AttributeError):
            pass


def _status_of(body: bytes) -> str:
    try:
        status = json.loads(body).get("status")
    except (ValueError, AttributeError, RecursionError):
        return ""
    return status if isinstance(status, str) and _STATUS.fullmatch(status) else ""
