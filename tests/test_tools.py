"""Tool calls (``tools``, ``tool_choice``, the ``tool`` role) with the official ``openai`` client on
the random tiny model: ``required`` and a named function are forced by the grammar, so even this
model calls validly; a whole round trip (call, tool message, answer) colocated and split; streamed
deltas reassemble to the unary answer's call; the parser on its own; every new field's bad values
are 400s naming the field; a template that does not render tools (``--chat-template``) is a 400."""

from __future__ import annotations

import json
import random

import pytest
import requests

from splitserve.engine.grammar import MAX_PARALLEL_TOOL_CALLS, MAX_TOOLS, parse_tools
from splitserve.engine.grammar_compiler import GrammarCompiler
from splitserve.engine.io import InvalidRequest
from splitserve.server.tool_calls import ToolCallParser, parse
from tests.cluster import Cluster

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris this week?"}]


@pytest.fixture(scope="module")
def pd(pd_cluster):
    return pd_cluster


@pytest.fixture(params=["colocated", "split"])
def url(request, server):
    return server.url if request.param == "colocated" else request.getfixturevalue("pd").url


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _valid_weather_args(arguments: str) -> dict:
    args = json.loads(arguments)
    assert set(args) == {"city", "days"} and isinstance(args["city"], str) and len(args["city"]) <= 8
    assert 1 <= args["days"] <= 7
    return args


# -- the round trip, with the openai SDK -----------------------------------------------------------


def test_round_trip_required_call_then_tool_message_then_answer(url):
    client = _client(url)
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=80, seed=3)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in ("get_weather",
                                                                                             "get_time")
    json.loads(call.function.arguments)
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}]
    answer = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=8, seed=3)
    assert answer.choices[0].finish_reason == "length" and answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content
    # the tool message reached the model: the prompt grew by the call and the result
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + 20


def test_a_named_function_is_the_one_called(url):
    out = _client(url).chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, max_tokens=80, temperature=1.0, seed=5,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and out.choices[0].finish_reason == "tool_calls"
    _valid_weather_args(call.function.arguments)


def test_streamed_deltas_reassemble_to_the_unary_call(url):
    kwargs = dict(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                  max_tokens=80, temperature=0)
    whole = _client(url).chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    chunks = [c for c in _client(url).chat.completions.create(stream=True, **kwargs) if c.choices]
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].type == "function"
    assert len(deltas) > 2 and all(d.id is None and d.function.name is None for d in deltas[1:])  # fragments
    assert {d.index for d in deltas} == {0}
    assert "".join(d.function.arguments for d in deltas) == whole.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    _valid_weather_args(whole.function.arguments)


def test_auto_leaves_the_random_model_free(server):
    out = _client(server.url).chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=16,
                                                      seed=1)
    assert out.choices[0].finish_reason == "length" and out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content


def test_none_renders_no_tools_and_parses_nothing(server):
    ask = dict(model="tiny", messages=ASK, max_tokens=4, temperature=0)
    plain = _client(server.url).chat.completions.create(**ask)
    none = _client(server.url).chat.completions.create(tools=TOOLS, tool_choice="none", **ask)
    auto = _client(server.url).chat.completions.create(tools=TOOLS, **ask)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content


# -- the edge ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tools, choice, param", [
    ("f", None, "tools"),
    ([{"type": "function"}], None, "tools[0]"),
    ([{"type": "retrieval", "function": {"name": "f"}}], None, "tools[0]"),
    ([{"type": "function", "function": {"name": "no spaces"}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "oops": 1}}], None, "tools[0].function"),
    ([{"type": "function", "function": {"name": "f", "parameters": 5}}], None, "tools[0].function.parameters"),
    ([WEATHER, WEATHER], None, "tools[1].function.name"),
    ([{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)], None, "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"enum": ["x" * 1000] * 100}}}], None,
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": f"f{i}", "parameters": {"enum": ["x" * 1000] * 10}}}
      for i in range(8)], None, "tools"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "get_stock"}}, "tool_choice"),
    (TOOLS, {"type": "function", "name": "get_time"}, "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tools_and_tool_choice_are_refused_by_field(tools, choice, param):
    with pytest.raises(InvalidRequest) as e:
        parse_tools(tools, choice, None)
    assert e.value.param == param


def test_deep_parameters_are_refused_before_any_recursion():
    deep = {}
    for _ in range(10_000):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(InvalidRequest, match="nests deeper"):
        parse_tools([{"type": "function", "function": {"name": "f", "parameters": deep}}], "auto", None)


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": ASK + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, "messages[1].tool_calls[0].function.arguments"),
    ({"messages": ASK + [{"role": "user", "content": "x", "tool_call_id": "a"}]}, "messages[1].tool_call_id"),
])
def test_bad_fields_over_http_are_400s_with_openai_bodies(url, body, param):
    r = requests.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": ASK, "max_tokens": 4, **body},
                      timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_a_template_that_does_not_render_tools_is_a_400(start_server, tmp_path, tokenizer_tiny):
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                     "{% endfor %}<|im_start|>assistant\n")
    proc = start_server("--chat-template", str(plain))
    r = requests.post(proc.url + "/v1/chat/completions",
                      json={"messages": ASK, "tools": TOOLS, "max_tokens": 4}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "does not render tools" in r.json()["error"]["message"]
    ok = requests.post(proc.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200
    # the override is the template in use: the prompt is what it renders, not what the model's does
    def tokens(**kw):
        ids = tokenizer_tiny.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True, return_dict=False, **kw)
        return len(ids)

    assert ok.json()["usage"]["prompt_tokens"] == tokens(chat_template=plain.read_text()) != tokens()


# -- the grammar and the parser on their own ----------------------------------------------------


def test_the_forced_grammar_writes_what_the_parser_reads_whatever_the_tokens(tokenizer_tiny):
    spec = parse_tools(TOOLS, "required", False)
    grammar = GrammarCompiler().compile(spec.grammar, tokenizer_tiny, 2048)
    rng = random.Random(0)
    for _ in range(5):
        state, out = grammar.state(), []
        while not state.done:
            token = rng.choice([int(t) for t in state.allowed().nonzero()[0]])
            state.advance(token)
            out.append(token)
        [call] = parse(tokenizer_tiny.decode(out), spec.names).calls
        assert call["function"]["name"] in spec.names
        json.loads(call["function"]["arguments"])


def test_a_parameters_schema_quoting_the_tool_call_tags_compiles_and_is_obeyed(tokenizer_tiny):
    """The tags written as the tokenizer's added tokens are the ones around the call; the same
    text inside a function's parameters schema (a const, an enum, a property's name) stays a JSON
    string, so the grammar compiles and the arguments hold the tags as text."""
    tagged = {"type": "function", "function": {"name": "echo", "parameters": {
        "type": "object", "properties": {"open": {"const": "<tool_call>"}, "close": {"enum": ["</tool_call>"]},
                                         "<tool_call>": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["open", "close", "<tool_call>"], "additionalProperties": False}}}
    spec = parse_tools([tagged], "required", False)
    state, out = GrammarCompiler().compile(spec.grammar, tokenizer_tiny, 2048).state(), []
    rng = random.Random(2)
    while not state.done:
        out.append(rng.choice([int(t) for t in state.allowed().nonzero()[0]]))
        state.advance(out[-1])
    text = tokenizer_tiny.decode(out)
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>"), text
    call = json.loads(text[len("<tool_call>\n"):-len("\n</tool_call>")])
    assert call["name"] == "echo" and call["arguments"]["open"] == "<tool_call>"
    assert call["arguments"]["close"] == "</tool_call>" and 0 <= call["arguments"]["<tool_call>"] <= 9
    [parsed] = parse(text, spec.names).calls  # and the answer's parser reads the call whole
    assert json.loads(parsed["function"]["arguments"]) == call["arguments"]


def test_parallel_forced_calls_end_after_a_bounded_number(tokenizer_tiny):
    """``required`` with ``parallel_tool_calls``: a model that never chooses to stop (here: a walk
    that takes any allowed token but the end) still ends, after MAX_PARALLEL_TOOL_CALLS whole calls."""
    spec = parse_tools(TOOLS, "required", True)
    state, out = GrammarCompiler().compile(spec.grammar, tokenizer_tiny, 2048).state(), []
    rng, eos = random.Random(1), tokenizer_tiny.eos_token_id
    while not state.done and len(out) < 20_000:
        allowed = [int(t) for t in state.allowed().nonzero()[0]]
        token = rng.choice([t for t in allowed if t != eos] or allowed)
        state.advance(token)
        out.append(token)
    assert state.done
    calls = parse(tokenizer_tiny.decode(out), spec.names).calls
    assert len(calls) == MAX_PARALLEL_TOOL_CALLS and all(json.loads(c["function"]["arguments"]) for c in calls)


@pytest.fixture(scope="module")
def tokenizer_tiny():
    from splitserve.models.loader import load_tokenizer
    from splitserve.testing.tiny import tiny_model_path

    return load_tokenizer(tiny_model_path())


NAMES = {"get_weather", "f"}
TEXTS = [
    "hello <world> and <tool_ not a call",
    'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}r\\"is", "n": [1, {"x": 2}]}}\n'
    '</tool_call>\n<tool_call>\n{"name":"f","arguments":{}}\n</tool_call>\n',
    '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',  # not a function of tools: text
    '<tool_call>\n{"arguments": {}, "name": "f"}\n</tool_call>',  # another key order: text
    '<tool_call>\n{"name":"f","arguments":{"a":[1,',  # cut by max_tokens
    '<tool_call>\n{"name":"f","arguments":{"a":1}}\nand then some words',  # never closed, words after
    '<tool_call>{"name":"f","arguments":{}}\n<tool_call>{"name":"get_weather","arguments":{"city":"x"}}'
    '</tool_call> done',  # the first never closed: the second opens
    '<tool_call>{"name":"f","arguments":{}, "id": 3}</tool_call>',  # a key after arguments: the call's own
    '<tool_call>{"name":"f","arguments":{}}\n</tool_ca',  # its closing tag cut by max_tokens
]


@pytest.mark.parametrize("text", TEXTS)
def test_the_parser_streamed_in_any_pieces_gives_the_whole_answer(text):
    whole = parse(text, NAMES).message()
    for size in (1, 2, 5, 13):
        p = ToolCallParser(NAMES)
        deltas = [d for i in range(0, len(text), size) for d in p.feed(text[i:i + size])] + p.finish()
        calls: dict = {}
        for d in deltas:
            for c in d.get("tool_calls", []):
                entry = calls.setdefault(c["index"], {"name": c["function"].get("name"), "arguments": ""})
                entry["arguments"] += c["function"]["arguments"]
        assert "".join(d.get("content", "") for d in deltas) == (whole["content"] or "")
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])] == \
            [(e["name"], e["arguments"]) for _, e in sorted(calls.items())]


def test_the_parser_finishes_once():
    p = ToolCallParser(NAMES)
    assert p.feed("<tool_call>\n{") == [] and p.finish() == [{"content": "<tool_call>\n{"}] and p.finish() == []


def test_the_parser_reads_calls_and_leaves_the_rest_as_text():
    assert parse(TEXTS[0], NAMES).message() == {"content": TEXTS[0]}
    two = parse(TEXTS[1], NAMES).message()
    assert two["content"] == "Sure." and [c["function"]["name"] for c in two["tool_calls"]] == ["get_weather", "f"]
    assert json.loads(two["tool_calls"][0]["function"]["arguments"])["city"] == 'Pa}r"is'
    assert parse(TEXTS[2], NAMES).message() == {"content": TEXTS[2]}
    assert parse(TEXTS[3], NAMES).message() == {"content": TEXTS[3]}
    cut = parse(TEXTS[4], NAMES).message()
    assert cut["content"] is None and cut["tool_calls"][0]["function"]["arguments"] == '{"a":[1,'


def test_a_call_never_closed_loses_none_of_the_words_after_it():
    words = parse(TEXTS[5], NAMES).message()
    assert words["content"] == "and then some words" and words["tool_calls"][0]["function"]["arguments"] == '{"a":1}'
    two = parse(TEXTS[6], NAMES).message()
    assert [c["function"]["name"] for c in two["tool_calls"]] == ["f", "get_weather"] and two["content"] == " done"
    own = parse(TEXTS[7], NAMES).message()
    assert own["content"] is None and own["tool_calls"][0]["function"]["arguments"] == "{}"
    cut = parse(TEXTS[8], NAMES).message()
    assert cut["content"] is None and [c["function"]["name"] for c in cut["tool_calls"]] == ["f"], cut


def test_n_choices_with_tools_stream_what_they_answer_whole(server):
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=12, seed=4, n=2)
    whole = _client(server.url).chat.completions.create(**kwargs)
    streamed = {0: "", 1: ""}
    for chunk in _client(server.url).chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == {c.index: c.message.content for c in whole.choices} and streamed[0] != streamed[1]
