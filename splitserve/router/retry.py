"""Retries before the commit: which leg failures may be tried again, how often, and how soon
(``docs/router.md`` has the reasons and the defaults).

A leg that fails before anything reached the client, in a way that says the worker did not take
the request, is tried again on *another* worker of that role, with a new bootstrap room
(``proxy.forward``); :func:`cause` names the failures that qualify: ``unreachable`` (the
connection could not be opened in time), ``gone`` (it broke before the answer began to reach the
client), ``unavailable`` (a 503) and ``overloaded`` (a 429; never back to the worker that shed
it). Nothing else is retried: another 4xx is the request's own fault, a worker silent past
``worker_header_timeout_s`` has already cost that bound, and a byte sent commits the answer.

:class:`RetryBudget` keeps retries to a share of the traffic: over the last
``retry_budget_window_s`` seconds, at most ``retry_budget_min`` plus ``retry_budget_ratio`` times
the requests received, counted in one-second buckets (bounded memory whatever the rate).
:func:`backoff` is the wait before retry number ``n`` (from 1): ``BACKOFF_BASE_S`` doubled each
time, at most ``BACKOFF_CAP_S``, times a jitter in [0.5, 1.5).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from typing import Optional

import aiohttp

from splitserve.router.answers import AnswerTooLarge
from splitserve.router.legs import NoHeaders

CAUSES = ("unreachable", "gone", "unavailable", "overloaded")
DENIALS = ("max_retries", "budget", "deadline", "no_other_worker")
RETRY_STATUSES = {503: "unavailable", 429: "overloaded"}
BACKOFF_BASE_S = 0.02
BACKOFF_CAP_S = 0.25


def cause(error: Optional[BaseException], status: Optional[int] = None) -> Optional[str]:
    """Why a leg that ended with ``error`` (before its headers) or answered ``status`` may be
    tried again elsewhere; None if it may not."""
    if error is None:
        return RETRY_STATUSES.get(status) if status is not None else None
    if isinstance(error, AnswerTooLarge):
        return None  # another worker would answer as much
    if isinstance(error, aiohttp.ServerDisconnectedError):
        return "gone"
    if isinstance(error, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)):
        return "unreachable"
    if isinstance(error, (aiohttp.ClientOSError, aiohttp.ClientPayloadError)):
        return "gone"  # reset by the peer, or a body cut short
    if isinstance(error, aiohttp.ClientConnectionError) and not isinstance(error, aiohttp.ServerTimeoutError):
        return "unreachable"
    return None  # timeouts (no headers in time), cancellations, bugs


def fallback_cause(error: Optional[BaseException], status: Optional[int] = None) -> Optional[str]:
    """Why a request whose prefill leg failed so, before prefill accepted it, may still go to a
    decode worker alone once no retry is left (``split.py``): every :func:`cause`, a prefill that
    sent no headers in time, or a 5xx; never a 4xx (the request's own fault, which decode would
    refuse too) but 429."""
    why = cause(error, status)
    if why is not None:
        return why
    if error is not None:
        return "timeout" if isinstance(error, (asyncio.TimeoutError, NoHeaders)) else None
    return "failed" if status is not None and status >= 500 else None


def backoff(n: int, unit: float) -> float:
    """Seconds to wait before retry ``n`` (1, 2, ...); ``unit`` in [0, 1) draws the jitter."""
    return min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (n - 1)) * (0.5 + unit)


class RetryBudget:
    """Requests and retries over a sliding window of whole seconds (on the caller's clock)."""

    def __init__(self, ratio: float, minimum: int, window_s: float):
        self.ratio = ratio
        self.minimum = minimum
        self.window = max(1, math.ceil(window_s))
        self._buckets: deque[list[int]] = deque()  # [second, requests, retries], oldest first

    def _bucket(self, now: float) -> list[int]:
        second = math.floor(now)
        while self._buckets and self._buckets[0][0] <= second - self.window:
            self._buckets.popleft()
        if not self._buckets or self._buckets[-1][0] != second:
            self._buckets.append([second, 0, 0])
        return self._buckets[-1]

    def request(self, now: float) -> None:
        """A request arrived (one that may later be retried)."""
        self._bucket(now)[1] += 1

    def spend(self, now: float) -> bool:
        """Take one retry from the budget if it allows one now."""
        bucket = self._bucket(now)
        requests = sum(b[1] for b in self._buckets)
        retries = sum(b[2] for b in self._buckets)
        if retries + 1 > self.minimum + self.ratio * requests:
            return False
        bucket[2] += 1
        return True


def jitter_unit(room: int) -> float:
    """A number in [0, 1) from the next attempt's room: random in production (rooms are drawn by
    ``secrets``), and drawn from the seed in the simulator, so its runs replay exactly."""
    return (room & 0xFFFFF) / 0x100000
