"""One look at a child's ``/health`` for ``splitserve launch`` (:func:`probe`): healthy, or why not,
in words for a log line, with the status the worker named (``loading``, ``draining``, ``stalled``).

The answer is read as untrusted input even from our own child (another process may hold its port):
a bounded body, read within the look's time in all (one that drips its bytes is cut off at it), a
redirect not followed, an answer that is not HTTP or JSON nested too deep for the parser a failed
look (never an exception out of :func:`probe`), a status kept only when it is a short lowercase word.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import urllib.parse
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
    """GET ``url`` (http or https), within ``timeout_s`` in all: healthy when it answers 200 (and,
    given ``worker_id``, as that worker); anything else is why not, never an exception."""
    try:
        code, body = _get(url, timeout_s)
    except http.client.HTTPException as exc:  # not HTTP, or cut off: its text would be the other side's bytes
        return Answer(f"no answer (a broken HTTP answer: {type(exc).__name__})")
    except (OSError, ValueError) as exc:
        return Answer(f"no answer ({exc})")
    if code != 200:
        status = _status_of(body)
        return Answer(f"answered {code}" + (f' ("{status}")' if status else ""), status)
    if worker_id is None:
        return Answer()
    try:
        seen = json.loads(body).get("id")
    except (ValueError, AttributeError, RecursionError):
        seen = None
    if seen == worker_id:
        return Answer(None, _status_of(body))
    return Answer(f"another process answers there, as {str(seen)[:130]!r}, not {worker_id!r}")


def _get(url: str, timeout_s: float) -> tuple[int, bytes]:
    """``url``'s status and first ``MAX_BODY`` bytes of body. A timer shuts the socket at
    ``timeout_s``: a socket timeout bounds each read only, and an answer a byte at a time would
    hold the look (and a supervisor waiting on it) for as long as it drips."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname, parts.port, timeout=timeout_s)  # http.client: no proxy, no redirect followed
    timer = threading.Timer(timeout_s, _cut, (conn,))
    timer.daemon = True
    timer.start()
    try:
        conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                     headers={"Connection": "close"})
        resp = conn.getresponse()
        return resp.status, resp.read(MAX_BODY)
    finally:
        timer.cancel()
        conn.close()


def _cut(conn: http.client.HTTPConnection) -> None:
    """End ``conn``'s reads now: a read blocked in another thread returns at once."""
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _status_of(body: bytes) -> str:
    try:
        status = json.loads(body).get("status")
    except (ValueError, AttributeError, RecursionError):
        return ""
    return status if isinstance(status, str) and _STATUS.fullmatch(status) else ""
