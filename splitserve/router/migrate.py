"""Continuing a request whose decode worker was lost: what the router learns from decode's stream
to do it, and the continuation leg's body (the wire: ``docs/router.md``, a decode lost mid-stream).

A streamed decode leg is asked for its token ids (``"stream_ids": true``); decode then writes,
before each event that carries tokens of choice ``i``, an SSE comment ``: ids <i> <id> <id> ...``.
:class:`StreamTrack` follows decode's bytes, cut at any point, and gives back the bytes the client
is to get: every comment line dropped (and the blank line that ends a block of comments only),
nothing re-serialised. It keeps the ids streamed per choice, the response's ``id`` and
``created`` (from the first data event, parsed once), which choices finished, and holds back an
error event and ``[DONE]`` (with whatever follows) until the router has decided whether the
stream goes on elsewhere (:attr:`StreamTrack.held`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from splitserve.discovery.record import loads_shallow

REASONS = ("broken", "stalled", "worker_error", "unhealthy")
"""Why a decode leg was given up and its request continued elsewhere: its connection broke or its
stream ended without ``[DONE]``; it said nothing for ``--stream-stall-s``; it ended the stream
with an error whose code says the worker failed, not the request; (a whole answer) the worker
left rotation while the router waited for it."""
LOST_WORDS = {"broken": "the decode worker broke off the answer",
              "stalled": "the decode worker went silent mid-answer (longer than the router's stream_stall_s)",
              "worker_error": "the decode worker failed mid-answer",
              "unhealthy": "the decode worker became unavailable before the answer was complete"}
"""What a client reads when a lost decode is not continued, by reason: words, never the worker's
address or an exception's text (those are :attr:`Lost.detail`, for the log)."""
WORKER_FAILED_CODES = frozenset({"not_ready", "draining", "loop_stalled", "peer_lost", "peer_failed",
                                 "internal_error"})
"""Error codes in decode's stream that say the worker (or its pair) failed, not the request:
continued elsewhere. ``peer_failed`` among them: the prefill gave the room up, e.g. while this
decode was stopped; another decode alone computes the prompt itself."""
MAX_LINE_BYTES = 8 << 20  # a line longer than this is passed through as it comes (no continuation)
MAX_HELD_BYTES = 64 << 10  # what decode sends after its error event or [DONE] is kept up to this
MAX_CHOICES = 128
MAX_IDS = 1 << 20  # per choice, those whose event has not passed yet included
MAX_ID = (1 << 31) - 1  # above any vocabulary: a larger id is a worker's garbage, never forwarded
_FINISHED = re.compile(rb'"finish_reason":\s*(?!null)')


@dataclass
class Lost:
    """A decode leg given up after the client's answer began: why (:data:`REASONS`), the log line's
    detail (the worker's address, the exception: never for the client), and the bytes decode ended
    with (an error event and ``[DONE]``, maybe cut short; may be empty) that the client gets if the
    stream is not continued."""

    reason: str
    detail: str
    held: bytes
    own_error: bool = False
    """Decode had sent an error event of the request's own (a code not in
    :data:`WORKER_FAILED_CODES`): never continued."""

    @property
    def message(self) -> str:
        """What the client reads (:data:`LOST_WORDS`)."""
        return LOST_WORDS.get(self.reason, "the decode worker was lost mid-answer")


class StreamTrack:
    """One streamed request's decode output as the router passes it on (see the module's doc);
    ``n``: its choices. Spans the request's decode legs: :meth:`new_stream` before each."""

    def __init__(self, n: int = 1):
        self.n = n
        self.ids: dict[int, list[int]] = {}
        self.id: Optional[str] = None
        self.created: Optional[int] = None
        self.finished: set[int] = set()
        self.bad = False  # decode said something the router cannot continue from
        self.passed = False  # a line of an event reached the client (on any leg)
        self._in_block = False  # a line the client got was passed since the last blank line
        self.new_stream()

    def new_stream(self) -> None:
        """A new decode leg's stream begins (the first, or a continuation)."""
        self._tail = b""
        self._pending: list[tuple[int, list[int]]] = []  # ids whose event has not passed yet
        self._waiting: dict[int, int] = {}  # how many of them, per choice
        self._passing: Optional[str] = None  # within an over-long line: "pass" it as it comes, or "drop" it
        self.held = b""
        self.error_code: Optional[str] = None

    def end_block(self) -> bytes:
        """What the client needs before the bytes of another stream: the blank line that ends an
        event the lost stream left open (the event itself had passed whole)."""
        if not self._in_block:
            return b""
        self._in_block = False
        return b"\n"

    @property
    def holding(self) -> bool:
        return bool(self.held)

    def feed(self, chunk: bytes) -> bytes:
        """The bytes of ``chunk`` the client may get now."""
        out = []
        data = self._tail + chunk
        if self._passing:
            line, nl, data = data.partition(b"\n")
            if self._passing == "pass":
                out.append(line + nl)
            self._passing = None if nl else self._passing
        lines = data.split(b"\n")
        self._tail = lines.pop()
        for line in lines:
            self._line(line, out)
        if len(self._tail) > MAX_LINE_BYTES:  # passed on as it comes; its ids are not followed
            self.bad, self._passing = True, "drop" if self._tail.startswith(b":") else "pass"
            if self._passing == "pass":
                out.append(self._tail)
                self._in_block = self.passed = True
            self._tail = b""
        return b"".join(out)

    def flush(self) -> bytes:
        """At the stream's end: what is left of an unended last line (not a comment)."""
        tail, self._tail = self._tail, b""
        if not tail or tail.startswith(b":"):
            return b""
        if self.holding:
            self.held += tail
            return b""
        return tail

    def _line(self, line: bytes, out: list) -> None:
        bare = line.rstrip(b"\r")
        if self.holding:
            if len(self.held) < MAX_HELD_BYTES:  # after an error event or [DONE]: its rest, bounded
                self.held += line + b"\n"
        elif bare.startswith(b":"):
            if bare.startswith(b": ids "):
                self._ids(bare[6:])
        elif not bare:
            if self._in_block:
                out.append(line + b"\n")
            self._in_block = False
        elif bare == b"data: [DONE]" or bare.startswith(b'data: {"error"'):
            self.held = line + b"\n"
            self.error_code = _error_code(bare[6:]) if bare != b"data: [DONE]" else None
        else:
            if bare.startswith(b"data: {"):
                self._event(bare[6:])
            for index, ids in self._pending:  # their text is in this event: the client has them now
                self.ids[index].extend(ids)
            self._pending.clear()
            self._waiting.clear()
            out.append(line + b"\n")
            self._in_block = self.passed = True

    def _ids(self, text: bytes) -> None:
        if self.bad:  # nothing is continued from here on: keep none of it
            return
        try:
            index, *ids = (int(part) for part in text.split(b" "))
        except ValueError:
            return self._unusable()
        listed = self.ids.setdefault(index, []) if 0 <= index < min(self.n, MAX_CHOICES) else None
        if listed is None or len(listed) + self._waiting.get(index, 0) + len(ids) > MAX_IDS \
                or any(not 0 <= i <= MAX_ID for i in ids):
            return self._unusable()
        self._pending.append((index, ids))
        self._waiting[index] = self._waiting.get(index, 0) + len(ids)

    def _unusable(self) -> None:
        """Decode said something the router cannot continue from: the ids kept so far are let go,
        so a worker that floods them holds no memory here."""
        self.bad = True
        self.ids.clear()
        self._pending.clear()
        self._waiting.clear()

    def _event(self, text: bytes) -> None:
        first = self.id is None
        if not first and not _FINISHED.search(text):
            return
        try:
            event = loads_shallow(text)
        except ValueError:
            self.bad = True
            return
        if not isinstance(event, dict):
            return
        if first and isinstance(event.get("id"), str) and type(event.get("created")) is int:
            self.id, self.created = event["id"], event["created"]
        for choice in event.get("choices") or ():
            if isinstance(choice, dict) and choice.get("finish_reason") is not None \
                    and type(choice.get("index")) is int:
                self.finished.add(choice["index"])

    def continuation(self) -> Optional[dict]:
        """The continuation field for another decode worker (the unfinished choices' ids, and
        the finished ones' count of tokens), or None if the stream cannot be continued (nothing to
        name it by, something unreadable, every choice finished)."""
        if self.bad or self.id is None or self.created is None:
            return None
        choices = [{"index": i, "ids": list(self.ids.get(i, ()))} for i in range(self.n) if i not in self.finished]
        if not choices:
            return None
        finished_tokens = sum(len(self.ids.get(i, ())) for i in self.finished)  # counted in usage by decode
        return {"id": self.id, "created": self.created, "choices": choices, "finished_tokens": finished_tokens}


def _error_code(text: bytes) -> Optional[str]:
    try:
        code = loads_shallow(text).get("error", {}).get("code")
    except (ValueError, AttributeError):
        return None
    return code if isinstance(code, str) else None
