"""The model's tool-call text, parsed into OpenAI's ``tool_calls``.

The format is Hermes' / Qwen2.5's (what the tiny models' chat template asks for, and what a
forced call's grammar writes: ``engine/grammar.tool_call_spec``)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

One parser, :class:`ToolCallParser`, is fed the answer's text as it comes; it yields deltas in
OpenAI's streaming shape: ``{"content": ...}`` for text outside calls, then per call a first
``{"tool_calls": [{"index", "id", "type": "function", "function": {"name", "arguments": "{"}}]}``
and argument fragments ``{"tool_calls": [{"index", "function": {"arguments": ...}}]}``. A whole
answer is the same parser fed everything at once (:func:`parse`), so a streamed answer's deltas
reassemble to exactly the whole answer's ``tool_calls``. The rules (as vLLM's ``hermes`` parser
and SGLang's ``qwen25`` detector read the format, made incremental): ``docs/tools.md``, *The
format parsed*.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Optional

from splitserve.engine.grammar import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(\{)')
# each step of the header, for telling "not yet" from "never": a prefix of a header matches one of these
_HEADER_STEPS = [re.compile(p) for p in (
    r'\s*', r'\s*\{\s*', r'\s*\{\s*"n?a?m?e?', r'\s*\{\s*"name"\s*:?\s*',
    r'\s*\{\s*"name"\s*:\s*"(?:[^"\\]|\\.)*\\?', r'\s*\{\s*"name"\s*:\s*"(?:[^"\\]|\\.)*"\s*,?\s*',
    r'\s*\{\s*"name"\s*:\s*"(?:[^"\\]|\\.)*"\s*,\s*"a?r?g?u?m?e?n?t?s?',
    r'\s*\{\s*"name"\s*:\s*"(?:[^"\\]|\\.)*"\s*,\s*"arguments"\s*:?\s*')]


def _could_be_header(text: str) -> bool:
    return any(p.fullmatch(text) for p in _HEADER_STEPS)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser:
    """Incremental: :meth:`feed` text, :meth:`finish` at the end; both return deltas."""

    def __init__(self, names):
        self.names = frozenset(names)
        self.calls: list[dict] = []  # {"id", "type", "function": {"name", "arguments"}}
        self.content: list[str] = []
        self._state = "text"
        self._buf = ""  # text not yet decided on
        self._tail = ""  # after a call's arguments: what came before its closing tag (no tag in it)
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._finished = False

    # -- the deltas -------------------------------------------------------------------------------

    def _text(self, out: list, text: str) -> None:
        if text:
            self.content.append(text)
            out.append({"content": text})

    def _args(self, out: list, text: str) -> None:
        if text:
            self.calls[-1]["function"]["arguments"] += text
            out.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": text}}]})

    # -- the states ---------------------------------------------------------------------------------

    def feed(self, text: str) -> list[dict]:
        out: list[dict] = []
        self._buf += text
        while self._step(out):
            pass
        return out

    def _step(self, out: list) -> bool:
        """One move of the state machine over ``_buf``; False when it needs more text."""
        buf = self._buf
        if self._state == "text":
            at = buf.find(TOOL_CALL_OPEN)
            if at >= 0:
                self._emit_text(out, buf[:at], final=True)
                self._buf, self._state = buf[at + len(TOOL_CALL_OPEN):], "header"
                return True
            keep = _partial_suffix(buf, TOOL_CALL_OPEN)
            body = buf[:len(buf) - keep]
            stripped = body.rstrip()
            # whitespace is held back: dropped if a call follows, kept if text does
            self._emit_text(out, stripped, final=False)
            self._buf = buf[len(stripped):]
            return False
        if self._state == "header":
            m = _HEADER.match(buf)
            if m is not None:
                name = json.loads(m.group(1))
                if name in self.names:
                    self.calls.append({"id": new_call_id(), "type": "function",
                                       "function": {"name": name, "arguments": "{"}})
                    out.append({"tool_calls": [{"index": len(self.calls) - 1, "id": self.calls[-1]["id"],
                                                "type": "function", "function": {"name": name, "arguments": "{"}}]})
                    self._buf, self._state, self._depth = buf[m.end():], "args", 1
                    self._in_string = self._escape = False
                    return True
            elif _could_be_header(buf):
                return False
            self._not_a_call(out)
            return True
        if self._state == "args":
            i = self._scan(buf)
            self._args(out, buf[:i])
            self._buf = buf[i:]
            if self._depth == 0:
                self._state = "tail"
                return True
            return False
        # tail: what follows the arguments, up to the closing tag, is the call's own (its "}");
        # a call the model never closed ends where the next one opens, and what it wrote after
        # the call's object is content then, not dropped
        ends = [(at, tag) for tag in (TOOL_CALL_CLOSE, TOOL_CALL_OPEN) if (at := buf.find(tag)) >= 0]
        if ends:
            at, tag = min(ends)
            if tag == TOOL_CALL_OPEN:
                self._text(out, _after_call(self._tail + buf[:at]))
            self._tail, self._buf = "", buf[at + len(tag):]
            self._state = "text" if tag == TOOL_CALL_CLOSE else "header"
            return True
        keep = max(_partial_suffix(buf, TOOL_CALL_CLOSE), _partial_suffix(buf, TOOL_CALL_OPEN))
        self._tail += buf[:len(buf) - keep]
        self._buf = buf[len(buf) - keep:]
        return False

    def _emit_text(self, out: list, text: str, final: bool) -> None:
        """Text outside calls; ``final``: a call follows it, and its trailing whitespace is dropped."""
        self._text(out, text.rstrip() if final else text)

    def _not_a_call(self, out: list) -> None:
        self._text(out, TOOL_CALL_OPEN)
        self._state = "text"

    def _scan(self, buf: str) -> int:
        """How much of ``buf`` belongs to the arguments object (depth, strings and escapes followed)."""
        for i, c in enumerate(buf):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return len(buf)

    def finish(self) -> list[dict]:
        """The deltas of what was held back; once (a second call gives none)."""
        out: list[dict] = []
        if self._finished:
            return out
        self._finished = True
        if self._state == "header":  # a tag that never became a call: its text stays
            self._text(out, TOOL_CALL_OPEN + self._buf)
        elif self._state == "tail":  # a call never closed: what followed its object stays (less a
            # closing tag cut short by max_tokens)
            held = "" if TOOL_CALL_CLOSE.startswith(self._buf) else self._buf
            self._text(out, _after_call(self._tail + held))
        elif self._state == "text" and self._buf:
            if not self.calls or self._buf.strip():
                self._text(out, self._buf)
        self._buf = ""
        return out

    def message(self) -> dict:
        """The whole answer's ``content`` and ``tool_calls`` (as OpenAI: content null when the
        answer is calls alone)."""
        content = "".join(self.content)
        if not self.calls:
            return {"content": content}
        return {"content": content or None, "tool_calls": [json.loads(json.dumps(c)) for c in self.calls]}


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _after_call(tail: str) -> str:
    """What a call that was never closed left after its arguments, less the call object's own
    ``}`` and the whitespace around it: the model's text, for ``content``."""
    rest = tail.strip()
    return rest[1:].strip() if rest.startswith("}") else rest


def parse(text: str, names) -> ToolCallParser:
    """A whole answer, parsed: its :meth:`ToolCallParser.message`."""
    p = ToolCallParser(names)
    p.feed(text)
    p.finish()
    return p


def finish_reason(reason: Optional[str], parser: Optional[ToolCallParser]) -> Optional[str]:
    """``tool_calls`` for an answer that ended by itself with calls; a cut stays ``length``."""
    if parser is not None and parser.calls and reason == "stop":
        return "tool_calls"
    return reason
