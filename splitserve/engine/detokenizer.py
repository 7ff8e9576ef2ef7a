"""Incremental detokenization with stop strings.

Text is released only when it is final: never a half UTF-8 character (a byte-level token can end
mid-character; the decoder then shows U+FFFD, which we hold back), and never a tail that may still
grow into a stop string. So the concatenation of streamed deltas equals the non-streamed text, and
a stop string never leaks to a streaming client before it is recognised.

Decoding uses the "prefix offset" method: each step decodes a short window of recent tokens twice
(with and without the newest) and takes the difference, so cost per token stays constant and
tokenizers that merge a leading space into the next token (sentencepiece) come out right. The
window starts with the prompt's last few tokens for the same reason.
"""

from __future__ import annotations

_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = ()):
        self._tok = tokenizer
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(s for s in stop if s)
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
        if not self._stop:
            return
        longest = max(len(s) for s in self._stop)
        window_start = max(0, start - longest + 1)
        hits = [i for i in (self.text.find(s, window_start) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _holdback(self) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        for k in range(min(len(self.text), max((len(s) for s in self._stop), default=1) - 1), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0
