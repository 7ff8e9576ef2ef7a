"""The control plane's threads (``splitserve/disagg/control.py``) against a raw ZMQ socket playing
the other side: who a sender is (incarnation and session in its identity); heartbeats withheld
while the engine loop is wedged, so that the peer declares us lost instead of waiting forever;
link registrations answered and re-sent until answered, rooms held back until their link is
there; a forgotten session making way for the next one."""

from __future__ import annotations

import contextlib
import time

import zmq

from conftest import free_port
from splitserve.disagg import protocol as p
from splitserve.disagg.control import PrefillControl, identity, peer_of
from splitserve.disagg.lifecycle import FromPeer, Peer, PeerHeard
from splitserve.disagg.transfer_worker import AddPeer

INFO = p.Info(p.PROTOCOL_VERSION, "pf1", "tiny", 2, 2, 8, "float32", 16, "tcp")


def test_identity_names_incarnation_and_session_and_bad_ones_are_refused():
    peer = Peer("10.0.0.2:8100", "d1", 3)
    assert peer_of(identity(peer)) == peer
    for bad in (b"", b"x", b"host#inc", b"#inc#1", b"host##1", b"host#inc#", b"host#inc#one", b"host#inc#-1"):
        assert peer_of(bad) is None, bad


class _Transfer:
    def __init__(self):
        self.commands = []

    def submit(self, cmd):
        self.commands.append(cmd)


ME = Peer("decode:1", "d1", 1)


@contextlib.contextmanager
def prefill_control(**options):
    """A running PrefillControl, and a DEALER socket speaking for decode session ``ME``:
    yields (control, decode socket, events posted to the engine, transfer commands)."""
    events, transfer = [], _Transfer()
    port = free_port()
    control = PrefillControl("127.0.0.1", port, INFO, transfer, events.append, **options)
    control.start()
    ctx = zmq.Context()
    decode = ctx.socket(zmq.DEALER)
    decode.setsockopt(zmq.LINGER, 0)
    decode.setsockopt(zmq.IDENTITY, identity(ME))
    decode.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield control, decode, events, transfer
    finally:
        decode.close(0)
        ctx.term()
        control.close()


def _recv_all(sock: zmq.Socket, seconds: float) -> list:
    got, until = [], time.monotonic() + seconds
    while time.monotonic() < until:
        if sock.poll(20):
            got.append(p.decode(sock.recv()))
    return got


def test_prefill_withholds_heartbeats_while_its_engine_loop_is_wedged():
    alive = [True]
    with prefill_control(heartbeat_s=0.05, loop_alive=lambda: alive[0]) as (control, decode, events, transfer):
        decode.send(p.encode(p.RegisterPeer("d1", "pf1", "decode-link1", b"md")))
        decode.send(p.encode(p.Heartbeat("d1", 1)))
        got = _recv_all(decode, 0.5)
        assert p.HeartbeatAck("pf1", 1) in got, got
        assert any(isinstance(m, p.Heartbeat) for m in got), got  # it pings a registered decode
        assert [c for c in transfer.commands if isinstance(c, AddPeer)] == [AddPeer(ME, "decode-link1", b"md")]
        assert PeerHeard(ME, fresh=True) in events

        alive[0] = False  # the engine loop wedges
        _recv_all(decode, 0.1)  # what was already on its way
        decode.send(p.encode(p.Heartbeat("d1", 2)))
        silent = _recv_all(decode, 0.5)
        assert silent == [], f"a wedged worker still said it is alive: {silent}"

        alive[0] = True
        decode.send(p.encode(p.Heartbeat("d1", 3)))
        got = _recv_all(decode, 0.5)
        assert p.HeartbeatAck("pf1", 3) in got and any(isinstance(m, p.Heartbeat) for m in got), got

        # a message whose incarnation is not its sender's is dropped, not posted
        before = control.bad_frames
        decode.send(p.encode(p.AbortRoom(7, "d0", "client_abort")))
        decode.send(p.encode(p.AbortRoom(8, "d1", "client_abort")))
        deadline = time.monotonic() + 2
        while not any(isinstance(e, FromPeer) for e in events) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [e.msg.room for e in events if isinstance(e, FromPeer)] == [8]
        assert all(e.peer == ME for e in events if isinstance(e, FromPeer))
        assert control.bad_frames == before + 1


def test_prefill_answers_link_registrations_and_holds_back_rooms_that_come_before_their_link():
    early = p.RegisterRoom(5, "d1", "pf1", "r5", 8, [1, 2])
    with prefill_control(heartbeat_s=10) as (control, decode, events, transfer):
        decode.send(p.encode(early))  # before the link: dropped, decode sends it again
        time.sleep(0.3)
        assert not [e for e in events if isinstance(e, FromPeer)] and control.early_registrations == 1
        for _ in range(2):  # a re-sent registration is answered again, registered once
            decode.send(p.encode(p.RegisterPeer("d1", "pf1", "decode-link1", b"md")))
        got = _recv_all(decode, 0.5)
        assert got == [p.PeerRegistered("pf1", "decode-link1")] * 2, got
        assert len([c for c in transfer.commands if isinstance(c, AddPeer)]) == 1
        decode.send(p.encode(early))
        deadline = time.monotonic() + 2
        while not [e for e in events if isinstance(e, FromPeer)] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [e.msg for e in events if isinstance(e, FromPeer)] == [early]


def test_decode_resends_its_link_until_answered_and_a_forgotten_session_makes_way_for_the_next():
    import torch

    from splitserve.disagg.control import DecodeControl
    from splitserve.disagg.lifecycle import PeerInfo
    from splitserve.disagg.transfer.links import ReceiveLinks

    ctx = zmq.Context()
    prefill = ctx.socket(zmq.ROUTER)
    prefill.setsockopt(zmq.LINGER, 0)
    port = prefill.bind_to_random_port("tcp://127.0.0.1")
    links = ReceiveLinks("fake", f"decode-test-{port}", torch.zeros(1024, dtype=torch.uint8))
    events = []
    ours = p.Info(p.PROTOCOL_VERSION, "d1", "tiny", 2, 2, 8, "float32", 16, "tcp")
    control = DecodeControl("decode:1", ours, links, events.append, heartbeat_s=10, info_wait_s=30)
    control.start()

    def receive(seconds: float):
        got, until = [], time.monotonic() + seconds
        while time.monotonic() < until:
            if prefill.poll(20):
                ident, frame = prefill.recv_multipart()
                got.append((peer_of(ident), p.decode(frame)))
        return got

    try:
        control.want_info(7, "127.0.0.1", port)
        [(sender, ask)] = receive(0.5)
        assert isinstance(ask, p.GetInfo) and sender.session == 1
        prefill.send_multipart([identity(sender), p.encode(INFO)])
        first = [m for _, m in receive(0.5)]
        assert [type(m) for m in first] == [p.RegisterPeer], first
        again = [m for _, m in receive(1.6) if isinstance(m, p.RegisterPeer)]
        assert again and set(again) == set(first), again  # sent again (every second) while unanswered
        prefill.send_multipart([identity(sender), p.encode(p.PeerRegistered("pf1", first[0].agent_name))])
        time.sleep(0.2)
        assert not [m for _, m in receive(1.6) if isinstance(m, p.RegisterPeer)]  # answered: no more
        peer = Peer(f"127.0.0.1:{port}", "pf1", 1)
        assert PeerInfo(7, peer, None) in events and links.writers() == [peer]

        control.forget(peer)  # the engine declared this session lost (and closed its link)
        deadline = time.monotonic() + 2
        while links.writers() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert links.writers() == []
        control.want_info(8, "127.0.0.1", port)
        [(sender2, ask2)] = receive(0.5)
        assert isinstance(ask2, p.GetInfo) and sender2 == Peer("decode:1", "d1", 2)
    finally:
        control.close()
        links.close_all()
        prefill.close(0)
        ctx.term()
