"""Compiling a request's grammar for one worker: bounded work, a bounded cache, a matcher per request.

A :class:`GrammarSpec` (checked at the edge by ``engine/grammar.py``) is compiled by the worker's
:class:`GrammarCompiler` into llguidance's grammar text, once per spec: on a pool of its own
(never a tokenize lane, never the engine loop), under llguidance's resource limits
(:data:`LIMITS`), its queue bounded (:data:`MAX_QUEUED_COMPILES`). One time limit
(:data:`COMPILE_TIMEOUT_S`) covers all a request waits for its grammar, compilation and matcher
both: past it the request is refused, never served late. The text is cached (bounded in entries
and in bytes); a refusal is remembered by the spec's hash (bounded), so the same schema is
refused at once next time.

Each request gets a :class:`Grammar` of its own: a fresh llguidance matcher built from the cached
text (its lexer grows with that request's tokens alone, up to :data:`LEXER_STATES`; why not a
shared one: ``docs/structured_outputs.md``), on threads shared fairly between grammars
(``engine/grammar_queue.py``; a grammar cheap to build, by its cost measured at compilation, on
a lane of its own, :data:`CHEAP_MATCHER_S`), its cost bounded at compilation (:data:`MATCHER_CPU_S`). A
request's choices (``n``) copy the request's own matcher; a request that reaches a limit fails
alone (a 400 naming the limit).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, wait as futures_wait
from typing import Optional

from splitserve.engine.grammar import JSON_OPTIONS, GrammarError, GrammarSpec, GrammarState, limit_message, tag_tokens
from splitserve.engine.grammar_queue import FairPool
from splitserve.errors import InvalidRequest, Overloaded

LEXER_STATES = 10_000
"""Lexer states one request's matcher may build (llguidance's ``max_lexer_states``, default
250,000). A bounded schema's whole answer builds a few hundred (SmolLM2's tokenizer, a random walk
of 150 tokens stayed under 500); each state is 1-2 KB by llguidance's own account, so one
request's lexer stays under 20 MB."""
LIMITS = {"max_lexer_states": LEXER_STATES, "initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000,
          "step_max_items": 50_000, "max_items_in_row": 2000, "max_grammar_size": 500_000,
          "verbose_errors": False}
"""llguidance's ``LLParserLimits`` for every matcher: its fuels and sizes bound the work of one
mask and of building the lexer (defaults, named so a change is deliberate), the lexer states bound
its memory, and ``verbose_errors`` off keeps the engine's state dump out of every error."""
COMPILE_TIMEOUT_S = 10.0
"""How long a request waits for its grammar, end to end: for a compilation thread, the compilation,
for a matcher thread and its matcher's build. Past it the request is refused: a 429 (nothing
remembered) unless the compilation itself ran half of it."""
SLOW_COMPILE_S = 2.0
"""A grammar whose compilation took more CPU time than this is refused (and remembered): a
compilation holds one of the few compilation threads. A bounded schema compiles in milliseconds. CPU time of the compiling thread, not wall time: a loaded machine must not make a
schema's refusal."""
MATCHER_CPU_S = 0.25
"""A grammar whose matcher took more CPU time than this to build (at compilation, the cheaper of
two tries) is refused (and remembered): each request builds its own matcher, on threads every
grammar shares. A bounded schema's takes under a millisecond, a forced call of 128 tools about
0.06 s (SmolLM2's tokenizer); CPU time, not wall time, so that a loaded machine refuses nothing."""
MATCHER_THREADS = 2
"""Threads building requests' matchers, shared round robin between grammars, one at a time per grammar."""
CHEAP_MATCHER_S = 0.02
"""A grammar whose matcher's build cost (measured at compilation) is under this much CPU has its
requests' matchers built on a thread of their own (:data:`CHEAP_MATCHER_THREADS`), never queued
behind the builds of costly grammars, however many distinct costly grammars one client cycles."""
CHEAP_MATCHER_THREADS = 1
MAX_CONCURRENT_COMPILES = 2
"""Compilations running at once on a worker; one past its time limit keeps its thread until it
ends (a call into the grammar engine cannot be stopped), so runaway schemas cannot pile up threads."""
MAX_QUEUED_COMPILES = 8
"""New grammars waiting for a compilation thread at most: one more is refused at once (a 429), not
queued to wait out the time limit behind them."""
CACHE_ENTRIES = 256
"""Compiled grammars kept per worker, least recently used dropped first."""
CACHE_BYTES = 16 << 20
"""...and their grammar texts together at most this many bytes (a text is about its schema's
size: at most 64 KiB of schema and a few hundred bytes)."""
REFUSALS = 4096
"""Refused specs remembered per worker, by hash (32 bytes and a reason of at most 300 characters)."""
_WHY_CHARS = 300


def spec_key(spec: GrammarSpec) -> bytes:
    """The hash a spec is cached and remembered by (the spec itself may be 64 KiB)."""
    return hashlib.sha256(spec.kind.encode() + b"\0" + spec.schema.encode()).digest()


class Grammar:
    """One request's compiled grammar: a matcher of its own, never advanced, that :meth:`state`
    copies for each of the request's choices (the copies share this request's lexer only)."""

    def __init__(self, spec: GrammarSpec, matcher, vocab_size: int, lltok=None, added: tuple = ()):
        self.spec = spec
        self._pristine = matcher
        self.vocab_size = vocab_size
        self._lltok, self._added = lltok, added

    def state(self) -> GrammarState:
        return GrammarState(self._pristine.deep_copy(), self.vocab_size, self._lltok, self._added)


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` for one tokenizer; one per worker. The bounds above are
    parameters (a test makes them small). Seams: ``build(spec, lltok)`` -> (text, None) or (None,
    why) compiles (default: llguidance's, with :data:`LIMITS`; a test gives one that blocks);
    ``matcher(text, lltok)`` builds a request's matcher (raises GrammarError)."""

    def __init__(self, timeout_s: float = COMPILE_TIMEOUT_S, max_concurrent: int = MAX_CONCURRENT_COMPILES,
                 cache_entries: int = CACHE_ENTRIES, cache_bytes: int = CACHE_BYTES, refusals: int = REFUSALS,
                 slow_s: float = SLOW_COMPILE_S, limits: Optional[dict] = None, build=None, matcher=None,
                 matcher_s: float = MATCHER_CPU_S, cpu_clock=time.thread_time,
                 max_queued: int = MAX_QUEUED_COMPILES, cheap_s: float = CHEAP_MATCHER_S):
        self.vocab_size: Optional[int] = None  # the logits' width, known at the first compilation
        self.limits = dict(LIMITS, **(limits or {}))
        self._build_fn = build or self._build
        self._matcher_fn = matcher or self._matcher
        self.timeout_s, self.slow_s, self.matcher_s, self.max_queued = timeout_s, slow_s, matcher_s, max_queued
        self._cpu = cpu_clock  # the calling thread's CPU time: what a grammar costs, whatever the load
        self.cache_entries, self.cache_bytes, self.refusals = cache_entries, cache_bytes, refusals
        # daemon threads: a compilation past its limit cannot be stopped, and must not hold up exit
        self._compiles = FairPool(max_concurrent, name="grammar-compile")
        # a request's own matcher, never behind a compilation, nor behind another grammar's flood
        self._matchers = FairPool(MATCHER_THREADS, per_key=1, name="grammar-matcher")
        self._cheap_matchers = FairPool(CHEAP_MATCHER_THREADS, per_key=1, name="grammar-matcher-cheap")
        self.cheap_s = cheap_s
        self._costs: OrderedDict[bytes, float] = OrderedDict()  # spec_key -> its matcher's build CPU
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, str] = OrderedDict()  # spec_key -> grammar text
        self._cached_bytes = 0
        self._refused: OrderedDict[bytes, str] = OrderedDict()  # spec_key -> why
        self._running: dict[bytes, Future] = {}  # spec_key -> its compilation (one per spec at a time)
        self._began: dict[bytes, float] = {}  # spec_key -> when its compilation got a thread
        self._lltok, self._added = None, ()
        self.compiled = 0  # counters: compilations run, answers from the cache, matchers built
        self.cache_hits = 0
        self.matchers_built = 0

    def prepare(self, tokenizer, vocab_size: int) -> None:
        """Build the grammar engine's view of ``tokenizer`` (once per worker: 0.5-1.3 s for SmolLM2's
        49,152 tokens). In the caller's thread, with the caller's own copy of the tokenizer (a
        tokenizer may not be used by two threads at once)."""
        with self._lock:
            if self._lltok is None:
                import llguidance.hf

                lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
                self._added = tuple(i for i in range(lltok.vocab_size) if lltok.is_special_token(i))
                self._lltok, self.vocab_size = lltok, vocab_size
            elif vocab_size != self.vocab_size:
                raise ValueError(f"this compiler is for a vocabulary of {self.vocab_size}, not {vocab_size}")

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def compile(self, spec: GrammarSpec, tokenizer=None, vocab_size: Optional[int] = None,
                param: str = "response_format") -> Grammar:
        """A request's :class:`Grammar` of ``spec``, waiting in this thread (see :meth:`compile_async`)."""
        if tokenizer is not None:
            self.prepare(tokenizer, vocab_size or len(tokenizer))
        started = time.monotonic()
        text = self._known(spec, param)
        if text is None:
            future = self._start(spec)
            _wait(future, self._left(started))
            text = self._settle(spec, future, param)
        build = self._lane(spec).submit(spec_key(spec), self._own, spec, text, param)
        _wait(build, self._left(started))
        return self._built(build)

    async def compile_async(self, spec: GrammarSpec, param: str = "response_format") -> Grammar:
        """A request's :class:`Grammar` of ``spec`` (after :meth:`prepare`), awaited off every
        thread: compiled once per spec on the compilation threads, each request's matcher built on
        the matcher threads, all within :attr:`timeout_s` from the call. Raises InvalidRequest
        naming why (the grammar engine's words, the limit it hit, the time limit), at once for a
        spec refused before; Overloaded, remembering nothing, when the compilation queue is full,
        or when the grammar is not ready within the time limit for want of a thread."""
        started = time.monotonic()
        text = self._known(spec, param)
        if text is None:
            future = self._start(spec)
            await _wait_async(future, self._left(started), shield=True)  # others may wait on it too
            text = self._settle(spec, future, param)
        build = self._lane(spec).submit(spec_key(spec), self._own, spec, text, param)
        await _wait_async(build, self._left(started))  # not shielded: a request gone drops its build
        return self._built(build)

    def _lane(self, spec: GrammarSpec) -> FairPool:
        """The pool a request's matcher of ``spec`` is built on: the cheap lane when the build cost
        measured at its compilation was under :attr:`cheap_s`, else the shared matcher threads."""
        with self._lock:
            cost = self._costs.get(spec_key(spec))
        return self._cheap_matchers if cost is not None and cost < self.cheap_s else self._matchers

    def _built(self, build: Future) -> Grammar:
        """The request's grammar its ``build`` made, or Overloaded when the build did not end
        within the time limit (the matcher threads were busy: nothing is remembered); a build
        ready after the limit is not served."""
        if not build.done():
            build.cancel()  # one not begun never runs; one running ends unseen
        if build.cancelled() or not build.done():
            raise Overloaded(f"the grammar's matcher was not built within {self.timeout_s:g}s (every matcher "
                             "thread was busy): try again")
        return build.result()

    def compiles_waiting(self) -> int:
        """New grammars queued for a compilation thread (bounded by :attr:`max_queued`)."""
        with self._lock:
            return self._queued()

    def _queued(self) -> int:
        return sum(not f.running() and not f.done() for f in self._running.values())

    def _left(self, started: float) -> float:
        return max(0.0, self.timeout_s - (time.monotonic() - started))

    def _known(self, spec: GrammarSpec, param: str) -> Optional[str]:
        """The cached text of ``spec``; None when it must be compiled. Raises InvalidRequest for a
        spec refused before, and ValueError before :meth:`prepare`."""
        if self._lltok is None:
            raise ValueError("prepare() the compiler with the worker's tokenizer first")
        key = spec_key(spec)
        with self._lock:
            why = self._refused.get(key)
            if why is not None:
                self._refused.move_to_end(key)
                self.cache_hits += 1
                raise InvalidRequest(why, param)
            text = self._cache.get(key)
            if text is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
            return text

    def _start(self, spec: GrammarSpec) -> Future:
        """The compilation of ``spec``: the one under way already, or a new one queued; Overloaded
        when :attr:`max_queued` new ones wait already."""
        key = spec_key(spec)
        with self._lock:
            future, new = self._running.get(key), False
            if future is None:
                waiting = self._queued()
                if waiting >= self.max_queued:
                    raise Overloaded(f"{waiting} grammars wait to compile already: try again")
                future = self._running[key] = self._compiles.submit(key, self._timed_build, spec)
                new = True
        if new:  # outside the lock: a future done already runs its callback here, at once
            future.add_done_callback(lambda f: self._ran(key, f))
        return future

    def _ran(self, key: bytes, future: Future) -> None:
        with self._lock:
            if self._running.get(key) is future:
                del self._running[key]

    def _timed_build(self, spec: GrammarSpec) -> tuple[Optional[str], Optional[str]]:
        key = spec_key(spec)
        with self._lock:
            self._began[key] = time.monotonic()
        try:
            return self._measured(spec)
        finally:
            with self._lock:
                self._began.pop(key, None)
                self.compiled += 1

    def _measured(self, spec: GrammarSpec) -> tuple[Optional[str], Optional[str]]:
        """``spec`` compiled, then one matcher built of it as a check, each measured in this
        thread's CPU time (the grammar's own cost, whatever the load): (text, None) or (None, why)."""
        started = self._cpu()
        text, why = self._build_fn(spec, self._lltok)
        took = self._cpu() - started
        if text is None:
            return None, why
        if took > self.slow_s:
            return None, f"the grammar took {took:.1f}s to compile, more than the {self.slow_s:g}s accepted"
        try:
            cost = self._matcher_cost(text)
            if cost > self.matcher_s:  # a second try, the cheaper counts: the first may have paid for a cold cache
                cost = min(cost, self._matcher_cost(text))
        except GrammarError as exc:
            return None, f"the {_what(spec)} cannot be compiled: {exc}"
        with self._lock:  # bounded like the cache it goes with
            self._costs[spec_key(spec)] = cost
            while len(self._costs) > self.cache_entries:
                self._costs.popitem(last=False)
        if cost > self.matcher_s:
            return None, (f"the grammar's matcher took {cost * 1000:.0f} ms of CPU to build, more than the "
                          f"{self.matcher_s * 1000:g} ms accepted (every request builds its own)")
        return text, None

    def _matcher_cost(self, text: str) -> float:
        started = self._cpu()
        self._matcher_fn(text, self._lltok)
        return self._cpu() - started

    def _settle(self, spec: GrammarSpec, future: Future, param: str) -> str:
        """What a wait on ``future`` gave: its text (cached), or the refusal (remembered) raised."""
        if future.cancelled() or (not future.done() and future.cancel()):  # never started: threads busy
            raise Overloaded(f"every grammar compilation thread stayed busy for {self.timeout_s:g}s")
        if not future.done():
            with self._lock:
                began = self._began.get(spec_key(spec))
            if began is None or time.monotonic() - began < self.timeout_s / 2:
                # it waited behind other clients' compilations: the machine's load, not the schema's
                # cost, so nothing is remembered against the schema
                raise Overloaded(f"the grammar's compilation waited for a thread and did not end within "
                                 f"{self.timeout_s:g}s: try again")
            self._remember(spec, f"the grammar did not compile within {self.timeout_s:g}s (the time limit)")
            raise InvalidRequest(self._refused_why(spec), param)
        text, why = future.result()
        if text is None:
            self._remember(spec, why)
            raise InvalidRequest(self._refused_why(spec), param)
        self._keep(spec, text)
        return text

    def _refused_why(self, spec: GrammarSpec) -> str:
        with self._lock:
            return self._refused.get(spec_key(spec), "the grammar was refused")

    def _remember(self, spec: GrammarSpec, why: str) -> None:
        key = spec_key(spec)
        with self._lock:
            if key not in self._refused:
                self._refused[key] = why[:_WHY_CHARS]
            while len(self._refused) > self.refusals:
                self._refused.popitem(last=False)

    def _keep(self, spec: GrammarSpec, text: str) -> None:
        key = spec_key(spec)
        with self._lock:
            if key in self._cache or len(text) > self.cache_bytes:
                return
            self._cache[key] = text
            self._cached_bytes += len(text)
            while len(self._cache) > self.cache_entries or self._cached_bytes > self.cache_bytes:
                self._cached_bytes -= len(self._cache.popitem(last=False)[1])

    def forget(self, spec: GrammarSpec) -> None:
        """Drop ``spec``'s cached text (a matcher built from it failed: it is compiled anew next time)."""
        with self._lock:
            text = self._cache.pop(spec_key(spec), None)
            if text is not None:
                self._cached_bytes -= len(text)

    def _own(self, spec: GrammarSpec, text: str, param: str) -> Grammar:
        """A request's own matcher of ``text``; a text whose matcher fails is dropped from the cache."""
        try:
            matcher = self._matcher_fn(text, self._lltok)
        except GrammarError as exc:
            self.forget(spec)
            raise InvalidRequest(f"the grammar cannot be compiled: {exc}", param) from None
        self.matchers_built += 1
        return Grammar(spec, matcher, self.vocab_size, self._lltok, self._added)

    def _matcher(self, text: str, lltok):
        """A fresh llguidance matcher of ``text`` with its first mask computed (which builds the
        lexer's start), under :attr:`limits`. Raises GrammarError with the grammar engine's words
        (the limit it hit, if that is why)."""
        import llguidance

        matcher = llguidance.LLMatcher(lltok, text, log_level=0, limits=llguidance.LLParserLimits(**self.limits))
        if not matcher.is_error():
            matcher.compute_bitmask()
        if matcher.is_error():
            raise GrammarError(limit_message(matcher.get_error()))
        return matcher

    def _build(self, spec: GrammarSpec, lltok) -> tuple[Optional[str], Optional[str]]:
        """llguidance's grammar text of ``spec`` (a matcher of it is built as a check after):
        (text, None) or (None, why)."""
        import llguidance

        try:
            if spec.kind == "lark":
                text = llguidance.LLMatcher.grammar_from_lark(tag_tokens(spec.schema, lltok))
            elif spec.kind == "regex":
                text = llguidance.LLMatcher.grammar_from_regex(spec.schema)
            else:
                text = llguidance.LLMatcher.grammar_from_json_schema(spec.schema, defaults=dict(JSON_OPTIONS))
        except ValueError as exc:  # llguidance raises ValueError for a schema it cannot read
            return None, f"the {_what(spec)} cannot be compiled: {limit_message(str(exc))}"
        return text, None

    def shutdown(self) -> None:
        """Stop both pools without waiting: a compilation or a build under way ends unseen (their
        threads are daemons, so a process exiting never waits on one stuck in the grammar engine)."""
        self._compiles.shutdown()
        self._matchers.shutdown()
        self._cheap_matchers.shutdown()


def _wait(future: Future, seconds: float) -> None:
    """Wait for ``future`` at most ``seconds``; it may still run after (its outcome is read by the caller)."""
    futures_wait((future,), timeout=seconds)


async def _wait_async(future: Future, seconds: float, shield: bool = False) -> None:
    """Await ``future`` at most ``seconds`` (its outcome is read by the caller); unshielded, the
    timeout cancels it if it has not begun."""
    waited = asyncio.wrap_future(future)
    try:  # asyncio.timeout, never wait_for: it can drop a cancellation (test_router)
        async with asyncio.timeout(seconds):
            await (asyncio.shield(waited) if shield else waited)
    except asyncio.TimeoutError:
        pass
    except asyncio.CancelledError:  # ``future`` cancelled (by another waiter): this task goes on
        if not future.cancelled() or asyncio.current_task().cancelling():
            raise
    except Exception:  # noqa: BLE001 - the future's own error, raised again where it is read
        pass


def _what(spec: GrammarSpec) -> str:
    """What ``spec`` is, in a refusal's words."""
    return {"regex": "regex", "lark": "tool-call grammar"}.get(spec.kind, "JSON schema")
