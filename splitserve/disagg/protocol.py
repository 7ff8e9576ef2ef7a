"""The control protocol between prefill and decode workers: typed messages, one codec.

Every control message is a frozen dataclass registered under a short type tag. On the wire a
message is one msgpack map ``{"v": PROTOCOL_VERSION, "t": tag, "f": {field: value}}``. Decoding
is strict, because control-plane input is untrusted: a frame that is too large, not msgpack, of
another protocol version, of an unknown type, missing a field, carrying an unknown field, or with a
field of the wrong type — an integer outside 64 bits, a string over 1 KiB — raises
:class:`ProtocolError` (the listener logs and counts it, and goes on). Nothing is dispatched by
method-name strings: the receiver matches on the class.

The flows: decode → prefill ``GetInfo``, ``RegisterPeer``, ``RegisterRoom``, ``AbortRoom``;
prefill → decode ``Info``, ``PeerRegistered``, ``RoomFailed``, ``WritesSettled`` and ``KVDone``
(carried as the transfer notification of a room's last write); both ways ``Heartbeat`` /
``HeartbeatAck`` and ``Goodbye``. What each means and when it is sent: ``docs/protocol.md``.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import ClassVar

import msgpack

PROTOCOL_VERSION = 5
"""2: decode's control identity names its session; 3: registrations name a cached prefix; 4: the
cluster secret's CURVE keys are derived by HKDF (``control/curve.py``); 5: ``KVDone`` carries the
first token's logprobs. (``Goodbye`` came within 5: a peer that does not know it drops and counts
it, and learns of the end by silence, as before.)"""
MAX_FRAME_BYTES = 1 << 20  # 1 MiB: a page list of 64k pages, or NIXL metadata, fits with room to spare

_REGISTRY: dict[str, type] = {}


class ProtocolError(ValueError):
    """A frame that is not a valid control message; the message says what is wrong."""


def message(tag: str):
    """Class decorator: register a frozen dataclass as a control message under ``tag``."""

    def wrap(cls):
        cls = dataclass(frozen=True)(cls)
        cls.TAG = tag
        if tag in _REGISTRY:
            raise RuntimeError(f"duplicate message tag {tag!r}")
        _REGISTRY[tag] = cls
        return cls

    return wrap


_FIELDS: dict[type, dict[str, object]] = {}  # message class -> {field: type hint}, filled on first use


def _fields_of(cls) -> dict[str, object]:
    hints = _FIELDS.get(cls)
    if hints is None:
        all_hints = typing.get_type_hints(cls)
        hints = _FIELDS[cls] = {f.name: all_hints[f.name] for f in dataclasses.fields(cls)}
    return hints


@message("get_info")
class GetInfo:
    TAG: ClassVar[str]
    sender: str  # the asking worker's incarnation id


@message("info")
class Info:
    """The prefill worker's bootstrap info; decode checks it before sending anything."""

    TAG: ClassVar[str]
    protocol_version: int
    incarnation: str
    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    backend: str


@message("register_peer")
class RegisterPeer:
    TAG: ClassVar[str]
    incarnation: str  # the decode worker's
    prefill_incarnation: str  # which prefill incarnation this is meant for
    agent_name: str
    agent_metadata: bytes


@message("peer_registered")
class PeerRegistered:
    """Prefill's answer to ``RegisterPeer``: it holds that link now (decode re-sends until then)."""

    TAG: ClassVar[str]
    incarnation: str  # the prefill worker's
    agent_name: str


@message("register_room")
class RegisterRoom:
    """The pages decode reserved for the prompt's KV, after the ``cached_tokens`` (a whole number
    of pages) it holds already in its own prefix cache: prefill writes only the rest."""

    TAG: ClassVar[str]
    room: int
    incarnation: str  # the decode worker's
    prefill_incarnation: str
    rid: str
    prompt_len: int
    pages: list[int]
    cached_tokens: int


@message("abort_room")
class AbortRoom:
    TAG: ClassVar[str]
    room: int
    incarnation: str  # the sender's
    reason: str


@message("room_failed")
class RoomFailed:
    TAG: ClassVar[str]
    room: int
    incarnation: str  # the sender's
    reason: str


@message("writes_settled")
class WritesSettled:
    """Prefill to decode: no write for this room can still land; quarantined pages may be freed."""

    TAG: ClassVar[str]
    room: int
    incarnation: str


@message("kv_done")
class KVDone:
    """The notification of a room's last write: every byte of its KV has landed."""

    TAG: ClassVar[str]
    room: int
    incarnation: str  # the prefill worker's
    first_token: int
    num_tokens: int  # tokens whose KV was written (the prompt length)
    first_logprobs: bytes = b""
    """The first token's logprobs when the request asks for them (``engine/io.TokenLogprob.to_bytes``:
    a float32 and up to 20 (id, float32) pairs, 164 bytes at most); empty otherwise."""


@message("heartbeat")
class Heartbeat:
    TAG: ClassVar[str]
    incarnation: str
    seq: int


@message("heartbeat_ack")
class HeartbeatAck:
    TAG: ClassVar[str]
    incarnation: str
    seq: int


@message("goodbye")
class Goodbye:
    """The sender's incarnation has ended (it switches its role, or shuts down): every session with
    it is over now, and its peers need not wait for its silence to know it."""

    TAG: ClassVar[str]
    incarnation: str  # the sender's
    reason: str


def encode(msg) -> bytes:
    cls = type(msg)
    if getattr(cls, "TAG", None) not in _REGISTRY:
        raise TypeError(f"{cls.__name__} is not a control message")
    fields = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": cls.TAG, "f": fields}, use_bin_type=True)


def decode(frame: bytes):
    """Parse and validate one frame; raises ProtocolError on anything unexpected."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame is {type(frame).__name__}, not bytes")
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    try:
        obj = msgpack.unpackb(bytes(frame), raw=False, strict_map_key=True, max_bin_len=MAX_FRAME_BYTES,
                              max_str_len=MAX_FRAME_BYTES, max_array_len=MAX_FRAME_BYTES,
                              max_map_len=1024)
    except Exception as exc:
        raise ProtocolError(f"not a msgpack frame: {exc}") from None
    if not isinstance(obj, dict) or set(obj) != {"v", "t", "f"}:
        raise ProtocolError("frame is not a {v, t, f} map")
    if obj["v"] != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {obj['v']!r}, expected {PROTOCOL_VERSION}")
    cls = _REGISTRY.get(obj["t"]) if isinstance(obj["t"], str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {obj['t']!r}")
    fields = obj["f"]
    if not isinstance(fields, dict):
        raise ProtocolError(f"{cls.TAG}: fields are not a map")
    hints = _fields_of(cls)
    if fields.keys() != hints.keys():
        missing, extra = hints.keys() - fields.keys(), fields.keys() - hints.keys()
        raise ProtocolError(f"{cls.TAG}: missing fields {sorted(missing)}, unknown fields {sorted(map(str, extra))}")
    for name, value in fields.items():
        _check_type(cls.TAG, name, value, hints[name])
    return cls(**fields)


MAX_INT = 2**63 - 1  # every integer field (rooms, tokens, lengths, page ids) fits a signed 64-bit int
MAX_STR = 1024  # names, incarnations, reasons, request ids: short strings; longer is not ours


def _check_type(tag: str, name: str, value, hint) -> None:
    if hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and -MAX_INT <= value <= MAX_INT
    elif typing.get_origin(hint) is list:  # list[int]: page ids
        ok = isinstance(value, list) and all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_INT for v in value)
    elif hint is str:
        ok = isinstance(value, str) and len(value) <= MAX_STR
    else:
        ok = isinstance(value, hint)
    if not ok:
        shown = type(value).__name__ if not isinstance(value, (int, str)) else f"{type(value).__name__} out of range"
        raise ProtocolError(f"{tag}.{name}: expected {getattr(hint, '__name__', hint)}, got {shown}")
