"""What one request's grammar may cost the others, checked by counting: no matcher state is shared
between requests (a regex that grows the lexer fails no later request); a compilation runs off the
tokenize lanes (a plain request, and a request whose grammar is cached, are answered while a
compilation is held); a refusal (the time limit, a limit of the grammar engine) is remembered by
hash and bounded; the cache is bounded in entries and bytes and drops an entry whose matcher
fails; a grammar past a limit is a 400 naming the limit, never the engine's state dump, whether
at compilation or in the middle of an answer."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import pytest
import requests

from splitserve.config import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.grammar import MAX_INTERSECTED_PATTERNS, GrammarError, GrammarSpec, schema_spec
from splitserve.engine.grammar_compiler import GrammarCompiler
from splitserve.engine.io import GenerateRequest, InvalidRequest, Overloaded, SamplingParams
from splitserve.outcomes import Reason
from splitserve.server.tokenize_lanes import TokenizeLanes
from splitserve.validation import RequestContext, validate_request

V = 2048  # the tiny model's vocabulary
GROWING = GrammarSpec("regex", "[ab]*a[ab]{16}")  # a lexer state for almost every byte it matches
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    from splitserve.models.loader import load_tokenizer
    from splitserve.testing.tiny import tiny_model_path

    return load_tokenizer(tiny_model_path())


def _walk(state, rng: random.Random, tokens: int, eos: int = 2) -> int:
    """Advance ``state`` by up to ``tokens`` random allowed tokens other than ``eos`` (the tiny
    model's); how many it took."""
    for taken in range(tokens):
        allowed = [int(t) for t in state.allowed().nonzero()[0] if t != eos]
        if not allowed or state.done:
            return taken
        state.advance(rng.choice(allowed))
    return tokens


def test_requests_with_one_grammar_share_no_growing_state(tokenizer):
    """120 requests of 40 tokens each under a lexer cap of 3,000 states: each request's own lexer
    stays far below it, so none fails (copies of one cached matcher shared a lexer that reached
    the cap at the 90th request, failing every request after); each request built a matcher."""
    compiler = GrammarCompiler(limits={"max_lexer_states": 3000})
    rng = random.Random(0)
    try:
        for _ in range(120):
            grammar = compiler.compile(GROWING, tokenizer, V, "sampling_params.regex")
            assert _walk(grammar.state(), rng, 40) > 0
        assert (compiler.compiled, compiler.matchers_built) == (1, 120)
    finally:
        compiler.shutdown()


def test_a_request_past_the_lexer_cap_fails_alone_naming_the_limit(tokenizer):
    """One request that walks its lexer past the cap gets a GrammarError naming the limit (no
    state dump); the next request with the same grammar starts from a fresh matcher and walks."""
    compiler = GrammarCompiler(limits={"max_lexer_states": 300})
    rng = random.Random(1)
    try:
        with pytest.raises(GrammarError, match="too many states") as e:
            _walk(compiler.compile(GROWING, tokenizer, V).state(), rng, 5000)
        assert "<state>" not in str(e.value) and "\n" not in str(e.value)
        assert _walk(compiler.compile(GROWING, tokenizer, V).state(), rng, 20) == 20
    finally:
        compiler.shutdown()


def test_the_engine_ends_a_grammar_past_its_limit_as_a_bad_request(tokenizer):
    """In the middle of an answer: the request ends ``bad_request`` (400; a stream's error event
    carries that code) with the limit named, not ``internal_error`` with the engine's dump."""
    engine = LLMEngine(EngineConfig(model="tiny", page_size=16, max_total_tokens=4096))
    compiler = GrammarCompiler(limits={"max_lexer_states": 25})  # compiles within it; an answer outgrows it
    grammar = compiler.compile(GROWING, tokenizer, V)
    req = GenerateRequest("r", tuple(tokenizer.encode("hello")),
                          SamplingParams(max_tokens=2000, temperature=1.0, seed=3, ignore_eos=True), grammar=grammar)
    engine.add_request(req)
    failed = []
    for _ in range(3000):
        report = engine.step()
        failed += [out for _, out in report.failed]
        if failed or not engine.has_work():
            break
    compiler.shutdown()
    [out] = failed
    assert out.reason is Reason.BAD_REQUEST and "too many states" in out.error and "<state>" not in out.error


def test_a_plain_request_is_answered_while_a_compilation_is_held(tokenizer):
    """A compilation that never ends on its own (a seam holds it): a plain short request, and a
    request whose grammar is cached already, are both validated and answered meanwhile; the held
    one gets its grammar once released. Compiling in a lane held every request behind it."""
    entered, release = threading.Event(), threading.Event()
    plain_build = GrammarCompiler()._build

    def build(spec, lltok):
        if spec.kind == "regex":
            entered.set()
            release.wait(60)
        return plain_build(spec, lltok)

    compiler, lanes = GrammarCompiler(build=build), TokenizeLanes()
    cached = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    compiler.compile(schema_spec(SCHEMA, "s"), tokenizer, V)

    def body(**extra):
        return json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 4, **extra}}).encode()

    async def scenario():
        def validate(raw, endpoint):
            def check(tok, per):
                return validate_request(raw, endpoint, RequestContext(tokenizer=tok, vocab_size=V, grammars=compiler,
                                                                    chars_per_token=per))
            return lanes.validate(len(raw), tokenizer, check, compiler)

        held = asyncio.ensure_future(validate(body(regex="(cat|dog)"), "generate"))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        plain = await asyncio.wait_for(validate(body(), "generate"), 60)  # a hang guard, not a bound
        chat = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                           "response_format": cached}).encode()
        with_cached = await asyncio.wait_for(validate(chat, "chat"), 60)
        assert not held.done()
        release.set()
        return plain, with_cached, await asyncio.wait_for(held, 60)

    try:
        plain, with_cached, held = asyncio.run(scenario())
    finally:
        release.set()
        compiler.shutdown()
        lanes.shutdown()
    assert plain.grammar is None and with_cached.grammar is not None and held.grammar is not None
    assert compiler.compiled == 2  # the held regex, and the cached schema once


def test_a_refusal_is_remembered_by_hash_and_bounded(tokenizer):
    """A spec the engine refused (a limit, its own words, the time limit) is refused at once next
    time, without compiling; the memory keeps ``refusals`` specs, the oldest forgotten first."""
    calls = []

    def build(spec, lltok):
        calls.append(spec.schema)
        return None, f"out of fuel: {spec.schema}"

    compiler = GrammarCompiler(build=build, refusals=2)
    compiler.prepare(tokenizer, V)
    specs = [GrammarSpec("regex", r) for r in ("a", "b", "c")]
    try:
        for spec in specs[:2] * 3:
            with pytest.raises(InvalidRequest, match="out of fuel") as e:
                compiler.compile(spec, param="sampling_params.regex")
            assert e.value.param == "sampling_params.regex"
        assert calls == ["a", "b"]
        with pytest.raises(InvalidRequest):
            compiler.compile(specs[2])  # a third: "a", the oldest, is forgotten
        with pytest.raises(InvalidRequest):
            compiler.compile(specs[0])
        assert calls == ["a", "b", "c", "a"]
    finally:
        compiler.shutdown()


def test_a_compilation_past_the_time_limit_is_remembered(tokenizer):
    """The first request waits out the time limit (a 400 naming it); the next with that spec is
    refused at once, without queueing a second compilation behind the first."""
    release, calls = threading.Event(), []

    def build(spec, lltok):
        calls.append(spec)
        release.wait(60)
        return None, "released"

    compiler = GrammarCompiler(timeout_s=0.2, build=build)
    compiler.prepare(tokenizer, V)
    try:
        for _ in range(3):
            with pytest.raises(InvalidRequest, match="did not compile within 0.2s"):
                compiler.compile(GROWING)
        assert len(calls) == 1
    finally:
        release.set()
        compiler.shutdown()


def test_the_cache_is_bounded_in_bytes_and_drops_an_entry_whose_matcher_fails(tokenizer):
    failing = {"on": False}
    plain = GrammarCompiler()

    def matcher(text, lltok):
        if failing["on"]:
            raise GrammarError("too many states: 1 >= 1")
        return plain._matcher(text, lltok)

    specs = [schema_spec({"type": "string", "maxLength": n}, "s") for n in range(1, 6)]
    compiler = GrammarCompiler(cache_bytes=700, matcher=matcher)
    try:
        for spec in specs:
            compiler.compile(spec, tokenizer, V)
        assert 0 < compiler.cached_bytes <= 700 and compiler.compiled == 5
        compiler.compile(specs[-1], tokenizer, V)
        compiler.compile(specs[0], tokenizer, V)  # dropped for bytes: compiled again
        assert compiler.compiled == 6
        failing["on"] = True
        with pytest.raises(InvalidRequest, match="too many states"):
            compiler.compile(specs[0], tokenizer, V)
        failing["on"] = False
        compiler.compile(specs[0], tokenizer, V)  # dropped, so compiled anew
        assert compiler.compiled == 7
    finally:
        plain.shutdown()
        compiler.shutdown()


def test_intersected_patterns_are_refused_at_the_edge():
    """22 patterns joined by allOf (704 bytes, minutes of compilation) is a 400 naming the bound
    before anything compiles; as many patterns without allOf, or a few with it, pass."""
    patterns = [{"pattern": f"^.*a.{{{i}}}$"} for i in range(22)]
    with pytest.raises(InvalidRequest, match=f"22 regexes .* at most {MAX_INTERSECTED_PATTERNS}"):
        schema_spec({"type": "string", "allOf": patterns}, "response_format.json_schema.schema")
    schema_spec({"type": "string", "allOf": patterns[:MAX_INTERSECTED_PATTERNS]}, "s")
    schema_spec({"type": "object", "properties": {f"p{i}": {"type": "string", **p} for i, p in enumerate(patterns)}}, "s")


def test_a_grammar_past_a_limit_over_http_is_a_400_naming_it(server):
    """A schema past the grammar engine's size limit (15 joined choices of 2: 32,768 shapes): a
    400 naming the limit with no state dump, streamed or not; the worker serves the next request."""
    schema = {"allOf": [{"anyOf": [{"type": "integer", "minimum": i}, {"type": "integer", "maximum": i + 100}]}
                        for i in range(15)]}
    for stream in (False, True):
        r = requests.post(server.url + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text[:500]
        assert "<state>" not in r.text and "too large" in r.json()["error"]["message"], r.text[:500]
    r = requests.post(server.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=120)
    assert r.status_code == 200


def test_a_compilation_slowed_by_others_is_refused_for_now_never_remembered(tokenizer):
    """A schema whose compilation got a thread late (it queued behind other clients') and is still
    running at the time limit is the machine's load, not the schema's cost: a 429, and the next
    request compiles it. Wall time spent asleep is not the grammar's cost either: a compilation
    is measured in its thread's CPU time."""
    plain = GrammarCompiler()
    specs = [schema_spec({"type": "string", "maxLength": n}, "s") for n in (1, 2, 3)]

    def build(spec, lltok):
        time.sleep(0.5 if spec is not specs[2] else 0.3)  # asleep: no CPU spent (the bound is 0.1 s of CPU)
        return plain._build(spec, lltok)

    compiler = GrammarCompiler(timeout_s=0.6, slow_s=0.1, build=build)
    compiler.prepare(tokenizer, V)
    try:
        others = [threading.Thread(target=compiler.compile, args=(s,)) for s in specs[:2]]
        for t in others:
            t.start()
        time.sleep(0.05)  # both compilation threads taken for 0.5 s
        with pytest.raises(Overloaded):
            compiler.compile(specs[2])  # gets a thread at ~0.5 s, still running at 0.6 s
        for t in others:
            t.join(10)
        assert compiler.compile(specs[2]) is not None  # compiled now: nothing was remembered
        assert compiler.compile(specs[0]) is not None  # 0.5 s asleep is not 0.1 s of CPU
    finally:
        compiler.shutdown()
        plain.shutdown()
