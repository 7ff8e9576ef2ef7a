"""A request's grammar is ready within the compile limit, end to end, or refused for now: the wait
for a compilation thread, the compilation and the wait for a matcher thread all count toward one
limit; a matcher ready after it is a 429 (``Overloaded``), never the grammar; a full compilation
queue refuses a new schema at once; and none of these refusals is remembered against the schema
(the next request with it is served). Checked by outcomes and counts, with seams that hold builds."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from splitserve.engine.grammar import GrammarSpec
from splitserve.engine.grammar_compiler import GrammarCompiler
from splitserve.errors import Overloaded

V = 2048  # the tiny model's vocabulary
GUARD_S = 30  # a hang guard, never a bound: each wait below ends at the 0.3 s limit when the code is right
LIMIT_S = 0.3


@pytest.fixture(scope="module")
def tokenizer():
    from splitserve.models.loader import load_tokenizer
    from splitserve.testing.tiny import tiny_model_path

    return load_tokenizer(tiny_model_path())


def _until(done, what: str) -> None:
    """Wait for ``done()`` (a hang guard of GUARD_S, never a bound): fail naming ``what`` instead
    of spinning for ever."""
    deadline = time.monotonic() + GUARD_S
    while not done():
        assert time.monotonic() < deadline, f"not reached within {GUARD_S}s: {what}"
        time.sleep(0.01)


def _outcome(fn, *args) -> list:
    """``fn(*args)``'s result or exception, in a list; empty while it still runs after the guard."""
    out: list = []

    def run():
        try:
            out.append(fn(*args))
        except Exception as exc:  # the outcome is what the test checks
            out.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(GUARD_S)
    return out


def _held_matchers(words: tuple):
    """A matcher seam that holds the builds of texts holding one of ``words`` once ``hold`` is
    set, until ``gate`` is; ``started`` counts the held builds that began."""
    plain, hold, gate, started = GrammarCompiler(), threading.Event(), threading.Event(), []

    def matcher(text, lltok):
        if hold.is_set() and any(w in text for w in words):
            started.append(text)
            gate.wait(GUARD_S)
        return plain._matcher(text, lltok)

    return plain, matcher, hold, gate, started


def test_the_wait_for_a_matcher_thread_counts_toward_the_limit(tokenizer):
    """Both matcher threads held by two other grammars: a request of a third, cached grammar is
    refused for now (429) at the limit instead of waiting; its build never ran; once the threads
    are free the same grammar is served without compiling again (nothing remembered)."""
    plain, matcher, hold, gate, started = _held_matchers(("cow", "pig"))
    compiler = GrammarCompiler(timeout_s=LIMIT_S, matcher=matcher, cheap_s=0)  # the shared threads alone
    specs = [GrammarSpec("regex", w) for w in ("cow", "pig", "cat")]
    try:
        for spec in specs:
            compiler.compile(spec, tokenizer, V)
        hold.set()
        holders = [threading.Thread(target=_outcome, args=(compiler.compile, s)) for s in specs[:2]]
        for t in holders:
            t.start()
        while len(started) < 2:
            gate.wait(0.01)
        [refused] = _outcome(compiler.compile, specs[2])
        assert isinstance(refused, Overloaded) and refused.status == 429, refused
        assert compiler.matchers_built == 3  # the checks' requests only: the refused build never ran
    finally:
        gate.set()
        for t in holders:
            t.join(GUARD_S)
        plain.shutdown()
    try:
        assert compiler.compile(specs[2]) is not None and compiler.compiled == 3
    finally:
        compiler.shutdown()


def test_a_matcher_ready_after_the_limit_is_refused_never_served(tokenizer):
    """A request whose own matcher build runs past the limit (held by the seam): 429, not the
    grammar once the build ends; the next request with that grammar is served."""
    plain, matcher, hold, gate, started = _held_matchers(("cow",))
    compiler = GrammarCompiler(timeout_s=LIMIT_S, matcher=matcher, cheap_s=0)  # the shared threads alone
    spec = GrammarSpec("regex", "cow")
    try:
        compiler.compile(spec, tokenizer, V)
        hold.set()
        [refused] = _outcome(asyncio.run, compiler.compile_async(spec))
        assert isinstance(refused, Overloaded), refused
        assert len(started) == 1
        hold.clear()
        gate.set()
        assert asyncio.run(compiler.compile_async(spec)) is not None and compiler.compiled == 1
    finally:
        gate.set()
        compiler.shutdown()
        plain.shutdown()


def test_a_full_compilation_queue_refuses_a_new_schema_at_once(tokenizer):
    """One compilation thread held and two compilations queued (the bound): a third new schema is
    refused 429 without being queued or compiled; once the queue drains it compiles."""
    release, built = threading.Event(), []
    plain = GrammarCompiler()

    def build(spec, lltok):
        built.append(spec.schema)
        release.wait(GUARD_S)
        return plain._build(spec, lltok)

    compiler = GrammarCompiler(max_concurrent=1, max_queued=2, build=build)
    compiler.prepare(tokenizer, V)
    specs = [GrammarSpec("regex", w) for w in ("a+", "b+", "c+", "d+")]
    waiters = [threading.Thread(target=_outcome, args=(compiler.compile, s)) for s in specs[:3]]
    try:
        # the first one compiling before the others queue: started together, which the compile
        # thread takes first is a race, and a third queued before it takes one is refused
        waiters[0].start()
        _until(lambda: built == ["a+"], "the first schema to reach the compile thread")
        for t in waiters[1:]:
            t.start()
        _until(lambda: compiler.compiles_waiting() == 2, "two schemas queued")
        with pytest.raises(Overloaded, match="2 grammars wait"):
            compiler.compile(specs[3])
        assert built == ["a+"] and compiler.compiles_waiting() == 2
        release.set()
        for t in waiters:
            t.join(GUARD_S)
        assert compiler.compile(specs[3]) is not None and len(built) == 4
    finally:
        release.set()
        compiler.shutdown()
        plain.shutdown()
