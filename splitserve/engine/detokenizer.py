"""Incremental detokenization with stop strings.

Text is released only when it is final: never a half UTF-8 character (a byte-level token can end
mid-character; the decoder then shows U+FFFD, which we hold back), and never a tail that may still
grow into a stop string. So the concatenation of streamed deltas equals the non-streamed text, and
a stop string never leaks to a streaming client before it is recognised.

Decoding uses the "prefix offset" method: each step decodes a short window of recent tokens twice
(with and without the newest) and takes the difference, so cost per token stays constant and
tokenizers that merge a leading space into the next token (sentencepiece) come out right. The
window starts with the prompt's last few tokens for the same reason.

Stop strings are matched by one automaton over all of a request's stop strings (Aho-Corasick,
:class:`StopMatcher`), fed each new character once: a character costs at most two steps on
average, whatever the stop list, and the automaton's state says at once how much of the text's
tail may still become a stop string (its depth: what is held back). A request's stop list is
capped (``splitserve/validation/sampling.py``, ``MAX_STOP*``); its automaton is built off the engine loop, at
validation on the tokenizer's thread, and handed in with the request (``GenerateRequest.stop_matcher``);
each distinct list's is built once and shared (:func:`stop_matcher`).
"""

from __future__ import annotations

import functools
from typing import Optional

_PROMPT_CONTEXT = 5
STOP_MATCHERS_KEPT = 64  # distinct stop lists whose automaton is kept (each at most ~1.3 MB, 30 ms to build)


class StopMatcher:
    """The Aho-Corasick automaton of a set of stop strings: immutable, shared by every request
    with the same stop list. State 0 is the empty match; a state is the longest tail of the text
    that is a prefix of some stop string, and ``depth[state]`` its length."""

    def __init__(self, stops: tuple[str, ...]):
        goto: list[dict[str, int]] = [{}]
        depth, ends = [0], [0]  # ends[s]: the longest stop string that is a suffix of state s (0: none)
        for stop in stops:
            s = 0
            for c in stop:
                nxt = goto[s].get(c)
                if nxt is None:
                    nxt = goto[s][c] = len(goto)
                    goto.append({})
                    depth.append(depth[s] + 1)
                    ends.append(0)
                s = nxt
            ends[s] = len(stop)
        fail = [0] * len(goto)
        order = list(goto[0].values())  # breadth first: a state's failure is shallower, so done first
        for u in order:
            for c, v in goto[u].items():
                f = fail[u]
                while f and c not in goto[f]:
                    f = fail[f]
                fail[v] = goto[f].get(c, 0)  # f is shallower than u: never v itself
                ends[v] = max(ends[v], ends[fail[v]])
                order.append(v)
        self.goto, self.fail, self.depth, self.ends = goto, fail, depth, ends

    def feed(self, state: int, chunk: str) -> tuple[int, Optional[int], int]:
        """Advance from ``state`` over ``chunk``: the new state, where in ``chunk`` the earliest
        stop string that completes in it begins (it may be negative: begun before the chunk;
        None if none completes), and the steps taken."""
        goto, fail, ends = self.goto, self.fail, self.ends
        hit: Optional[int] = None
        steps = 0
        for i, c in enumerate(chunk):
            while state and c not in goto[state]:
                state = fail[state]
                steps += 1
            state = goto[state].get(c, 0)
            steps += 1
            if ends[state]:
                start = i + 1 - ends[state]
                hit = start if hit is None else min(hit, start)
        return state, hit, steps


@functools.lru_cache(maxsize=STOP_MATCHERS_KEPT)
def stop_matcher(stops: tuple[str, ...]) -> StopMatcher:
    """The automaton of ``stops`` (built once per distinct list, then shared)."""
    return StopMatcher(stops)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = (),
                 matcher: Optional[StopMatcher] = None):
        """``matcher``: the automaton of ``stop`` if the caller has it (built off the engine loop)."""
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        stop = tuple(s for s in stop if s)
        self._matcher = (matcher or stop_matcher(stop)) if stop else None
        self._state = 0  # of the matcher, after every character of ``text``
        self.match_steps = 0  # steps the matcher took (a count: bounded by twice the characters fed)
        self.text = ""  # the output text decoded so far (after a stop: cut before the stop string)
        self._released = 0  # characters of ``text`` already handed out
        self.stopped = False  # a stop string was found

    def add(self, token_id: int) -> None:
        """Append one generated token; sets ``stopped`` if a stop string completed."""
        if self.stopped:
            return
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            start = len(self.text)
            self.text += full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._check_stop(start)

    def release(self, final: bool) -> str:
        """The text not yet handed out that is safe to hand out now (all of it when ``final``:
        then bytes still waiting for the rest of their character come out as U+FFFD, exactly as a
        one-shot decode of the whole output shows them)."""
        if final and not self.stopped:
            self._flush()
        end = len(self.text) if (final or self.stopped) else len(self.text) - self._holdback()
        delta = self.text[self._released:end]
        self._released = max(self._released, end)
        return delta

    def _flush(self) -> None:
        if self._read_offset < len(self._ids):
            prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
            full = self._decode(self._ids[self._prefix_offset:])
            self.text += full[len(prefix):]
            self._prefix_offset = self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _check_stop(self, start: int) -> None:
        if self._matcher is None:
            return
        self._state, hit, steps = self._matcher.feed(self._state, self.text[start:])
        self.match_steps += steps
        if hit is not None:
            self.text = self.text[:start + hit]
            self.stopped = True

    def _holdback(self) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string (a
        complete one would have stopped the text)."""
        return self._matcher.depth[self._state] if self._matcher is not None else 0
