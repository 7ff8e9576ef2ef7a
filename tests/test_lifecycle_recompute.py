"""Unit tests of decode's prompt computed here (``lifecycle/recompute.py``, ``docs/lifecycle.md``,
*The fallback*), with a fake clock: a request alone, and each move of a room whose KV will not come
under ``kv_failure_policy="recompute"`` — and what still ends the room as before.
"""

from __future__ import annotations

import pytest

from splitserve.disagg import protocol
from splitserve.disagg.lifecycle import (
    ClientAbort, ComputePrompt, Deadlines, DecodeState, DecodeStep, DecodeTable, DisconnectPeer, Finished,
    FreePages, FromPeer, KVFallback, KVLost, NotifyClient, PagesReserved, Peer, PeerHeard, PeerInfo, PeerLost,
    Notice, PromptChunk, QuarantinePages, Reason, RequestArrived, SendToPeer, StartDecode,
)

PP = Peer("prefill-0:7000", "p1")
D = Deadlines()
ROOM, RID, PROMPT = 7, "r7", 8  # page size 4: 2 pages
DST = (10, 11)
S = DecodeState


def of(actions, cls):
    return [a for a in actions if isinstance(a, cls)]


def sent(actions, cls):
    return [a.msg for a in actions if isinstance(a, SendToPeer) and isinstance(a.msg, cls)]


def table(policy="recompute", deadlines=D) -> DecodeTable:
    return DecodeTable(deadlines, "d1", page_size=4, vocab_size=100, kv_failure_policy=policy)


def awaiting(policy="recompute", deadlines=D) -> DecodeTable:
    t = table(policy, deadlines)
    t.handle(RequestArrived(ROOM, RID, PROMPT), 0.0)
    t.handle(PagesReserved(ROOM, DST), 0.0)
    t.handle(PeerInfo(ROOM, PP), 0.0)
    assert t.state_of(ROOM) is S.AWAITING_KV
    return t


def computes(actions) -> None:
    assert of(actions, ComputePrompt) == [ComputePrompt(ROOM, RID, of(actions, ComputePrompt)[0].reason)], actions
    assert not of(actions, NotifyClient) and not of(actions, FreePages) and not of(actions, QuarantinePages)


def test_a_request_alone_waits_for_its_pages_then_computes_its_prompt_and_decodes():
    t = table("fail")  # alone is not a fallback: either policy serves it
    assert of(t.handle(RequestArrived(-1, RID, PROMPT, alone=True), 0.0), SendToPeer) == []
    acts = t.handle(PagesReserved(-1, DST), 0.1)
    assert of(acts, ComputePrompt) == [ComputePrompt(-1, RID, None)]
    assert t.state_of(-1) is S.PREFILLING
    t.handle(PromptChunk(-1), 0.2)
    t.handle(DecodeStep(-1), 0.3)
    assert t.state_of(-1) is S.DECODING
    end = t.handle(Finished(-1, Reason.LENGTH), 0.4)
    assert of(end, NotifyClient)[0].ending.reason is Reason.LENGTH and of(end, FreePages)[0].pages == DST
    assert not of(end, SendToPeer), "no prefill to tell"


def test_a_request_alone_without_pages_is_overloaded_at_the_prealloc_deadline():
    t = table()
    t.handle(RequestArrived(-1, RID, PROMPT, alone=True), 0.0)
    acts = t.expire(D.prealloc_s)
    assert of(acts, NotifyClient)[0].ending.reason is Reason.OVERLOADED


def test_a_stalled_prompt_here_ends_with_the_fallback_s_reason():
    t = awaiting()
    t.handle(PeerLost(PP, "gone"), 1.0)
    assert t.state_of(ROOM) is S.PREFILLING
    t.handle(PromptChunk(ROOM), 1.0 + D.prefill_stall_s - 1)  # progress pushes the deadline back
    assert t.expire(1.0 + D.prefill_stall_s + 0.5) == []
    acts = t.expire(1.0 + 2 * D.prefill_stall_s)
    assert of(acts, NotifyClient)[0].ending.reason is Reason.PEER_LOST


def test_a_lost_prefill_is_fenced_then_the_room_computes_at_once():
    t = awaiting()
    acts = t.handle(PeerLost(PP, "connection broke"), 1.0)
    assert isinstance(acts[0], DisconnectPeer), "the fence comes before anything else"
    assert of(acts, KVFallback)[0].reason is Reason.PEER_LOST
    computes(acts)
    assert t.state_of(ROOM) is S.PREFILLING and not t.peers.live_peers()


@pytest.mark.parametrize("settle", ["WritesSettled", "KVDone", "peer lost"])
def test_a_prefill_failure_waits_reclaiming_until_no_write_can_land(settle):
    t = awaiting()
    acts = t.handle(FromPeer(PP, protocol.RoomFailed(ROOM, PP.incarnation, "stalled")), 1.0)
    assert of(acts, KVFallback)[0].reason is Reason.PEER_FAILED and not of(acts, ComputePrompt)
    assert t.state_of(ROOM) is S.RECLAIMING
    again = 1.0 + D.quarantine_resend_s
    assert sent(t.handle(PeerHeard(PP), again) + t.expire(again), protocol.AbortRoom), "asked again while it waits"
    msg = {"WritesSettled": protocol.WritesSettled(ROOM, PP.incarnation),
           "KVDone": protocol.KVDone(ROOM, PP.incarnation, 42, PROMPT)}.get(settle)
    acts = t.handle(FromPeer(PP, msg), again) if msg else t.handle(PeerLost(PP, "gone"), again)
    computes(acts)
    assert not of(acts, StartDecode), "KV that came too late is not used: the prompt is computed"


def test_reclaiming_that_never_settles_fails_with_its_reason_and_quarantines():
    t = awaiting()
    now = 0.0
    while now < D.kv_wait_s + D.reclaim_s:  # the prefill lives on, and never settles
        now += 1.0
        acts = t.handle(PeerHeard(PP), now) + t.expire(now)
        if now == D.kv_wait_s:
            assert t.state_of(ROOM) is S.RECLAIMING
    assert of(acts, NotifyClient)[0].ending.reason is Reason.TRANSFER_TIMEOUT
    assert of(acts, QuarantinePages)[0].pages == DST


@pytest.mark.parametrize("reason, detail", [("peer_failed", "the router: prefill answered 503"),
                                            ("transfer_error", None)])
def test_what_the_router_says_and_kv_of_another_room_fall_back(reason, detail):
    t = awaiting()
    if detail:
        acts = t.handle(KVLost(ROOM, detail), 1.0)
        assert t.state_of(ROOM) is S.RECLAIMING
        acts = t.handle(FromPeer(PP, protocol.WritesSettled(ROOM, PP.incarnation)), 1.1)
    else:
        acts = t.handle(FromPeer(PP, protocol.KVDone(ROOM, PP.incarnation, 42, PROMPT + 1)), 1.0)
        assert of(acts, KVFallback)[0].reason is Reason.TRANSFER_ERROR
    computes(acts)


@pytest.mark.parametrize("how", ["client abort", "peer abort", "request timeout", "policy fail", "no pages"])
def test_what_still_ends_the_room(how):
    deadlines = Deadlines(request_timeout_s=100.0) if how == "request timeout" else D
    t = awaiting("fail" if how == "policy fail" else "recompute", deadlines)
    if how == "client abort":
        acts, reason = t.handle(ClientAbort(ROOM), 1.0), Reason.CLIENT_ABORT
    elif how == "peer abort":
        acts = t.handle(FromPeer(PP, protocol.RoomFailed(ROOM, PP.incarnation, "client_abort")), 1.0)
        reason = Reason.PEER_ABORT
    elif how == "request timeout":
        acts, reason = t.handle(PeerHeard(PP), 100.0) + t.expire(100.0), Reason.REQUEST_TIMEOUT
    elif how == "policy fail":
        acts, reason = t.handle(PeerLost(PP, "gone"), 1.0), Reason.PEER_LOST
    else:  # bootstrap timeout without its pages: nothing to compute into
        t = table()
        t.handle(RequestArrived(ROOM, RID, PROMPT), 0.0)
        acts, reason = t.expire(D.prealloc_s), Reason.BOOTSTRAP_TIMEOUT
    assert not of(acts, KVFallback) and not of(acts, ComputePrompt)
    assert of(acts, NotifyClient)[0].ending.reason is reason


def test_a_room_computing_here_ignores_its_old_prefill():
    t = awaiting()
    t.handle(PeerLost(PP, "gone"), 1.0)
    assert t.state_of(ROOM) is S.PREFILLING
    fresh = Peer(PP.name, "p2")
    assert not of(t.handle(PeerLost(fresh, "gone too"), 2.0), NotifyClient)
    assert t.state_of(ROOM) is S.PREFILLING


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="kv_failure_policy"):
        table("sometimes")


def test_a_room_told_before_its_pages_came_computes_once_they_come():
    t = table()
    t.handle(RequestArrived(ROOM, RID, PROMPT), 0.0)  # in the page queue, no prefill info yet
    acts = t.handle(KVLost(ROOM, "the router: prefill refused"), 1.0)
    assert of(acts, KVFallback) and not of(acts, ComputePrompt) and not of(acts, NotifyClient)
    assert of(t.handle(KVLost(ROOM, "again"), 1.5), NotifyClient) == [], "told twice: still one fallback"
    assert not of(t.handle(PeerInfo(ROOM, PP), 2.0), SendToPeer), "it no longer registers with a prefill"
    computes(t.handle(PagesReserved(ROOM, DST), 3.0))


def test_a_room_told_that_never_gets_pages_fails_with_its_reason_at_the_prealloc_deadline():
    t = table()
    t.handle(RequestArrived(ROOM, RID, PROMPT), 0.0)
    t.handle(KVLost(ROOM, "the router: prefill refused"), 1.0)
    acts = t.expire(D.prealloc_s)
    assert of(acts, NotifyClient)[0].ending.reason is Reason.PEER_FAILED


def test_a_decoding_room_preempted_for_pages_recomputes_without_being_declared_stalled():
    # The engine preempts a decoding sequence when pages run out and later recomputes its tokens in
    # chunks; each chunk is progress, so a recompute longer than decode_stall_s is not a stall.
    t = table()
    t.handle(RequestArrived(-1, RID, PROMPT, alone=True), 0.0)
    t.handle(PagesReserved(-1, DST), 0.0)
    t.handle(DecodeStep(-1), 0.1)
    assert t.state_of(-1) is S.DECODING
    step = D.decode_stall_s * 0.75
    for i in range(1, 4):
        chunk = t.handle(PromptChunk(-1), 0.1 + i * step)
        assert of(chunk, NotifyClient) == [] and of(chunk, Notice) == [], chunk
        assert of(t.expire(0.1 + i * step + D.decode_stall_s * 0.5), NotifyClient) == []
    assert t.state_of(-1) is S.DECODING
    acts = t.expire(0.1 + 3 * step + D.decode_stall_s + 0.5)
    assert of(acts, NotifyClient)[0].ending.reason is not None, "a real stall still ends the room"
