"""A prefill and a decode worker driven by hand, as the router drives them, and killed at will."""

from __future__ import annotations

import signal
import time

from cluster import post_generate
from helpers.calls import Call
from helpers.prompts import GREEDY


def direct_pair(prefill, decode, ids: list[int], max_new_tokens: int, room: int, timeout: float) -> tuple[Call, Call]:
    """What the router does, by hand: the same request with the same room to both workers at once
    (the prefill's ``host`` if it has one: a :class:`netns.NetnsServer`)."""
    extra = {"bootstrap_host": getattr(prefill, "host", "127.0.0.1"), "bootstrap_port": prefill.bootstrap_port,
             "bootstrap_room": room}
    return tuple(Call(getattr(w, "post_generate", post_generate), w.url, ids, max_new_tokens, timeout=timeout,
                      extra=extra, **GREEDY) for w in (prefill, decode))


def kill9(proc) -> float:
    """SIGKILL and reap; the time of the kill."""
    at = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    return at
