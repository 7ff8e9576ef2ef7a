"""Decode: the prompt computed on the decode worker itself (a mixin of :class:`DecodeTable`).

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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.disagg import protocol
from splitserve.disagg.lifecycle.actions import Action, ComputePrompt, KVFallback, SendToPeer
from splitserve.disagg.lifecycle.states import DecodeState, Ending, Reason

if TYPE_CHECKING:
    from splitserve.disagg.lifecycle.decode_table import DecodeRoom


KV_FALLBACK_REASONS = frozenset({
    Reason.PEER_LOST, Reason.PEER_FAILED, Reason.TRANSFER_TIMEOUT, Reason.BOOTSTRAP_TIMEOUT,
    Reason.TRANSFER_ERROR, Reason.INCOMPATIBLE_PEER,
})
"""The failures of a room's KV that decode recovers from by computing the prompt itself (policy
``recompute``): the prefill, the link or the transfer failed. Not the client's abort (or the
peer's report of one), a request timeout, a lack of pages, a bad request or this worker's own
error: those end the room as they would without a fallback."""

KV_FAILURE_POLICIES = ("recompute", "fail")


class PromptHere:
    """What :class:`~splitserve.disagg.lifecycle.decode_table.DecodeTable` does when a room's prompt
    runs here; its rooms, timers, peers and ``recompute`` flag are the table's."""

    def _kv_lost(self, r: DecodeRoom, ending: Ending, now: float, out: list[Action],
                 wait_for_pages: bool = True) -> None:
        """The room's KV will not come (``ending`` says why): under ``recompute``, a room with no
        first token yet computes its prompt here — at once if no write can reach its pages any
        more, else once none can (``RECLAIMING``); one still waiting for its pages in ``PREALLOC``
        computes once they come (within the same deadline), unless that deadline is what ran out
        (``wait_for_pages`` False: no room for the recompute). Otherwise it ends."""
        has_pages = len(r.pages) >= r.n_pages
        if not (self.recompute and ending.reason in KV_FALLBACK_REASONS and not r.alone and r.fallback is None
                and r.state in (DecodeState.PREALLOC, DecodeState.AWAITING_KV) and (has_pages or wait_for_pages)):
            self._end(r, ending, now, out)
            return
        r.fallback = ending
        out.append(KVFallback(r.id, r.rid, ending.reason, ending.detail))
        self._timers.cancel(("resend", r.id))
        if not has_pages:  # PREALLOC, never registered: no prefill will have these pages
            if not ending.from_peer and self._reachable(r.peer):
                out.append(SendToPeer(r.peer, protocol.AbortRoom(r.id, self.incarnation, ending.reason.value)))
            self.peers.unbind(r.peer, r.id)
            return
        if self._writes_may_land(r):
            self._enter(r, DecodeState.RECLAIMING, now, out)
            self._send_abort(r, now, out)  # prefill answers WritesSettled once none of its writes can land
        else:
            if not ending.from_peer and not r.kv_done and self._reachable(r.peer):
                out.append(SendToPeer(r.peer, protocol.AbortRoom(r.id, self.incarnation, ending.reason.value)))
            self._compute_here(r, now, out)

    def _send_abort(self, r: DecodeRoom, now: float, out: list[Action]) -> None:
        """RECLAIMING: tell prefill the room is over for it, and again every ``quarantine_resend_s``."""
        out.append(SendToPeer(r.peer, protocol.AbortRoom(r.id, self.incarnation, r.fallback.reason.value)))
        self._timers.set(("resend", r.id), now + self.cfg.quarantine_resend_s)

    def _compute_here(self, r: DecodeRoom, now: float, out: list[Action]) -> None:
        """No write of a prefill can reach the room's pages: its prompt runs here, into them."""
        self._timers.cancel(("resend", r.id))
        self.peers.unbind(r.peer, r.id)  # it no longer depends on that prefill
        r.reclaimed = True
        self._enter(r, DecodeState.PREFILLING, now, out)
        out.append(ComputePrompt(r.id, r.rid, r.fallback.reason if r.fallback is not None else None))

    def _first_token_here(self, room: int, now: float, out: list[Action]) -> None:
        """A room whose prompt ran here produced its first token: it decodes from now on."""
        r = self._rooms.get(room)
        if r is not None and r.state is DecodeState.PREFILLING:
            self._enter(r, DecodeState.DECODING, now, out)
