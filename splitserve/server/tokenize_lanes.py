"""Where a worker validates and tokenizes its requests, off the event loop: two lanes, by body size.

A body of at most :data:`SHORT_BODY_BYTES` goes to the short lane, a longer one to the long lane;
each lane is one thread with its own copy of the tokenizer. So a short request never waits behind
a long tokenization (a text prompt that may fit the context is tokenized in full: ~9 s for a
million characters of SmolLM2 on a busy 2-core machine), and a long one waits only behind long
ones. A prompt that cannot fit is refused before that by its length in characters
(``validation.max_chars_per_token``).

Why copies: a Hugging Face fast tokenizer may not be used by two threads at once (``transformers``
sets its truncation state on each call: "RuntimeError: Already borrowed",
huggingface/tokenizers#537), and the engine loop decodes with the engine's own. Each lane copies
the tokenizer once, in its own thread, the first time it is given it (``copy.deepcopy``); one that
cannot be copied is shared by the lanes under a lock (one lane at a time again, never two at once).

A structured output's grammar is not compiled in a lane (:meth:`TokenizeLanes.validate`): the lane
validates and tokenizes, then the grammar compiles on the compiler's own threads while the
request awaits it (``engine/grammar_compiler.py``), so a plain request never queues behind a
compilation, however long a hostile schema takes.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from splitserve.validation import max_chars_per_token

log = logging.getLogger(__name__)

SHORT_BODY_BYTES = 64 << 10
"""A body this long or shorter is validated in the short lane: ~16k tokens of ordinary text, whose
tokenization takes milliseconds."""
LANES = ("short", "long")


class TokenizeLanes:
    """The lanes of one worker. ``executor``: run both lanes on it instead of a thread each (the
    simulator's runs them in place)."""

    def __init__(self, short_body_bytes: int = SHORT_BODY_BYTES, executor=None):
        self.short_body_bytes = short_body_bytes
        self._pools = {lane: executor or ThreadPoolExecutor(1, thread_name_prefix=f"tokenize-{lane}")
                       for lane in LANES}
        self._copies: dict[str, tuple[Any, Any]] = {}  # lane -> (the tokenizer given, the lane's copy)
        self._bounds: dict[int, Optional[int]] = {}  # id(tokenizer given) -> max_chars_per_token
        self._shared = threading.Lock()  # for a tokenizer that could not be copied

    def lane_of(self, body_bytes: int) -> str:
        return "short" if body_bytes <= self.short_body_bytes else "long"

    async def run(self, body_bytes: int, tokenizer, fn: Callable[[Any, Optional[int]], Any]):
        """``fn(tokenizer, chars_per_token)`` in the lane of a body of ``body_bytes``, with that
        lane's copy of ``tokenizer`` and the tokenizer's characters-per-token bound."""
        lane = self.lane_of(body_bytes)
        return await asyncio.get_running_loop().run_in_executor(self._pools[lane], self._call, lane, tokenizer, fn)

    async def validate(self, body_bytes: int, tokenizer, fn: Callable[[Any, Optional[int]], Any], grammars=None):
        """:meth:`run` a validation ``fn`` that returns a ``validation.ValidatedRequest``, then,
        when it names a grammar to compile (``grammar_param``), compile it with ``grammars`` (an
        ``engine/grammar_compiler.GrammarCompiler``) off the lanes: the request with its grammar."""
        req = await self.run(body_bytes, tokenizer, fn)
        if grammars is None or req.grammar_param is None or req.grammar is not None:
            return req
        grammar = await grammars.compile_async(req.grammar_spec, req.grammar_param)
        return dataclasses.replace(req, grammar=grammar)

    def _call(self, lane: str, tokenizer, fn):
        own = self._own(lane, tokenizer)
        bound = self._bounds.get(id(tokenizer), ...)
        if bound is ...:
            bound = self._bounds[id(tokenizer)] = max_chars_per_token(own) if own is not None else None
        if own is not None:
            return fn(own, bound)
        with self._shared:
            return fn(tokenizer, bound)

    def _own(self, lane: str, tokenizer):
        """This lane's copy of ``tokenizer`` (made on first use, in the lane's thread); None if it
        cannot be copied (or there is none)."""
        if tokenizer is None:
            return None
        given, own = self._copies.get(lane, (None, None))
        if given is tokenizer:
            return own
        try:
            own = copy.deepcopy(tokenizer)
        except Exception as exc:
            log.warning("the tokenizer cannot be copied (%s: %s): the lanes share it, one at a time",
                        type(exc).__name__, exc)
            own = None
        self._copies[lane] = (tokenizer, own)
        return own

    def shutdown(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=False)
