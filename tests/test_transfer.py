"""The KV transfer layer: span merging, and every backend's contract (base.py) on real KV pools.

Each backend test runs for fake, tcp and nixl (nixl skipped only where it cannot be imported).
Two tests move KV between two real processes (spawn), one over tcp and one over NIXL/UCX.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import msgpack
import pytest
import torch
import zmq

from splitserve.disagg.transfer import Span, TransferBackend, failed, get_backend, page_spans
from splitserve.disagg.transfer.fake import FakeBackend
from splitserve.disagg.transfer.tcp import TcpBackend
from splitserve.engine.kv_pool import KVLayout, KVPool

LAYOUT = KVLayout(num_pages=32, num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
P = LAYOUT.page_nbytes  # 512 B
TIMEOUT_S = 10.0


# -- page_spans ---------------------------------------------------------------------------------


def test_page_spans_merges_runs_consecutive_on_both_sides():
    assert page_spans([3, 4, 5], [10, 11, 12], P) == [Span(3 * P, 10 * P, 3 * P)]
    assert page_spans([3, 4, 5, 9], [10, 11, 20, 21], P) == [
        Span(3 * P, 10 * P, 2 * P), Span(5 * P, 20 * P, P), Span(9 * P, 21 * P, P)]


def test_page_spans_breaks_on_either_side():
    assert page_spans([1, 2, 3], [7, 9, 10], P) == [Span(P, 7 * P, P), Span(2 * P, 9 * P, 2 * P)]  # remote break
    assert page_spans([1, 3, 4], [7, 8, 9], P) == [Span(P, 7 * P, P), Span(3 * P, 8 * P, 2 * P)]  # local break
    assert page_spans([2, 1], [5, 6], P) == [Span(2 * P, 5 * P, P), Span(P, 6 * P, P)]  # descending is no run


def test_page_spans_empty_and_errors():
    assert page_spans([], [], P) == []
    with pytest.raises(ValueError, match="length"):
        page_spans([1, 2], [1], P)
    with pytest.raises(ValueError):
        page_spans([-1], [0], P)


def test_registry():
    assert get_backend("fake") is FakeBackend and get_backend("tcp") is TcpBackend
    with pytest.raises(ValueError, match="unknown transfer backend 'rdma'"):
        get_backend("rdma")


# -- helpers ------------------------------------------------------------------------------------


def filled_pool(seed: int) -> KVPool:
    pool = KVPool(LAYOUT)
    g = torch.Generator().manual_seed(seed)
    flat = pool.buffer.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(1, 256, flat.shape, dtype=torch.uint8, generator=g))  # no zero byte
    return pool


def wait_state(backend: TransferBackend, handle, pump=lambda: None):
    deadline = time.monotonic() + TIMEOUT_S
    while (state := backend.poll(handle)).pending:
        assert time.monotonic() < deadline, "write still pending"
        pump()
        time.sleep(0.001)
    return state


def wait_notifs(backend: TransferBackend, n: int, timeout: float = TIMEOUT_S) -> list[tuple[str, bytes]]:
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + timeout
    while True:
        got += backend.notifications()
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.001)


def assert_pages(dst: KVPool, src: KVPool, local_pages, remote_pages) -> None:
    for lp, rp in zip(local_pages, remote_pages):
        assert torch.equal(dst.page_bytes(rp), src.page_bytes(lp)), f"page {lp} -> {rp} differs"
    untouched = set(range(LAYOUT.num_pages)) - set(remote_pages)
    for p in untouched:
        assert int(dst.page_bytes(p).count_nonzero()) == 0, f"page {p} was written"


@dataclass
class Pair:
    """A writer and a receiver in this process. Waiting pumps the receiver's notifications too:
    NIXL without a progress thread moves bytes only while both sides call into it."""

    kind: str
    a: TransferBackend  # writer (prefill)
    b: TransferBackend  # receiver (decode)
    src: KVPool
    dst: KVPool
    inbox: list = field(default_factory=list)

    def wait(self, handle):
        return wait_state(self.a, handle, pump=lambda: self.inbox.extend(self.b.notifications()))

    def notifs(self, n: int, timeout: float = TIMEOUT_S) -> list[tuple[str, bytes]]:
        got = self.inbox + wait_notifs(self.b, n - len(self.inbox), timeout)
        self.inbox = []
        return got


def make(kind: str, name: str, pool: KVPool, **opts) -> TransferBackend:
    if kind == "nixl":
        pytest.importorskip("splitserve.disagg.transfer.nixl", reason="nixl is not importable", exc_type=ImportError)
    return get_backend(kind)(name, pool.buffer, **opts)


@pytest.fixture(params=["fake", "tcp", "nixl"])
def pair(request) -> Iterator[Pair]:
    kind, tag = request.param, uuid.uuid4().hex[:8]
    src, dst = filled_pool(1), KVPool(LAYOUT)
    a = make(kind, f"prefill-{tag}", src)
    b = make(kind, f"decode-{tag}", dst)
    a.add_peer(b.agent_name, b.metadata())
    yield Pair(kind, a, b, src, dst)
    a.close()
    b.close()


# -- every backend ------------------------------------------------------------------------------


def test_scattered_pages_land_byte_exact_with_notification(pair: Pair):
    local, remote = [2, 3, 4, 9, 10, 17, 30], [5, 6, 20, 21, 22, 0, 31]
    spans = page_spans(local, remote, P)
    assert len(spans) == 5  # [2,3]->[5,6], 4->20, [9,10]->[21,22], 17->0, 30->31
    h = pair.a.write(pair.b.agent_name, spans, b"room=7;last")
    assert (h.nbytes, h.num_descs) == (7 * P, 5)
    assert pair.wait(h).done
    assert pair.notifs(1) == [(pair.a.agent_name, b"room=7;last")]
    assert_pages(pair.dst, pair.src, local, remote)
    pair.a.release(h)
    pair.a.release(h)  # idempotent
    assert pair.notifs(0, timeout=0.05) == []


def test_several_writes_then_final_notification(pair: Pair):
    chunks = [([0, 1], [8, 9]), ([2, 3, 4], [12, 13, 14]), ([5], [3])]
    handles = [pair.a.write(pair.b.agent_name, page_spans(lp, rp, P), b"") for lp, rp in chunks[:2]]
    assert all(pair.wait(h).done for h in handles)
    last = pair.a.write(pair.b.agent_name, page_spans(*chunks[2], P), b"room=9;chunks=3")
    assert pair.wait(last).done
    assert pair.notifs(1) == [(pair.a.agent_name, b"room=9;chunks=3")]
    assert_pages(pair.dst, pair.src, [p for lp, _ in chunks for p in lp], [p for _, rp in chunks for p in rp])
    # a notification alone (empty span list), e.g. after the last chunk already went
    h = pair.a.write(pair.b.agent_name, [], b"room=9;done")
    assert pair.wait(h).done and h.nbytes == 0
    assert pair.notifs(1) == [(pair.a.agent_name, b"room=9;done")]


def test_every_write_notifies_in_flight_together(pair: Pair):
    hs = [pair.a.write(pair.b.agent_name, page_spans([i], [i + 16], P), b"chunk%d" % i) for i in range(4)]
    assert all(pair.wait(h).done for h in hs)
    got = pair.notifs(4)
    assert sorted(n for _, n in got) == [b"chunk0", b"chunk1", b"chunk2", b"chunk3"]
    assert_pages(pair.dst, pair.src, range(4), range(16, 20))


def test_write_to_unknown_peer_fails(pair: Pair):
    h = pair.a.write("decode-nobody", page_spans([1], [1], P), b"x")
    state = pair.a.poll(h)
    assert state.failed and "unknown_peer" in state.reason
    pair.a.release(h)


@pytest.mark.parametrize("span", [
    Span(0, LAYOUT.num_pages * P - 10, 100),  # past the peer's buffer
    Span(LAYOUT.num_pages * P, 0, 1),  # past ours
    Span(-P, 0, P),
    Span(0, 0, 0),
])
def test_bad_offsets_refused(pair: Pair, span: Span):
    h = pair.a.write(pair.b.agent_name, [Span(0, 0, P), span], b"bad")
    state = pair.wait(h)
    assert state.failed and "bad_span" in state.reason
    assert pair.notifs(1, timeout=0.05) == []
    assert int(pair.dst.buffer.view(-1).view(torch.uint8).count_nonzero()) == 0


def test_peer_registration_rules(pair: Pair):
    md = pair.b.metadata()
    pair.a.add_peer(pair.b.agent_name, md)  # idempotent
    with pytest.raises(ValueError, match="names agent"):
        pair.a.add_peer("decode-other", md)
    other = make(pair.kind, f"decode-{uuid.uuid4().hex[:8]}", KVPool(LAYOUT))
    try:
        with pytest.raises(ValueError, match="new incarnation"):
            pair.a.add_peer(pair.b.agent_name, other.metadata())
    finally:
        other.close()
    wrong = msgpack.unpackb(md)
    wrong["backend"] = "mooncake"
    with pytest.raises(ValueError, match="transfer backend is 'mooncake'"):
        pair.a.add_peer("decode-x", msgpack.packb(wrong))
    pair.a.remove_peer(pair.b.agent_name)
    pair.a.remove_peer(pair.b.agent_name)  # no-op
    assert "unknown_peer" in pair.a.poll(pair.a.write(pair.b.agent_name, page_spans([0], [0], P), b"")).reason
    pair.a.add_peer(pair.b.agent_name, md)  # back again
    assert pair.wait(pair.a.write(pair.b.agent_name, page_spans([0], [0], P), b"")).done


def test_closed_backend_fails_writes(pair: Pair):
    pair.a.close()
    assert pair.a.poll(pair.a.write(pair.b.agent_name, page_spans([0], [0], P), b"")).reason == "closed"


# -- fake hooks ---------------------------------------------------------------------------------


@pytest.fixture
def fake_pair() -> Iterator[Pair]:
    tag = uuid.uuid4().hex[:8]
    src, dst = filled_pool(2), KVPool(LAYOUT)
    a, b = FakeBackend(f"p-{tag}", src.buffer, polls_to_complete=3), FakeBackend(f"d-{tag}", dst.buffer)
    a.add_peer(b.agent_name, b.metadata())
    yield Pair("fake", a, b, src, dst)
    a.close()
    b.close()


def test_fake_completes_after_n_polls(fake_pair: Pair):
    a, b = fake_pair.a, fake_pair.b
    h = a.write(b.agent_name, page_spans([1], [2], P), b"n")
    assert a.poll(h).pending and a.poll(h).pending and b.notifications() == []
    assert a.poll(h).done and b.notifications() == [(a.agent_name, b"n")]


def test_fake_stall_fail_and_strike_mid_transfer(fake_pair: Pair):
    a, b = fake_pair.a, fake_pair.b
    assert isinstance(a, FakeBackend)
    a.stall_next()
    stalled = a.write(b.agent_name, page_spans([1], [1], P), b"stalled")
    assert all(a.poll(stalled).pending for _ in range(50))
    a.fail_next("transfer_error")
    h = a.write(b.agent_name, page_spans([2], [2], P), b"doomed")
    assert [str(a.poll(h)) for _ in range(3)][-1] == "FAILED(transfer_error)"
    hit = a.write(b.agent_name, page_spans([3], [3], P), b"hit")
    a.poll(hit)
    a.fail(hit, "peer_lost")  # strike mid-transfer
    assert a.poll(hit).reason == "peer_lost"
    assert b.notifications() == [] and int(fake_pair.dst.buffer.count_nonzero()) == 0
    a.release(stalled)
    assert a.poll(stalled).reason == "released"
    a.land(stalled)  # a late write lands after the writer gave up: what quarantine is for
    assert b.notifications() == [(a.agent_name, b"stalled")]
    assert_pages(fake_pair.dst, fake_pair.src, [1], [1])


def test_fake_peer_closed_and_removed(fake_pair: Pair):
    a, b = fake_pair.a, fake_pair.b
    assert isinstance(a, FakeBackend)
    a.stall_next()
    pending = a.write(b.agent_name, page_spans([1], [1], P), b"")
    a.remove_peer(b.agent_name)
    assert a.poll(pending).reason == "peer_removed"
    a.add_peer(b.agent_name, b.metadata())
    h = a.write(b.agent_name, page_spans([1], [1], P), b"")
    b.close()
    for _ in range(3):
        state = a.poll(h)
    assert state.reason == "peer_lost"


def test_a_fake_that_dies_is_fenced_with_nothing_released():
    """``die`` (a simulated kill -9): closed, so its writes are refused and nothing lands in it;
    unlike ``close`` its handles stay as they were and it stays registered."""
    net = SimpleNamespace(agents={})  # a network's registry; the writes here are stalled, never started
    src, dst = filled_pool(1), KVPool(LAYOUT)
    a, b = FakeBackend("p", src.buffer, network=net), FakeBackend("d", dst.buffer, network=net)
    a.add_peer("d", b.metadata())
    a.stall_next()
    h = a.write("d", page_spans([1], [1], P), b"n")
    a.die()
    assert a.closed and not b.closed and a.poll(h).pending and not h.released and set(net.agents) == {"p", "d"}
    assert a.write("d", page_spans([2], [2], P), b"").state.reason == "closed"
    b.queue_notification("p", b"landed")  # how a network delivers a landed write's notification
    assert b.notifications() == [("p", b"landed")]
    b.die()
    assert a.complete(h).reason == "peer_lost" and int(dst.buffer.count_nonzero()) == 0


# -- tcp specifics ------------------------------------------------------------------------------


def test_tcp_splits_large_spans_into_bounded_frames():
    tag = uuid.uuid4().hex[:8]
    src, dst = filled_pool(3), KVPool(LAYOUT)
    a = TcpBackend(f"p-{tag}", src.buffer, max_frame_bytes=4096)
    b = TcpBackend(f"d-{tag}", dst.buffer, max_frame_bytes=1000, send_hwm=2)
    try:
        a.add_peer(b.agent_name, b.metadata())
        h = a.write(b.agent_name, page_spans(range(0, 20), range(10, 30), P), b"big")
        assert wait_state(a, h).done and wait_notifs(b, 1) == [(a.agent_name, b"big")]
        assert_pages(dst, src, range(0, 20), range(10, 30))
        assert b.stats()["frames"] == -(-20 * P // 1000) and b.stats()["bad_frames"] == 0
    finally:
        a.close()
        b.close()


def test_tcp_receiver_refuses_bad_frames_and_survives():
    tag = uuid.uuid4().hex[:8]
    dst = KVPool(LAYOUT)
    b = TcpBackend(f"d-{tag}", dst.buffer, max_frame_bytes=4096)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(b.endpoint)

    def header(**kw) -> bytes:
        return msgpack.packb({"v": 2, "to": b.agent_name, "frm": "evil", "wid": 1, "off": 0, "n": 1, "last": True, **kw})

    def answer() -> dict:
        assert raw.poll(int(TIMEOUT_S * 1000)), "no answer"
        return msgpack.unpackb(raw.recv())

    try:
        raw.send_multipart([b"\xc1garbage"])  # undecodable, no payload frame
        raw.send_multipart([b"a", b"b", b"c"])
        raw.send_multipart([header(wid=1, off=LAYOUT.num_pages * P - 8), b"x" * 64])  # out of bounds
        assert answer() == {"wid": 1, "ok": False, "reason": answer_reason_bad_span(b)}
        raw.send_multipart([header(wid=2, off=-1), b"x"])
        assert answer()["ok"] is False
        raw.send_multipart([header(wid=3, to="decode-previous-incarnation"), b"x"])
        assert "wrong_peer" in answer()["reason"]
        raw.send_multipart([header(wid=4, off=0, n=3, last=False), b"y" * 8])  # a bad write poisons later frames
        raw.send_multipart([header(wid=4, off=LAYOUT.num_pages * P, n=3, last=False), b"y"])
        raw.send_multipart([header(wid=4, off=16, n=3, notif=b"n4"), b"y" * 8])
        assert answer()["ok"] is False
        raw.send_multipart([b"\x00" * 5000, b"z" * 10])  # over MAXMSGSIZE: zmq drops it (and the link)
        assert b.notifications() == []
        # still serving: a good writer gets through
        src = filled_pool(4)
        a = TcpBackend(f"p-{tag}", src.buffer)
        try:
            a.add_peer(b.agent_name, b.metadata())
            h = a.write(b.agent_name, page_spans([1, 2], [3, 4], P), b"ok")
            assert wait_state(a, h).done and wait_notifs(b, 1) == [(a.agent_name, b"ok")]
            assert torch.equal(dst.page_bytes(3), src.page_bytes(1))
        finally:
            a.close()
        assert b.stats()["bad_frames"] >= 6
        assert int(dst.page_bytes(0)[:8].count_nonzero()) == 8  # wid 4's first frame had landed before it went bad
        assert int(dst.page_bytes(0)[16:24].count_nonzero()) == 0  # its later frames were refused
    finally:
        raw.close(linger=0)
        ctx.term()
        b.close()


def test_tcp_a_write_that_lost_a_frame_is_not_complete():
    """Frames of one write can be lost in the middle (a connection that breaks and reconnects
    loses what was in flight, and the later frames arrive on the new one). The receiver must not
    take the last frame for the whole write: the write fails, and its notification (a ``KVDone``
    would say every byte landed) is never delivered."""
    tag = uuid.uuid4().hex[:8]
    src, dst = filled_pool(6), KVPool(LAYOUT)
    a = TcpBackend(f"p-{tag}", src.buffer, max_frame_bytes=1000)
    b = TcpBackend(f"d-{tag}", dst.buffer, max_frame_bytes=1000)
    try:
        a.add_peer(b.agent_name, b.metadata())
        peer = a._peers[b.agent_name]

        class LosesTheThirdFrame:
            sent = 0

            def __getattr__(self, name):
                return getattr(sock, name)

            def send_multipart(self, frames, **kw):
                self.sent += 1
                if self.sent != 3:
                    return sock.send_multipart(frames, **kw)

        sock = peer.sock
        peer.sock = LosesTheThirdFrame()
        h = a.write(b.agent_name, page_spans(range(0, 10), range(10, 20), P), b"all-landed")  # frames of 1000 B
        state = wait_state(a, h)
        time.sleep(0.2)
        assert b.notifications() == [], "the notification of an incomplete write was delivered"
        assert state.failed, state
        peer.sock = sock
    finally:
        a.close()
        b.close()


def test_tcp_a_write_whose_last_frame_was_lost_fails_when_a_later_write_is_answered():
    """A connection that breaks can take a write's last frame (or its answer) with it; the
    receiver then never answers that write. Answers come in the order the last frames went out,
    so once a later write is answered the earlier one fails, at once and as ``may_land`` (its
    session ends, decode fences), instead of waiting for the transfer deadline. The break is
    real: a frame over the receiver's ``MAXMSGSIZE`` (its metadata claimed more) makes ZMQ drop
    the connection. Small writes follow until one lands (those sent into the broken connection
    fail the same way)."""
    from splitserve.disagg.transfer.base import decode_metadata, encode_metadata

    tag = uuid.uuid4().hex[:8]
    src, dst = filled_pool(7), KVPool(LAYOUT)
    a = TcpBackend(f"p-{tag}", src.buffer, max_frame_bytes=16 * P)
    b = TcpBackend(f"d-{tag}", dst.buffer, max_frame_bytes=2 * P, max_notif_bytes=0)  # takes frames <= 4096 B
    try:
        md = decode_metadata(b.metadata(), "tcp", b.agent_name)
        extra = {k: v for k, v in md.items() if k not in ("version", "backend", "agent", "nbytes")}
        a.add_peer(b.agent_name, encode_metadata("tcp", b.agent_name, md["nbytes"], **{**extra, "max_frame": 16 * P}))
        lost = a.write(b.agent_name, page_spans(range(0, 10), range(0, 10), P), b"")  # one 5,120 B frame: dropped
        later, deadline = [], time.monotonic() + 60  # a bound on a hang only: what is checked is the order
        while not any(a.poll(h).done for h in later) and time.monotonic() < deadline:
            later.append(a.write(b.agent_name, page_spans([20], [20], P), b""))
            time.sleep(0.02)
        assert any(a.poll(h).done for h in later), [a.poll(h) for h in later]
        state = a.poll(lost)
        assert state.failed and state.may_land and "answer_lost" in state.reason, (state, [a.poll(h) for h in later],
                                                                                  b.stats())
        first_done = next(i for i, h in enumerate(later) if a.poll(h).done)
        assert all(a.poll(h).failed and a.poll(h).may_land for h in later[:first_done])  # lost in the break too
    finally:
        a.close()
        b.close()


def answer_reason_bad_span(b: TcpBackend) -> str:
    return f"bad_span: 64 B at offset {LAYOUT.num_pages * P - 8} outside the {b.nbytes} B buffer"


def test_tcp_receiver_refusal_reaches_the_writer():
    """A writer whose view of the peer is wrong (here: forged metadata claiming a bigger pool)
    gets FAILED from the receiver's own bounds check, not a write out of bounds."""
    tag = uuid.uuid4().hex[:8]
    src, dst = filled_pool(5), KVPool(LAYOUT)
    a, b = TcpBackend(f"p-{tag}", src.buffer), TcpBackend(f"d-{tag}", dst.buffer)
    try:
        md = msgpack.unpackb(b.metadata())
        md["nbytes"] *= 2
        a.add_peer(b.agent_name, msgpack.packb(md))
        h = a.write(b.agent_name, [Span(0, b.nbytes, P)], b"nope")
        state = wait_state(a, h)
        assert state.failed and "refused_by_peer: bad_span" in state.reason
        assert b.notifications() == [] and b.stats()["bad_frames"] == 1
    finally:
        a.close()
        b.close()


def test_tcp_receiving_link_takes_writes_only_into_the_pages_it_was_given():
    """A link built with ``writable_page_nbytes`` (decode's) lands a write only where every page it
    touches is allowed now: nothing before ``allow_pages``, the allowed pages after, nothing once
    revoked; a page two keys allow stays open until both revoke it. A refused write lands no byte
    and fails naming ``not_writable``; its notification is never delivered."""
    tag = uuid.uuid4().hex[:8]
    src, dst = filled_pool(7), KVPool(LAYOUT)
    a, b = TcpBackend(f"p-{tag}", src.buffer), TcpBackend(f"d-{tag}", dst.buffer, writable_page_nbytes=P)
    try:
        a.add_peer(b.agent_name, b.metadata())

        def write(local, remote, notif=b""):
            return wait_state(a, a.write(b.agent_name, page_spans(local, remote, P), notif))

        refused = write([0, 1], [2, 3], b"early")
        assert refused.failed and "not_writable" in refused.reason, refused
        b.allow_pages("room-1", [2, 3, 4])
        b.allow_pages("room-2", [4, 5])
        assert write([0, 1, 2], [2, 3, 4], b"ok").done
        assert wait_notifs(b, 1) == [(a.agent_name, b"ok")]
        straddles = write([3, 4], [5, 6])  # page 6 was never given
        assert straddles.failed and "not_writable" in straddles.reason
        b.revoke_pages("room-1")
        assert write([5], [2]).failed  # room-1's own page: closed
        assert write([5], [4]).done  # shared with room-2: still open
        b.revoke_pages("room-2", [4])
        assert write([6], [4]).failed and write([6], [5]).done  # a page revoked by name; the other stays
        assert_pages(dst, src, [0, 1, 5, 6], [2, 3, 4, 5])  # the last write to land on each; no other byte
        assert b.notifications() == [] and b.stats()["bad_frames"] == 4
    finally:
        a.close()
        b.close()


# -- nixl specifics -----------------------------------------------------------------------------


def test_nixl_errors_become_failed_not_exceptions(monkeypatch):
    nixl = pytest.importorskip("splitserve.disagg.transfer.nixl", reason="nixl is not importable", exc_type=ImportError)
    tag = uuid.uuid4().hex[:8]
    src, dst = filled_pool(6), KVPool(LAYOUT)
    a, b = nixl.NixlBackend(f"p-{tag}", src.buffer), nixl.NixlBackend(f"d-{tag}", dst.buffer)
    try:
        a.add_peer(b.agent_name, b.metadata())
        agent = a._agent

        def boom(*args, **kw):
            raise nixl._api.nixlBind.nixlBackendError("NIXL_ERR_BACKEND")

        monkeypatch.setattr(agent, "check_xfer_state", boom)
        h = a.write(b.agent_name, page_spans([1], [1], P), b"x")
        assert a.poll(h) == failed("transfer_error: nixlBackendError: NIXL_ERR_BACKEND")
        monkeypatch.setattr(agent, "check_xfer_state", lambda xfer: "ERR")
        h2 = a.write(b.agent_name, page_spans([2], [2], P), b"y")
        assert "NIXL reported ERR" in a.poll(h2).reason
        monkeypatch.setattr(agent, "transfer", boom)
        assert "nixlBackendError" in a.poll(a.write(b.agent_name, page_spans([3], [3], P), b"z")).reason
        monkeypatch.undo()
        a.release(h)
        a.release(h2)
        wait_notifs(b, 2, timeout=0.5)  # let what did get posted land before closing
    finally:
        a.close()
        b.close()


# -- between two real processes -----------------------------------------------------------------


def _receiver_process(kind: str, name: str, conn) -> None:
    """Child: register a zeroed pool, send metadata, wait for one notification, check the bytes."""
    pool = KVPool(LAYOUT)
    backend = get_backend(kind)(name, pool.buffer)
    conn.send(backend.metadata())
    local, remote, notif_expected = conn.recv()
    got = wait_notifs(backend, 1, timeout=20)
    src = filled_pool(11)
    ok = all(torch.equal(pool.page_bytes(rp), src.page_bytes(lp)) for lp, rp in zip(local, remote))
    untouched = all(int(pool.page_bytes(p).count_nonzero()) == 0 for p in set(range(LAYOUT.num_pages)) - set(remote))
    conn.send({"notifs": got, "bytes_ok": ok, "untouched_ok": untouched})
    conn.recv()  # keep our memory registered until the writer is done
    backend.close()


@pytest.mark.parametrize("kind", ["tcp", "nixl"])
def test_two_processes(kind: str):
    if kind == "nixl":
        pytest.importorskip("splitserve.disagg.transfer.nixl", reason="nixl is not importable", exc_type=ImportError)
    tag = uuid.uuid4().hex[:8]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_process, args=(kind, f"decode-{tag}", child), daemon=True)
    proc.start()
    src = filled_pool(11)
    a = get_backend(kind)(f"prefill-{tag}", src.buffer)
    try:
        assert parent.poll(30), "child sent no metadata"
        a.add_peer(f"decode-{tag}", parent.recv())
        local, remote = [0, 1, 2, 7, 8, 20], [30, 31, 4, 5, 6, 12]
        parent.send((local, remote, b"room=1"))
        h = a.write(f"decode-{tag}", page_spans(local, remote, P), b"room=1")
        assert wait_state(a, h).done
        assert parent.poll(30), "child sent no report"
        report = parent.recv()
        parent.send("bye")
        assert report == {"notifs": [(a.agent_name, b"room=1")], "bytes_ok": True, "untouched_ok": True}
        proc.join(10)
        assert proc.exitcode == 0
        # the peer is gone: NIXL (UCX error handling) fails the write; tcp cannot tell, so the
        # write stays PENDING until the caller's transfer deadline releases it
        h = a.write(f"decode-{tag}", page_spans([0], [0], P), b"late")
        if kind == "nixl":
            assert wait_state(a, h).failed
        else:
            time.sleep(0.1)
            assert a.poll(h).pending
            a.release(h)
            assert a.poll(h).reason == "released"
    finally:
        a.close()
        if proc.is_alive():
            proc.kill()



@contextlib.contextmanager
def transfer_thread(writer_cls=FakeBackend, seed: int = 5):
    """A running TransferWorker over a fake writer (``writer_cls``) and a fake receiving pool:
    yields (worker, the events it posts, writer, receiver, source pool, destination pool)."""
    from splitserve.disagg.transfer.thread import TransferWorker

    tag = uuid.uuid4().hex[:8]
    src, dst = filled_pool(seed), KVPool(LAYOUT)
    events: "queue.Queue[object]" = queue.Queue()
    writer, receiver = writer_cls(f"w-{tag}", src.buffer), FakeBackend(f"r-{tag}", dst.buffer)
    worker = TransferWorker(writer, events.put)
    try:
        yield worker, events, writer, receiver, src, dst
    finally:
        worker.stop()
        writer.close()
        receiver.close()


def test_transfer_thread_declares_a_session_lost_when_its_link_cannot_be_loaded():
    """A decode session whose link metadata we cannot use (here: not even decodable) is useless:
    the transfer thread posts PeerLost for it, stays alive, and a good link still connects."""
    from splitserve.disagg.lifecycle import Peer, PeerLost, WriteDone
    from splitserve.disagg.transfer.thread import AddPeer, Write

    with transfer_thread() as (worker, events, _, receiver, src, dst):
        worker.start()
        bad, good = Peer("decode:1", "d1", 1), Peer("decode:1", "d1", 2)
        worker.submit(AddPeer(bad, receiver.agent_name, b"\xc1 not metadata"))
        lost = events.get(timeout=TIMEOUT_S)
        assert isinstance(lost, PeerLost) and lost.peer == bad and "cannot be reached" in lost.detail
        worker.submit(AddPeer(good, receiver.agent_name, receiver.metadata()))
        worker.submit(Write(7, 1, good, tuple(page_spans([0], [3], P))))
        assert events.get(timeout=TIMEOUT_S) == WriteDone(7, 1)
        assert_pages(dst, src, [0], [3])


def test_transfer_thread_crash_ends_the_sessions_of_writes_in_flight_before_reporting_them():
    """Rule 8 without breaking rule 6: a crash reports every write in flight failed, but their bytes
    may still land, so their session is declared lost first (prefill then never says WritesSettled;
    decode fences the session) and the thread goes on."""
    from splitserve.disagg.lifecycle import Peer, PeerLost, WriteFailed
    from splitserve.disagg.transfer.thread import AddPeer, Write

    class Crashing(FakeBackend):
        crash = True

        def poll(self, handle):
            if self.crash:
                self.crash = False
                raise RuntimeError("boom")
            return super().poll(handle)

    with transfer_thread(Crashing, seed=6) as (worker, events, writer, receiver, _, _):
        writer.stall_next()
        worker.start()
        peer = Peer("decode:1", "d1", 1)
        worker.submit(AddPeer(peer, receiver.agent_name, receiver.metadata()))
        worker.submit(Write(7, 1, peer, tuple(page_spans([0], [3], P))))
        first, second = events.get(timeout=TIMEOUT_S), events.get(timeout=TIMEOUT_S)
        assert isinstance(first, PeerLost) and first.peer == peer and "boom" in first.detail
        assert isinstance(second, WriteFailed) and second.write_id == 1
        worker.submit(Write(8, 2, peer, tuple(page_spans([1], [4], P))))  # still serving
        assert events.get(timeout=TIMEOUT_S).write_id == 2


def test_a_write_call_that_raises_is_reported_failed_after_its_session_ends():
    """The sibling of a crash with writes in flight, found by the simulator (seed 4 of
    ``python -m splitserve.sim --requests 100``): a backend ``write`` that raises left the write
    in no table (not yet in flight, so the crash settled nothing) and its prefill room held its
    pages for good. It is reported failed, after its session is declared lost (some of its bytes
    may have gone out), and the thread goes on."""
    from splitserve.disagg.lifecycle import Peer, PeerLost, WriteFailed
    from splitserve.disagg.transfer.thread import AddPeer, Write

    class RaisingWrite(FakeBackend):
        crash = True

        def write(self, peer_name, spans, notif):
            if self.crash and spans:
                self.crash = False
                raise RuntimeError("boom")
            return super().write(peer_name, spans, notif)

    with transfer_thread(RaisingWrite, seed=8) as (worker, events, writer, receiver, _, _):
        worker.start()
        peer = Peer("decode:1", "d1", 1)
        worker.submit(AddPeer(peer, receiver.agent_name, receiver.metadata()))
        worker.submit(Write(7, 1, peer, tuple(page_spans([0], [3], P))))
        first, second = events.get(timeout=TIMEOUT_S), events.get(timeout=TIMEOUT_S)
        assert isinstance(first, PeerLost) and first.peer == peer and "boom" in first.detail, first
        assert isinstance(second, WriteFailed) and second.write_id == 1 and "boom" in second.error, second
        worker.submit(Write(8, 2, peer, tuple(page_spans([1], [4], P))))  # still serving
        assert events.get(timeout=TIMEOUT_S).write_id == 2


def test_a_write_that_failed_in_flight_ends_its_session_before_it_is_reported():
    """A write that polls FAILED after it reached the network (a NIXL error after posting, a tcp
    connection that broke) may still land: its session is declared lost before the write is
    reported failed, so prefill never vouches for it (decode fences the session). A write refused
    before it was posted is only reported failed."""
    from splitserve.disagg.lifecycle import Peer, PeerLost, WriteFailed
    from splitserve.disagg.transfer.thread import AddPeer, Write

    class CutInFlight(FakeBackend):
        def write(self, peer_name, spans, notif):
            h = super().write(peer_name, spans, notif)
            if h.state.pending and spans:
                self.fail(h, "transfer_error: NIXL_ERR_REMOTE_DISCONNECT")
            return h

    with transfer_thread(CutInFlight, seed=7) as (worker, events, writer, receiver, _, _):
        worker.start()
        peer = Peer("decode:1", "d1", 1)
        worker.submit(AddPeer(peer, receiver.agent_name, receiver.metadata()))
        worker.submit(Write(7, 1, peer, tuple(page_spans([0], [3], P))))
        first, second = events.get(timeout=TIMEOUT_S), events.get(timeout=TIMEOUT_S)
        assert isinstance(first, PeerLost) and first.peer == peer and "may still land" in first.detail, first
        assert isinstance(second, WriteFailed) and second.write_id == 1, second
        worker.submit(Write(8, 2, peer, tuple(page_spans([0], [LAYOUT.num_pages], P))))  # out of bounds: refused
        refused_write = events.get(timeout=TIMEOUT_S)
        assert isinstance(refused_write, WriteFailed) and "bad_span" in refused_write.error, refused_write
        assert events.empty()


def test_an_idle_transfer_thread_sleeps_and_polls_fast_only_while_a_rooms_kv_is_due():
    """On the per-token path of every request decoded alone the transfer thread has nothing to
    do: it sleeps (``IDLE_POLL_S``) instead of polling every ``BUSY_POLL_S``, which took the GIL
    from the engine thread hundreds of times a second. A room whose pages open to a writer
    makes it due (``wake()`` brings it out of its sleep), and it polls fast until they close."""
    from splitserve.disagg.lifecycle import Peer
    from splitserve.disagg.transfer.links import ReceiveLinks
    from splitserve.disagg.transfer.thread import IDLE_POLL_S, TransferWorker

    class Counting(TransferWorker):
        steps = 0

        def step(self) -> bool:
            self.steps += 1
            return super().step()

    links = ReceiveLinks("fake", f"d-{uuid.uuid4().hex[:8]}", KVPool(LAYOUT).buffer)
    worker = Counting(None, queue.Queue().put, links=links)
    writer = Peer("prefill:1", "p1", 1)
    links.open(writer)
    try:
        worker.start()
        assert not worker.due()
        time.sleep(1.0)
        idle = worker.steps  # a busy machine makes it fewer, never more
        assert idle <= 2 * (1.0 / IDLE_POLL_S) + 2, f"{idle} polls in 1 s with nothing due"
        links.allow(writer, 7, [0, 1])
        worker.wake()
        assert worker.due()
        links.revoke(7)
        assert not worker.due()
    finally:
        worker.stop()
        links.close_all()
