"""Requests' matchers are built on threads shared fairly between grammars, checked by counting:
a flood of one key's jobs runs round robin with another key's (the other's job runs second, not
after the flood), one key holds at most one thread, so a request whose grammar is cached is
served while every thread another grammar could take is held; and a grammar whose matcher costs
more CPU than the bound to build (measured with a seam clock) is refused at compilation, by name,
and remembered."""

from __future__ import annotations

import threading

import pytest

from splitserve.engine.grammar import GrammarSpec
from splitserve.engine.grammar_compiler import GrammarCompiler
from splitserve.engine.grammar_queue import FairPool
from splitserve.errors import InvalidRequest

V = 2048  # the tiny model's vocabulary
GUARD_S = 30  # a hang guard, never a bound: the waits below end at once when the code is right


@pytest.fixture(scope="module")
def tokenizer():
    from splitserve.models.loader import load_tokenizer
    from splitserve.testing.tiny import tiny_model_path

    return load_tokenizer(tiny_model_path())


def test_a_flood_of_one_key_takes_turns_with_another_key():
    """One thread; while a job of key a holds it, 10 more of a and then 1 of b wait. The b job
    runs first or second after the holder (its turn comes before a's second), not eleventh."""
    pool, gate, order = FairPool(1), threading.Event(), []
    try:
        held = pool.submit("a", gate.wait, GUARD_S)
        jobs = [pool.submit("a", order.append, "a") for _ in range(10)] + [pool.submit("b", order.append, "b")]
        gate.set()
        held.result(GUARD_S)
        for job in jobs:
            job.result(GUARD_S)
        assert order.index("b") <= 1 and len(order) == 11
    finally:
        gate.set()
        pool.shutdown()


def test_one_key_holds_one_thread_and_a_waiting_job_can_be_cancelled():
    """Two threads, three held jobs of key a: one runs, and b's job runs on the other thread
    while it is held; a's waiting job cancelled never runs."""
    pool, gate, ran = FairPool(2), threading.Event(), []

    def hold(name):
        ran.append(name)
        gate.wait(GUARD_S)

    try:
        a = [pool.submit("a", hold, f"a{i}") for i in range(3)]
        pool.submit("b", ran.append, "b").result(GUARD_S)
        assert ran == ["a0", "b"] and pool.waiting() == 2
        assert a[2].cancel()
        gate.set()
        a[1].result(GUARD_S)
        assert ran == ["a0", "b", "a1"] and a[2].cancelled()
    finally:
        gate.set()
        pool.shutdown()


def test_a_cached_grammar_is_served_while_another_grammar_floods_the_builds(tokenizer):
    """Eight requests of one cached grammar whose matcher builds are held: one build runs, the
    other seven wait their turn, and a request of another cached grammar gets its matcher
    meanwhile (with one shared FIFO pool, two of the flood held both threads and it waited for
    all eight)."""
    plain, hold, gate, started = GrammarCompiler(), threading.Event(), threading.Event(), []
    heavy, light = GrammarSpec("regex", "(cow|pig)+"), GrammarSpec("regex", "(cat|dog)")

    def matcher(text, lltok):
        if hold.is_set() and "cow" in text:
            started.append(text)
            gate.wait(GUARD_S)
        return plain._matcher(text, lltok)

    compiler = GrammarCompiler(matcher=matcher, cheap_s=0)  # the shared threads alone
    try:
        compiler.compile(heavy, tokenizer, V)
        compiler.compile(light)
        hold.set()
        flood = [threading.Thread(target=compiler.compile, args=(heavy,)) for _ in range(8)]
        for t in flood:
            t.start()
        served = []
        other = threading.Thread(target=lambda: served.append(compiler.compile(light)))
        other.start()
        other.join(GUARD_S)
        assert served and len(started) == 1
    finally:
        gate.set()
        for t in flood:
            t.join(GUARD_S)
        compiler.shutdown()
        plain.shutdown()
    assert len(started) == 8 and compiler.compiled == 2


class Clock:
    """A CPU clock the test moves: a matcher build costs what the test says."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_grammar_whose_matcher_costs_too_much_cpu_is_refused_and_remembered(tokenizer):
    """A matcher costing 1 s of (seam) CPU to build, twice, is refused at compilation naming the
    bound, and the next request is refused without compiling; one costing 1 ms passes; an
    expensive first try followed by a cheap one passes (a cold cache is not the grammar's cost)."""
    plain, clock, builds = GrammarCompiler(), Clock(), []
    costs = {"cow": [1.0, 1.0], "cat": [0.001], "eel": [1.0, 0.001]}

    def matcher(text, lltok):
        word = next(w for w in costs if w in text)
        builds.append(word)
        clock.now += costs[word][min(builds.count(word), len(costs[word])) - 1]
        return plain._matcher(text, lltok)

    compiler = GrammarCompiler(matcher=matcher, cpu_clock=clock)
    compiler.prepare(tokenizer, V)
    try:
        for _ in range(2):
            with pytest.raises(InvalidRequest, match="matcher took 1000 ms of CPU .* the 250 ms accepted") as e:
                compiler.compile(GrammarSpec("regex", "cow"), param="sampling_params.regex")
            assert e.value.param == "sampling_params.regex"
        assert builds == ["cow", "cow"] and compiler.compiled == 1
        assert compiler.compile(GrammarSpec("regex", "cat")) is not None
        assert compiler.compile(GrammarSpec("regex", "eel")) is not None
        assert builds[2:] == ["cat", "cat", "eel", "eel", "eel"]  # a check, then the request's own
    finally:
        compiler.shutdown()
        plain.shutdown()
