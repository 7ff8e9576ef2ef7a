"""Decode's progress bounds start at the scheduler's admission (``docs/lifecycle.md``, decode's
``PREFILLING`` and ``DECODING``): a room waiting for its turn behind work the engine is doing is
bounded by ``queue_s``, not failed as stalled; once admitted, a room that gets no chunk or step
within its stall bound still fails ``stalled``. And a request's own deadline (``deadline_s``, the
router's remaining time) ends a room sooner than ``request_timeout_s``, never later. A fake clock.
"""

from __future__ import annotations

import pytest

from splitserve.disagg import protocol
from splitserve.disagg.lifecycle import (
    Admitted, Deadlines, DecodeState, DecodeStep, DecodeTable, FromPeer, NotifyClient, PagesReserved, Peer,
    PeerInfo, PeerLost, Preempted, PromptChunk, Reason, RequestArrived,
)

D = Deadlines(queue_s=60.0, prefill_stall_s=5.0, decode_stall_s=5.0)
PP = Peer("prefill-0:7000", "p1")
ROOM, RID, PROMPT, DST = -1, "r1", 8, (10, 11)


def endings(actions):
    return [a.ending for a in actions if isinstance(a, NotifyClient)]


def alone(deadlines=D, deadline_s=None) -> DecodeTable:
    """A room alone, its pages in hand at t=0: its prompt waits for the scheduler."""
    t = DecodeTable(deadlines, "d1", page_size=4, vocab_size=100)
    t.handle(RequestArrived(ROOM, RID, PROMPT, alone=True, deadline_s=deadline_s), 0.0)
    t.handle(PagesReserved(ROOM, DST), 0.0)
    assert t.state_of(ROOM) is DecodeState.PREFILLING
    return t


def test_a_room_waiting_for_its_turn_outlives_the_stall_bound():
    t = alone()
    assert endings(t.expire(4 * D.prefill_stall_s)) == []
    assert t.state_of(ROOM) is DecodeState.PREFILLING


def test_the_wait_for_a_turn_is_bounded_by_queue_s():
    t = alone()
    assert endings(t.expire(D.queue_s - 0.01)) == []
    [ending] = endings(t.expire(D.queue_s))
    assert ending.reason is Reason.OVERLOADED and "its turn" in ending.detail


def test_once_admitted_a_room_with_no_chunk_is_stalled():
    t = alone()
    t.handle(Admitted(ROOM), 40.0)
    assert endings(t.expire(40.0 + D.prefill_stall_s - 0.01)) == []
    [ending] = endings(t.expire(40.0 + D.prefill_stall_s))
    assert ending.reason is Reason.STALLED


def test_chunks_after_admission_push_the_stall_bound_back():
    t = alone()
    t.handle(Admitted(ROOM), 40.0)
    t.handle(PromptChunk(ROOM), 44.0)
    assert endings(t.expire(48.0)) == []
    t.handle(DecodeStep(ROOM), 48.0)
    assert t.state_of(ROOM) is DecodeState.DECODING
    assert endings(t.expire(52.9)) == []
    assert endings(t.expire(53.0))[0].reason is Reason.STALLED


def test_a_preempted_room_waits_for_its_turn_again():
    t = alone()
    t.handle(Admitted(ROOM), 1.0)
    t.handle(DecodeStep(ROOM), 2.0)
    t.handle(Preempted(ROOM), 3.0)
    assert endings(t.expire(3.0 + 4 * D.decode_stall_s)) == [], "a preempted room waits; it is no stall"
    t.handle(Admitted(ROOM), 30.0)
    assert endings(t.expire(30.0 + D.decode_stall_s))[0].reason is Reason.STALLED


def test_a_fallback_waiting_for_its_turn_ends_with_its_reason_at_queue_s():
    t = DecodeTable(D, "d1", page_size=4, vocab_size=100, kv_failure_policy="recompute")
    t.handle(RequestArrived(7, RID, PROMPT), 0.0)
    t.handle(PagesReserved(7, DST), 0.0)
    t.handle(PeerInfo(7, PP), 0.0)
    t.handle(PeerLost(PP, "gone"), 1.0)
    assert t.state_of(7) is DecodeState.PREFILLING
    assert endings(t.expire(1.0 + 4 * D.prefill_stall_s)) == []
    [ending] = endings(t.expire(1.0 + D.queue_s))
    assert ending.reason is Reason.PEER_LOST and "its turn" in ending.detail


def test_a_room_whose_kv_came_waits_for_its_turn_before_its_decode_bound():
    t = DecodeTable(D, "d1", page_size=4, vocab_size=100)
    t.handle(RequestArrived(7, RID, PROMPT), 0.0)
    t.handle(PagesReserved(7, DST), 0.0)
    t.handle(PeerInfo(7, PP), 0.0)
    t.handle(FromPeer(PP, protocol.KVDone(7, PP.incarnation, 42, PROMPT)), 1.0)
    assert t.state_of(7) is DecodeState.DECODING
    assert endings(t.expire(30.0)) == []
    t.handle(Admitted(7), 30.0)
    assert endings(t.expire(35.0))[0].reason is Reason.STALLED


@pytest.mark.parametrize("deadline_s,request_timeout_s,ends_at", [
    (10.0, None, 10.0),     # the sender's deadline alone
    (10.0, 100.0, 10.0),    # shorter than the worker's own: it shortens it
    (500.0, 100.0, 100.0),  # longer: the worker's own bound holds
    (None, 100.0, 100.0),
])
def test_a_request_s_deadline_only_shortens_the_worker_s_own(deadline_s, request_timeout_s, ends_at):
    deadlines = Deadlines(queue_s=1000.0, tombstone_s=5000.0, request_timeout_s=request_timeout_s)
    t = alone(deadlines, deadline_s)
    assert endings(t.expire(ends_at - 0.01)) == []
    [ending] = endings(t.expire(ends_at))
    assert ending.reason is Reason.REQUEST_TIMEOUT
