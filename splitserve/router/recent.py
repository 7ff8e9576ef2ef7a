"""What the router remembers of each request it forwards (:class:`RecentRequests`): the live ones and
the last :data:`RECENT_REQUESTS` ended ones, each with the pair of workers of every attempt, for
``GET /debug/requests/{rid}`` (``debug.py``)."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Optional

RECENT_REQUESTS = 4096


class RecentRequests:
    """rid -> what the router knows of that request (the newest one of that rid), live and recently
    ended; bounded by count. Written and read on the router's event loop only."""

    def __init__(self, capacity: int = RECENT_REQUESTS):
        self.capacity = capacity
        self._entries: "OrderedDict[str, dict]" = OrderedDict()

    def start(self, rid: str, room: int, endpoint: str, prefill: str, decode: str, started: float) -> None:
        self._entries.pop(rid, None)
        self._entries[rid] = {"rid": rid, "room": room, "endpoint": endpoint, "prefill": prefill, "decode": decode,
                              "arrived": round(time.time() - (time.monotonic() - started), 6), "live": True,
                              "outcome": None, "status": None, "seconds": None, "ttft_s": None, "error": None,
                              "attempts": [{"room": room, "rid": rid, "prefill": prefill, "decode": decode,
                                            "failed": None}]}
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def retried(self, rid: str, role: str, cause: str) -> None:
        """The last attempt's ``role`` leg failed for ``cause`` and the request is tried again."""
        entry = self._entries.get(rid)
        if entry is not None:
            entry["attempts"][-1]["failed"] = f"{role}: {cause}"

    def attempt(self, rid: str, room: int, worker_rid: str, prefill: str, decode: str) -> None:
        """A new attempt (a retry) of request ``rid``: its room, the id its workers know it by, its pair."""
        entry = self._entries.get(rid)
        if entry is not None:
            entry.update(room=room, prefill=prefill, decode=decode)
            entry["attempts"].append({"room": room, "rid": worker_rid, "prefill": prefill, "decode": decode,
                                      "failed": None})

    def end(self, rid: str, outcome: str, status: int, seconds: float, ttft: Optional[float],
            error: Optional[str] = None) -> None:
        """The request ended; ``error``: the operator's account of a failure the router answered
        (the worker's address, the exception), which its client read only in words."""
        entry = self._entries.get(rid)
        if entry is not None and entry["live"]:
            entry.update(live=False, outcome=outcome, status=status, seconds=round(seconds, 6),
                         ttft_s=round(ttft, 6) if ttft is not None else None, error=error)

    def get(self, rid: str) -> Optional[dict]:
        return self._entries.get(rid)
