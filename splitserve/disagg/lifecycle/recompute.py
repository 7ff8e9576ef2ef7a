"""Decode: when a room computes its prompt on the decode worker itself, decided for the decode table.

Two ways lead to ``PREFILLING``. A request that came with no prefill (``RequestArrived.alone``:
no bootstrap fields) waits in ``PREALLOC`` for its pages only, then computes its prompt here, as a
colocated worker would. And under ``kv_failure_policy="recompute"`` (``--kv-failure-policy``)
a room that learns, before its first token, that its KV will not come
— its prefill lost or failed, a transfer or bootstrap timeout, KV that is not its own, the router
saying so (``KVLost``) — **falls back** (``KVFallback``) instead of failing: it computes its
prompt itself into the pages it holds, once no write of the lost prefill can reach them. Those
pages are safe at once when prefill never had them (not registered), when every write landed
(``KVDone``), when prefill said ``WritesSettled``, or when it is declared lost (the disconnect,
emitted first, fences its link); otherwise the room waits in ``RECLAIMING`` for one of those, and
fails with its reason (its pages quarantined, as for any end) if none comes within ``reclaim_s``.
A client abort, the peer's report of one, a request timeout or a room without its pages (no room
for the recompute) end the room as they end any other.

:class:`Recompute` only decides (a :class:`Plan` from the room's facts); the decode table, which
owns rooms, timers and peers, carries the plan out (``decode_table.py``, ``_kv_lost``).
"""

from __future__ import annotations

import enum

from splitserve.disagg.lifecycle.states import DecodeState, Ending, Reason


KV_FALLBACK_REASONS = frozenset({
    Reason.PEER_LOST, Reason.PEER_FAILED, Reason.TRANSFER_TIMEOUT, Reason.BOOTSTRAP_TIMEOUT,
    Reason.TRANSFER_ERROR, Reason.INCOMPATIBLE_PEER,
})
"""The failures of a room's KV that decode recovers from by computing the prompt itself (policy
``recompute``): the prefill, the link or the transfer failed. Not the client's abort (or the
peer's report of one), a request timeout, a lack of pages, a bad request or this worker's own
error: those end the room as they would without a fallback."""

KV_FAILURE_POLICIES = ("recompute", "fail")


class Plan(enum.Enum):
    """What a room whose KV will not come does."""

    END = "end"
    """It ends with the failure (policy ``fail``, a reason that is not the KV's, or no room for it)."""
    AWAIT_PAGES = "await_pages"
    """It falls back, and computes its prompt once its pages come (``PREALLOC``, never registered:
    no prefill will have these pages)."""
    RECLAIM = "reclaim"
    """It falls back, and waits in ``RECLAIMING`` until no write of its prefill can land."""
    COMPUTE = "compute"
    """It falls back and computes its prompt now: no write can reach its pages."""


class Recompute:
    """The fallback policy of one decode table (``--kv-failure-policy``)."""

    def __init__(self, policy: str):
        if policy not in KV_FAILURE_POLICIES:
            raise ValueError(f"kv_failure_policy must be one of {', '.join(KV_FAILURE_POLICIES)}, got {policy!r}")
        self.enabled = policy == "recompute"

    def plan(self, r, ending: Ending, wait_for_pages: bool, writes_may_land: bool) -> Plan:
        """For room ``r`` (a ``DecodeRoom``) whose KV will not come (``ending`` says why): under
        ``recompute``, a room with no first token yet falls back — at once if no write can reach
        its pages any more, else once none can; one still waiting for its pages in ``PREALLOC``
        computes once they come, unless ``wait_for_pages`` is False (its pages' deadline is what
        ran out: no room for the recompute). Otherwise it ends."""
        has_pages = len(r.pages) >= r.n_pages
        if not (self.enabled and ending.reason in KV_FALLBACK_REASONS and not r.alone and r.fallback is None
                and r.state in (DecodeState.PREALLOC, DecodeState.AWAITING_KV) and (has_pages or wait_for_pages)):
            return Plan.END
        if not has_pages:
            return Plan.AWAIT_PAGES
        return Plan.RECLAIM if writes_may_land else Plan.COMPUTE
