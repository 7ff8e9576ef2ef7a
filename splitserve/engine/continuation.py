"""A continuation: the rest of a streamed answer whose worker was lost, asked by the router.

The router sends the original request plus ``continuation``: the response ``id`` and ``created``
the client has seen, and for each unfinished choice its ``index`` and every token id streamed so
far (``docs/lifecycle.md``, *A continuation*). This module reads that field (bounds named, each a
400) and replays given ids through a detokenizer without emitting, which both the engine (its
sequence's window and stop matcher) and the server (the tool-call parser's input) do the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from splitserve.errors import InvalidRequest

PREFIXES = {"chat": "chatcmpl-", "completions": "cmpl-"}
"""What a continued response's ``id`` starts with, per endpoint (what follows is the request id)."""


@dataclass(frozen=True)
class Continuation:
    """``choices``: (index, ids) of each unfinished choice, by index; ``finished_tokens``: the
    completion tokens of the choices left out as finished (counted in the usage)."""

    id: str
    created: int
    choices: tuple[tuple[int, tuple[int, ...]], ...]
    finished_tokens: int = 0

    @property
    def rid(self) -> str:
        """The request id the continued answer's chunks carry (the ``id`` without its prefix)."""
        return self.id.split("-", 1)[1]


def parse_continuation(v: Any, endpoint: str, *, stream: bool, n: int, max_tokens: int,
                       vocab_size: Optional[int]) -> Optional[Continuation]:
    """``continuation`` of a request body (None when absent), checked against the request's
    ``n``, ``max_tokens`` and the vocabulary; raises InvalidRequest naming the field."""
    if v is None:
        return None
    name = "continuation"
    if endpoint not in PREFIXES:
        raise InvalidRequest(f"{name} is taken on /v1/completions and /v1/chat/completions only", name)
    if not stream:
        raise InvalidRequest(f"{name} needs stream: true", name)
    if not isinstance(v, dict) or set(v) - {"id", "created", "choices", "finished_tokens"}:
        raise InvalidRequest(f"{name} must be an object of id, created, choices and finished_tokens", name)
    rid = v.get("id")
    prefix = PREFIXES[endpoint]
    if (not isinstance(rid, str) or not rid.startswith(prefix) or not 0 < len(rid) - len(prefix) <= 256
            or not rid.isprintable() or any(c.isspace() for c in rid)):
        raise InvalidRequest(f"{name}.id must be {prefix} and 1 to 256 printable characters without spaces",
                             f"{name}.id")
    created = v.get("created")
    if not _is_int(created) or not 0 <= created < 1 << 40:
        raise InvalidRequest(f"{name}.created must be an integer in [0, 2**40)", f"{name}.created")
    choices = _choices(v.get("choices"), n, max_tokens, vocab_size)
    done = v.get("finished_tokens", 0)
    if not _is_int(done) or not 0 <= done <= (n - len(choices)) * max_tokens:
        raise InvalidRequest(f"{name}.finished_tokens must be an integer in [0, (n - choices) * max_tokens]",
                             f"{name}.finished_tokens")
    return Continuation(rid, created, choices, done)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _choices(v: Any, n: int, max_tokens: int, vocab_size: Optional[int]) -> tuple:
    name = "continuation.choices"
    if not isinstance(v, list) or not 1 <= len(v) <= n:
        raise InvalidRequest(f"{name} must be a list of 1 to n ({n}) choices", name)
    seen: dict[int, tuple[int, ...]] = {}
    for k, c in enumerate(v):
        at = f"{name}[{k}]"
        if not isinstance(c, dict) or set(c) != {"index", "ids"}:
            raise InvalidRequest(f"{at} must be an object of index and ids", at)
        index, ids = c["index"], c["ids"]
        if not _is_int(index) or not 0 <= index < n or index in seen:
            raise InvalidRequest(f"{at}.index must be a distinct integer in [0, n)", f"{at}.index")
        if not isinstance(ids, list) or len(ids) > max_tokens:
            raise InvalidRequest(f"{at}.ids must be a list of at most max_tokens ({max_tokens}) token ids",
                                 f"{at}.ids")
        top = vocab_size if vocab_size is not None else 1 << 31
        if not all(_is_int(t) and 0 <= t < top for t in ids):
            raise InvalidRequest(f"{at}.ids must be token ids in [0, {top})", f"{at}.ids")
        seen[index] = tuple(ids)
    return tuple(sorted(seen.items()))


def replay(detok, ids) -> list[str]:
    """Add ``ids`` to ``detok`` one at a time, releasing after each as generation does; the text
    each released (what the client was sent of them)."""
    texts = []
    for token in ids:
        detok.add(token)
        texts.append(detok.release(final=False))
    return texts
