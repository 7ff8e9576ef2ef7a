"""Structured outputs (``response_format``) on the random tiny model, whose unconstrained output is
garbage: the official ``openai`` client's ``parse`` gets an object that validates, colocated and
split (prefill samples the first token under the mask, decode rebuilds the grammar's state from
it); ``json_object`` parses; a schema the engine cannot compile, a malformed, huge or deeply nested
one is a 400 naming why; a max_tokens cut is ``finish_reason: length``; a first token the grammar
refuses is refused on decode; the compiler's cache, cap and time limit."""

from __future__ import annotations

import json
import re
import random
import threading
import time

import pytest
import requests

from splitserve.config import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.grammar import MAX_SCHEMA_DEPTH, parse_response_format, schema_spec
from splitserve.engine.grammar_compiler import GrammarCompiler
from splitserve.engine.io import GenerateRequest, InvalidRequest, Overloaded, SamplingParams
from tests.cluster import Cluster

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=99)
    kind: str = pydantic.Field(pattern="^(cat|dog)$")
    vaccinated: bool


MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]
V = 2048  # the tiny model's vocabulary
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "b": {"type": "string", "maxLength": 4}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    from splitserve.models.loader import load_tokenizer
    from splitserve.testing.tiny import tiny_model_path

    return load_tokenizer(tiny_model_path())


@pytest.fixture(scope="module")
def pd(pd_cluster):
    """The session's split cluster (its decode recomputes a room whose prefill failed)."""
    return pd_cluster


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


# -- the edge --------------------------------------------------------------------------------------


@pytest.mark.parametrize("rf, why", [
    ("json", "must be an object"),
    ({"type": "xml"}, "response_format.type must be one of"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": 5}}, "must be a JSON schema object"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict must be a boolean"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "oops": 1}}, "unrecognized field"),
    ({"type": "json_object", "schema": {}}, "unrecognized field"),
    ({"type": "json_schema", "json_schema": {"schema": {"enum": ["x" * 1000] * 100}}}, "bytes as JSON"),
])
def test_malformed_or_huge_response_formats_are_refused_by_field(rf, why):
    with pytest.raises(InvalidRequest, match=why) as e:
        parse_response_format(rf)
    assert e.value.param.startswith("response_format")


def test_a_deeply_nested_schema_is_refused_before_any_recursion():
    deep: dict = {}
    for _ in range(100_000):  # deeper than any recursion limit
        deep = {"type": "array", "items": deep}
    with pytest.raises(InvalidRequest, match=f"deeper than {MAX_SCHEMA_DEPTH}"):
        schema_spec(deep, "response_format.json_schema.schema")


def test_compiler_names_why_and_caches_bounded(tokenizer):
    compiler = GrammarCompiler()
    bad = schema_spec({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "s")
    with pytest.raises(InvalidRequest, match="cannot be compiled.*nowhere"):
        compiler.compile(bad, tokenizer, V)
    with pytest.raises(InvalidRequest, match="cannot be compiled.*nowhere"):  # the refusal is cached too
        compiler.compile(bad, tokenizer, V)
    good = schema_spec(SCHEMA, "s")
    assert compiler.compile(good, tokenizer, V) is not compiler.compile(good, tokenizer, V)  # one each
    assert (compiler.compiled, compiler.cache_hits, compiler.matchers_built) == (2, 2, 2)
    small = GrammarCompiler(cache_entries=1)  # bounded: the least recently used goes
    small.compile(good, tokenizer, V)
    small.compile(schema_spec({"type": "string", "maxLength": 3}, "s"), tokenizer, V)
    small.compile(good, tokenizer, V)
    assert small.compiled == 3 and small.cache_hits == 0
    compiler.shutdown(), small.shutdown()


def test_a_slow_compilation_is_cut_by_the_time_limit_and_holds_its_slot(tokenizer):
    """A compilation past its limit is a 400; it keeps its slot while it still runs, so the next
    request (cap 1) finds none free: runaway compilations cannot pile up."""
    release = threading.Event()

    def slow(spec, lltok):
        release.wait(30)
        return None, "released"

    compiler = GrammarCompiler(timeout_s=0.3, max_concurrent=1, build=slow)
    try:
        with pytest.raises(InvalidRequest, match="did not compile within 0.3s"):
            compiler.compile(schema_spec(SCHEMA, "s"), tokenizer, V)
        with pytest.raises(Overloaded, match="thread stayed busy"):
            compiler.compile(schema_spec({"type": "string"}, "s"), tokenizer, V)
    finally:
        release.set()
        compiler.shutdown()


# -- the engine ------------------------------------------------------------------------------------


def test_decode_refuses_a_first_token_the_grammar_forbids(tokenizer):
    engine = LLMEngine(EngineConfig(model="tiny", page_size=16, max_total_tokens=512))
    compiler = GrammarCompiler()
    grammar = compiler.compile(schema_spec(SCHEMA, "s"), tokenizer, V)
    prompt = tuple(tokenizer.encode("hello"))
    req = GenerateRequest("r", prompt, SamplingParams(max_tokens=8, temperature=0), grammar=grammar)
    letter = tokenizer.encode("x")[0]  # a JSON object cannot start with it
    with pytest.raises(InvalidRequest, match="grammar does not allow"):
        engine.start_decoding(req, [0], letter)
    seq, outs = engine.start_decoding(req, [0], tokenizer.encode("{")[0])
    assert seq.grammar is not None and outs[0].text == "{"
    compiler.shutdown()


# -- over HTTP, with the openai client -------------------------------------------------------------


def _parse_pets(url: str, seeds=(0,)) -> list[Pet]:
    client = _client(url)
    pets = []
    for seed in seeds:
        out = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Pet, max_tokens=120,
                                            seed=seed, temperature=1.0)
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice
        pets.append(choice.message.parsed)
        assert isinstance(pets[-1], Pet) and pets[-1] == Pet.model_validate_json(choice.message.content)
        assert list(json.loads(choice.message.content)) == list(Pet.model_fields)  # the schema's key order
    return pets


def test_unconstrained_output_of_the_tiny_model_is_not_json(server):
    """The proof that the mask does the work: the same request without it is garbage."""
    out = _client(server.url).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, seed=0)
    with pytest.raises(ValueError):
        json.loads(out.choices[0].message.content)


def test_parse_returns_a_valid_object_colocated(server):
    assert _parse_pets(server.url)


def test_parse_returns_a_valid_object_split(pd):
    pets = _parse_pets(pd.url)
    pets += _parse_pets(pd.decode[0].url)  # decode alone: the prompt computed there, a fresh grammar
    pd.assert_no_leaks()
    greedy = _client(pd.url).chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Pet,
                                                    max_tokens=120, temperature=0).choices[0]
    assert greedy.finish_reason == "stop" and isinstance(greedy.message.parsed, Pet) and len(pets) == 2


def test_n_choices_each_parse_colocated_and_split(server, pd):
    """n = 2 with a schema: each choice has its own grammar state (choice 0's first token is
    prefill's, the other forks on decode): every choice parses, and the split answers what a
    colocated worker does."""
    answers = []
    for url in (server.url, pd.url):
        out = _client(url).chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Pet, n=2,
                                                  max_tokens=120, seed=3, temperature=1.0)
        assert [c.index for c in out.choices] == [0, 1]
        for c in out.choices:
            assert c.finish_reason == "stop" and isinstance(c.message.parsed, Pet), c
        answers.append([c.message.content for c in out.choices])
    assert answers[0] == answers[1] and len(set(answers[0])) > 1


def test_decode_recomputing_a_lost_prefill_answers_valid_json(pd):
    """Decode's leg alone, its prefill never asked: the router's word that the prefill failed makes
    decode compute the prompt itself (docs/lifecycle.md, the fallback), with a fresh grammar."""
    decode, prefill = pd.decode[0], pd.prefill[0]
    rid = f"lost-{random.getrandbits(32)}"
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 120, "seed": 5, "rid": rid,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": random.getrandbits(62),
            "response_format": {"type": "json_schema", "json_schema": {"name": "pet",
                                                                       "schema": Pet.model_json_schema()}}}
    box = {}
    leg = threading.Thread(target=lambda: box.setdefault("r", requests.post(
        decode.url + "/v1/chat/completions", json=body, timeout=120)))
    leg.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = requests.get(decode.url + f"/debug/requests/{rid}", timeout=10)
        if r.status_code == 200 and r.json()["steps"][-1]["state"] == "AWAITING_KV":
            break
        time.sleep(0.1)
    r = requests.post(decode.url + "/abort_request", json={"rid": rid, "reason": "prefill_failed"}, timeout=30)
    assert r.json() == {"found": True}, r.text
    leg.join(120)
    assert box["r"].status_code == 200, box["r"].text
    choice = box["r"].json()["choices"][0]
    assert choice["finish_reason"] == "stop" and Pet.model_validate_json(choice["message"]["content"])
    states = [s["state"] for s in requests.get(decode.url + f"/debug/requests/{rid}", timeout=10).json()["steps"]]
    assert "PREFILLING" in states and "AWAITING_KV" in states, states
    pd.assert_no_leaks()


@pytest.mark.parametrize("where", ["colocated", "split"])
def test_json_object_on_completions_parses_and_a_cut_is_length(where, server, request):
    url = server.url if where == "colocated" else request.getfixturevalue("pd").url
    r = requests.post(url + "/v1/completions", json={
        "model": "tiny", "prompt": "JSON:", "max_tokens": 200, "seed": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}},
        timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    obj = json.loads(choice["text"])
    assert choice["finish_reason"] == "stop" and set(obj) == {"a", "b"} and 0 <= obj["a"] <= 9
    r = requests.post(url + "/v1/completions", json={
        "model": "tiny", "prompt": "JSON:", "max_tokens": 3, "seed": 3, "response_format": {"type": "json_object"}},
        timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["choices"][0]["text"].startswith("{")


def test_a_schema_the_engine_cannot_compile_is_a_400_naming_why(server, pd):
    for url in (server.url, pd.url):
        with pytest.raises(openai.BadRequestError) as e:
            _client(url).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/definitions/missing"}}})
        assert "cannot be compiled" in str(e.value) and "missing" in str(e.value)
        assert e.value.body["param"] == "response_format"


def test_sglang_generate_takes_a_regex_and_a_json_schema_string(server):
    def gen(sp):
        return requests.post(server.url + "/generate", json={"text": "Pet:", "sampling_params": {
            "max_new_tokens": 40, "temperature": 1.0, "sampling_seed": 4, **sp}}, timeout=120)

    r = gen({"regex": "(cat|dog)-[0-9]{2}"})
    assert r.status_code == 200, r.text
    assert re.fullmatch("(cat|dog)-[0-9]{2}", r.json()["text"]), r.json()["text"]
    r = gen({"json_schema": json.dumps(SCHEMA)})
    assert r.status_code == 200 and set(json.loads(r.json()["text"])) == {"a", "b"}, r.text
    for sp, param in (({"regex": "("}, "sampling_params.regex"), ({"json_schema": "{"}, "sampling_params.json_schema"),
                      ({"regex": "a", "json_schema": "{}"}, "sampling_params.regex")):
        r = gen(sp)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text



@pytest.mark.long
def test_smollm2_parse_returns_a_valid_object_colocated_and_split(monkeypatch):
    """The demo model, a real tokenizer of 49,152 tokens: ``parse`` on a colocated worker and on
    1 prefill + 1 decode behind the router."""
    from conftest import ServerProcess, free_port

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    small_pool = ("--max-total-tokens", "2048")
    colocated = ServerProcess(*small_pool, model="smollm2")
    colocated._spawn(free_port())  # loads while the cluster starts
    try:
        with Cluster(1, 1, "nixl", model="smollm2", worker_args=small_pool) as split:
            colocated.wait_ready()
            for url in (colocated.url, split.url):
                for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 1}):
                    out = _client(url).chat.completions.parse(
                        model="smollm2", messages=[{"role": "user", "content": "Describe a pet dog as JSON."}],
                        response_format=Pet, max_tokens=120, **sampling)
                    assert out.choices[0].finish_reason == "stop" and isinstance(out.choices[0].message.parsed, Pet)
                    print(f"\n{url} {sampling}: {out.choices[0].message.content}")
            split.assert_no_leaks()
    finally:
        colocated.stop()


def test_absurd_schemas_over_http_are_4xx_and_the_server_serves_on(server):
    """A 10 MB schema and a schema nested 10,000 deep: refused with an OpenAI error body (413 for a
    body over the size cap, 400 otherwise), never a stalled loop; the next request is served."""
    deep = "{}"
    for _ in range(10_000):
        deep = '{"type":"array","items":' + deep + "}"
    huge = json.dumps({"enum": ["x" * 1000] * 10_000})
    for schema in (huge, deep):
        body = ('{"model":"tiny","messages":[{"role":"user","content":"hi"}],"max_tokens":4,'
                '"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":' + schema + "}}}")
        r = requests.post(server.url + "/v1/chat/completions", data=body,
                          headers={"Content-Type": "application/json"}, timeout=120)
        assert r.status_code in (400, 413) and "error" in r.json(), r.text[:300]
    r = requests.post(server.url + "/v1/chat/completions", json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": 4, "response_format": {"type": "json_object"}}, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("{")


def test_a_streamed_structured_answer_parses_when_joined(pd):
    stream = _client(pd.url).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=120, seed=9, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": Pet.model_json_schema()}})
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop" and Pet.model_validate_json(text)
