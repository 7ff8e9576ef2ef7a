"""``post_json``: a POST whose headers may name a header more than once (``requests`` takes a
dict: one value a name)."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit


def post_json(url: str, path: str, body: dict, headers: list[tuple[str, str]]) -> tuple[int, dict]:
    """POST ``body`` as JSON to ``url`` + ``path`` with ``headers`` as given, in order; the status
    and the JSON answer."""
    parts = urlsplit(url)
    data = json.dumps(body).encode()
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.putrequest("POST", path)
        for name, value in [("Content-Type", "application/json"), ("Content-Length", str(len(data))), *headers]:
            conn.putheader(name, value)
        conn.endheaders(data)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()
