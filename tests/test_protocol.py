"""The control-message codec: every message round-trips; any other frame is a ProtocolError,
never another exception (property-based fuzzing of the decoder)."""

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from splitserve.disagg import protocol as p

SAMPLES = [
    p.GetInfo(sender="d-1"),
    p.Info(protocol_version=1, incarnation="p-1", model="tiny", num_layers=4, num_kv_heads=2, head_dim=32,
           dtype="float32", page_size=16, backend="nixl"),
    p.RegisterPeer(incarnation="d-1", prefill_incarnation="p-1", agent_name="d-1", agent_metadata=b"\x00\x01"),
    p.RegisterRoom(room=(1 << 63) - 1, incarnation="d-1", prefill_incarnation="p-1", rid="r", prompt_len=9,
                   pages=[3, 4, 9], cached_tokens=16),
    p.AbortRoom(room=7, incarnation="d-1", reason="client"),
    p.RoomFailed(room=7, incarnation="p-1", reason="transfer_error"),
    p.WritesSettled(room=7, incarnation="p-1"),
    p.KVDone(room=7, incarnation="p-1", first_token=42, num_tokens=100),
    p.Heartbeat(incarnation="p-1", seq=3),
    p.HeartbeatAck(incarnation="d-1", seq=3),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.TAG)
def test_every_message_round_trips(msg):
    assert p.decode(p.encode(msg)) == msg


def frame(t, f, v=p.PROTOCOL_VERSION):
    return msgpack.packb({"v": v, "t": t, "f": f}, use_bin_type=True)


@pytest.mark.parametrize("bad, words", [
    (frame("heartbeat", {"incarnation": "x", "seq": 1}, v=99), "version"),
    (frame("no_such", {}), "unknown message type"),
    (frame("heartbeat", {"incarnation": "x"}), "missing fields ['seq']"),
    (frame("heartbeat", {"incarnation": "x", "seq": 1, "evil": 1}), "unknown fields ['evil']"),
    (frame("heartbeat", {"incarnation": "x", "seq": True}), "heartbeat.seq"),
    (frame("register_room", {"room": 1, "incarnation": "d", "prefill_incarnation": "p", "rid": "r",
                             "prompt_len": 1, "pages": [1, -2], "cached_tokens": 0}), "register_room.pages"),
    (b"\x00" * (p.MAX_FRAME_BYTES + 1), "exceeds"),
    (b"\xc1", "not a msgpack frame"),
    (msgpack.packb([1, 2, 3]), "not a {v, t, f} map"),
])
def test_bad_frames_are_refused_with_a_clear_reason(bad, words):
    with pytest.raises(p.ProtocolError, match=None) as err:
        p.decode(bad)
    assert words in str(err.value)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_raise_anything_but_protocol_error(data):
    try:
        msg = p.decode(data)
    except p.ProtocolError as exc:
        assert str(exc)  # refused, with a reason
        return
    assert p.decode(p.encode(msg)) == msg  # whatever passes is a well-formed message


values = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats(allow_nan=False) | st.text(max_size=8)
                      | st.binary(max_size=8), lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                      max_leaves=10)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([m.TAG for m in SAMPLES] + ["x"]), st.dictionaries(st.text(max_size=12), values, max_size=7))
def test_structured_garbage_never_raises_anything_but_protocol_error(tag, fields):
    try:
        msg = p.decode(frame(tag, fields))
    except p.ProtocolError:
        return
    assert p.decode(p.encode(msg)) == msg  # whatever passes is a well-formed message
