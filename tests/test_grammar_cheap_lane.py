"""A grammar whose matcher is cheap to build (its cost measured at compilation, through the
``cpu_clock`` seam here) has its requests' matchers built on a lane of its own: with every shared
matcher thread held by costly grammars, several distinct ones queued behind them, a request with a
cheap cached grammar is still served, and the costly builds neither ran on its lane nor were
refused."""

from __future__ import annotations

import threading

import pytest

from splitserve.engine.grammar import GrammarSpec
from splitserve.engine.grammar_compiler import GrammarCompiler

V = 2048  # the tiny model's vocabulary
GUARD_S = 30  # a hang guard, never a bound


@pytest.fixture(scope="module")
def tokenizer():
    from splitserve.models.loader import load_tokenizer
    from splitserve.testing.tiny import tiny_model_path

    return load_tokenizer(tiny_model_path())


def test_a_cheap_grammar_never_waits_behind_costly_ones(tokenizer):
    plain, clock, hold, gate, held = GrammarCompiler(), [0.0], threading.Event(), threading.Event(), []

    def matcher(text, lltok):
        if "zz" in text:  # a costly grammar: 0.2 s of (seam) CPU per build, held once asked
            clock[0] += 0.2
            if hold.is_set():
                held.append(text)
                gate.wait(GUARD_S)
        else:
            clock[0] += 0.001
        return plain._matcher(text, lltok)

    compiler = GrammarCompiler(matcher=matcher, cpu_clock=lambda: clock[0], timeout_s=GUARD_S)
    compiler.prepare(tokenizer, V)
    costly = [GrammarSpec("regex", f"zz{i}+") for i in range(6)]
    cheap = GrammarSpec("regex", "a+")
    try:
        for spec in costly + [cheap]:  # compiled and cached, one at a time (the seam clock is shared)
            compiler.compile(spec)
        hold.set()
        waiters = [threading.Thread(target=compiler.compile, args=(s,), daemon=True) for s in costly]
        for t in waiters:
            t.start()
        while len(held) < 2:  # both shared matcher threads held, four costly builds queued behind
            gate.wait(0.01)
        assert compiler.compile(cheap) is not None
        assert len(held) == 2
    finally:
        gate.set()
        compiler.shutdown()
        plain.shutdown()
