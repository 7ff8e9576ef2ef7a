"""A continuation: the rest of a streamed answer, served from the token ids already streamed.

Checked against the session's tiny-model worker (unkeyed: it takes the router's fields from
anyone): with ``stream_ids`` each event carries its ids in an ``: ids`` comment and nothing else
changes; a request R is streamed, cut after its first K events for many K (a multi-byte
character's tokens and a held-back stop-string prefix among the cuts), and the continuation built
from those events' ids gives the rest: the first K events' text and the continuation's concatenate
to R's, with R's token ids, finish reasons and usage, the same id and created, and no role chunk.
Greedy, seeded, penalties, ``n`` = 2 with a choice finished before the cut, a ``json_schema``,
tools. The engine-level checks run in process; the bounds are 400s naming the field.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from helpers.streamed_answers import Answer, continuation_of, events_of, post, stream
from splitserve.engine.continuation import Continuation, parse_continuation
from splitserve.engine.io import GenerateRequest, InvalidRequest, SamplingParams

PROMPT = "Once upon a time, in a land far away, there lived"


# -- a stream cut and continued ------------------------------------------------------------------


def check_cuts(server, path: str, body: dict, cuts=None, tokenizer=None, to=None) -> Answer:
    """R streamed with stream_ids; for each cut after a token-carrying event (every one, or
    ``cuts``), R's head plus the continuation's answer is R's answer. With ``tokenizer``, counts
    in ``full.held`` the cuts whose ids decode to more than the client was sent (a partial
    character, a stop string's prefix held back). ``to``: the worker the continuations go to
    (``server`` itself when None)."""
    body = {**body, "stream_ids": True, "stream_options": {"include_usage": True}}
    events = stream(server, path, body)
    full = Answer(events)
    assert full.chunk_ids and len(full.created) == 1
    ends = full.carrying[1:] + [len(events)]  # a delta's events are one write: cut before the next ids
    full.held = 0
    for cut in (ends[:-1] if cuts is None else [ends[c] for c in cuts if c < len(ends)]):
        cont, head = continuation_of(events, cut, body.get("n", 1))
        if tokenizer is not None:
            full.held += tokenizer.decode(head.ids.get(0, [])) != head.text.get(0, "")
        if not cont["choices"]:
            continue
        rest = Answer(stream(to or server, path, {**body, "continuation": cont}))
        assert rest.roles == 0 and rest.chunk_ids == full.chunk_ids and rest.created == full.created
        assert rest.usage == full.usage, cut
        for i in full.text:
            if i in head.finish:
                assert i not in rest.text
                continue
            assert head.text.get(i, "") + rest.text.get(i, "") == full.text[i], (cut, i)
            assert head.ids.get(i, []) + rest.ids.get(i, []) == full.ids[i], (cut, i)
            assert rest.finish[i] == full.finish[i]
        calls = {**head.calls}
        for key, (name, args) in rest.calls.items():
            got = calls.setdefault(key, ["", ""])
            got[0], got[1] = got[0] + name, got[1] + args
        assert calls == full.calls, cut
        for i, (tokens, lps, offsets) in full.lps.items():
            h, r = head.lps.get(i, ([], [], [])), rest.lps.get(i, ([], [], []))
            assert h[0] + r[0] == tokens and h[2] + r[2] == offsets, (cut, i)
            assert h[1] + r[1] == pytest.approx(lps, abs=1e-3), (cut, i)
    return full


# -- through the worker -------------------------------------------------------------------------


def test_stream_ids_add_only_comment_lines(server):
    """With stream_ids the events are the same data, each token-carrying one after an `: ids`
    line whose ids are the answer's, in order; without it no comment at all."""
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}
    plain = post(server, "/v1/completions", body).text
    marked = post(server, "/v1/completions", {**body, "stream_ids": True}).text
    assert ": " not in "".join(line[:2] for line in plain.split("\n"))
    stripped = "\n".join(line for line in marked.split("\n") if not line.startswith(": "))
    strip_created = lambda s: [(c, {**d, "created": 0, "id": ""} if isinstance(d, dict) else d) for c, d in events_of(s)]
    assert strip_created(stripped) == strip_created(plain)
    full = Answer(events_of(marked))
    assert len(full.ids[0]) == 6 and all(events_of(marked)[k][0] for k in full.carrying)


def test_greedy_completion_continues_at_every_cut(server):
    """Greedy, every cut (12 tokens: each cut costs the rest of the answer again)."""
    full = check_cuts(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0})
    assert full.finish[0] == "length"


def test_cut_inside_a_multibyte_character(server):
    """An answer with characters of several tokens (an event naming several ids: the first had no
    text of its own): a decode lost between them had sent none of them, and every cut concatenates."""
    body = {"prompt": "Ünïcödé: 日本語の文章と 中文的句子, ελληνικά", "max_tokens": 16, "temperature": 1.0, "seed": 1}
    full = check_cuts(server, "/v1/completions", body)
    assert full.multi > 0


def test_stop_string_across_the_cut(server, tiny_engine):
    """A stop string whose prefix is held back across events: the cuts inside it continue to the
    same stop."""
    base = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    text = Answer(stream(server, "/v1/completions", {**base, "stream_ids": True})).text[0]
    stop = text[8:14]
    full = check_cuts(server, "/v1/completions", {**base, "stop": [stop, text[2:5] + "\x01"]},
                      tokenizer=tiny_engine.tokenizer)
    assert full.held > 0 and full.finish[0] == "stop" and full.text[0] == text[:text.index(stop)]


def test_seeded_chat_with_penalties_continues(server):
    """Seeded chat with frequency and presence penalties, cut after its first and fourth events."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 1.0, "seed": 5,
            "frequency_penalty": 1.2, "presence_penalty": 0.6}
    check_cuts(server, "/v1/chat/completions", body, cuts=[0, 3])


def test_n_2_with_a_choice_finished_before_the_cut(server):
    """n = 2, one choice ended by a stop string before the other: cuts before and after its end;
    after it the continuation carries the other choice only, and usage still counts both."""
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": 9, "n": 2}
    texts = Answer(stream(server, "/v1/completions", {**body, "stream_ids": True})).text
    full = check_cuts(server, "/v1/completions", {**body, "stop": [texts[1][4:8]]}, cuts=[1, 5, 12, 16, 20])
    assert len(full.text) == 2 and full.finish[1] == "stop" and len(full.ids[1]) < len(full.ids[0])


def test_json_schema_continues(server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    body = {"messages": [{"role": "user", "content": "A person as JSON"}], "max_tokens": 40, "temperature": 1.0,
            "seed": 2, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}
    full = check_cuts(server, "/v1/chat/completions", body, cuts=[0, 4, 10])
    json.loads(full.text[0]) if full.finish[0] == "stop" else None


def test_a_continuation_refused_is_a_400_naming_its_field(server):
    body = {"prompt": PROMPT, "max_tokens": 4, "stream": True}
    good = {"id": "cmpl-x", "created": 1, "choices": [{"index": 0, "ids": [5]}]}
    for bad, param in [({**good, "id": "chatcmpl-x"}, "continuation.id"),
                       ({**good, "choices": [{"index": 0, "ids": [5] * 5}]}, "continuation.choices[0].ids"),
                       ({**good, "choices": [{"index": 0, "ids": [1 << 20]}]}, "continuation.choices[0].ids"),
                       ({**good, "choices": [{"index": 1, "ids": []}]}, "continuation.choices[0].index"),
                       ({**good, "created": "now"}, "continuation.created"),
                       ({**good, "finished_tokens": 1}, "continuation.finished_tokens"),
                       ({**good, "choices": [{"index": 0, "ids": [2, 5]}]}, "continuation.choices")]:  # after eos
        r = post(server, "/v1/completions", {**body, "continuation": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
    r = post(server, "/v1/completions", {**body, "stream": False, "continuation": good})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continuation"


# -- in process ---------------------------------------------------------------------------------


def _run(engine, req) -> list:
    engine.add_request(req)
    outs = []
    while engine.has_work():
        outs += engine.step().outputs
    return outs


def test_engine_replays_without_a_delta_and_frees_every_page(tiny_engine):
    """A continuation's first delta is its first new token; the ids it was given count in
    completion_tokens; pages all come back."""
    prompt = tuple(tiny_engine.tokenizer.encode(PROMPT))
    sp = SamplingParams(max_tokens=6, temperature=1.0, seed=4, frequency_penalty=1.0)
    full = _run(tiny_engine, GenerateRequest("a", prompt, sp))
    ids = [t for o in full for t in o.token_ids]
    rest = _run(tiny_engine, GenerateRequest("b", prompt, sp, continuation=Continuation("cmpl-b", 0, ((0, tuple(ids[:4])),))))
    assert [t for o in rest for t in o.token_ids] == ids[4:]
    assert rest[-1].completion_tokens == 6 and rest[-1].finish_reason == "length"
    s = tiny_engine.stats()
    assert s.pages_owned == 0 and not tiny_engine.live_sequences()


def test_engine_refuses_ids_that_end_the_choice_before_their_last(tiny_engine):
    """(Ids whose last ends the choice end it: ``test_continuation_ends.py``.)"""
    prompt = tuple(tiny_engine.tokenizer.encode(PROMPT))
    eos = tiny_engine.spec.eos_token_ids[0]
    req = GenerateRequest("c", prompt, SamplingParams(max_tokens=4),
                          continuation=Continuation("cmpl-c", 0, ((0, (eos, 5)),)))
    with pytest.raises(InvalidRequest):
        tiny_engine.add_request(req)
    assert not tiny_engine.live_sequences()


def test_parse_bounds():
    ok = {"id": "chatcmpl-r", "created": 3, "choices": [{"index": 1, "ids": [1, 2]}], "finished_tokens": 4}
    c = parse_continuation(ok, "chat", stream=True, n=2, max_tokens=4, vocab_size=10)
    assert c.rid == "r" and c.choices == ((1, (1, 2)),) and c.finished_tokens == 4
    for bad in [{**ok, "choices": []}, {**ok, "choices": [{"index": 1, "ids": [1]}] * 2}, {**ok, "extra": 1},
                {**ok, "finished_tokens": 5}, {**ok, "created": True}]:
        with pytest.raises(InvalidRequest):
            parse_continuation(bad, "chat", stream=True, n=2, max_tokens=4, vocab_size=10)
    with pytest.raises(InvalidRequest):
        parse_continuation(ok, "generate", stream=True, n=2, max_tokens=4, vocab_size=10)


def test_keepalive_comes_while_a_stream_is_quiet():
    """A quiet stream yields None (a keep-alive) until its next delta; the deltas all come."""
    from splitserve.server.generation import _keepalive

    async def main():
        gate = asyncio.Event()

        async def deltas():
            yield 1
            await gate.wait()
            yield 2

        got = []
        async for x in _keepalive(deltas(), 0.001):
            got.append(x)
            if x is None:
                gate.set()
        return got

    got = asyncio.run(main())
    assert got[0] == 1 and got[-1] == 2 and None in got


@pytest.mark.parametrize("config, key, refused", [
    ({"api_key": "client-key", "worker_api_key": "worker-key"}, "client-key", True),
    ({"api_key": "client-key", "worker_api_key": "worker-key"}, "worker-key", False),
    ({}, None, False),  # an unkeyed worker takes them from anyone (docs/security.md)
])
def test_the_router_fields_need_the_worker_key_where_one_is_set(byte_tokenizer, config, key, refused):
    """stream_ids and continuation: 403 from a client's key where the router's key is set; taken
    from the router's key, and by an unkeyed worker from anyone (the ids come as comments)."""
    from aiohttp.test_utils import TestClient, TestServer
    from helpers.fake_engine import FullFakeEngine

    from splitserve.config import ServerConfig
    from splitserve.server.app import create_app

    app = create_app(FullFakeEngine(byte_tokenizer), ServerConfig(**config))
    cont = {"id": "cmpl-q", "created": 1, "choices": [{"index": 0, "ids": [5]}]}

    async def main():
        async with TestClient(TestServer(app)) as client:
            for fields in ({"stream_ids": True}, {"continuation": cont}):
                r = await client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"} if key else {},
                                      json={"prompt": [5, 6, 7], "max_tokens": 2, "stream": True, **fields})
                text = await r.text()
                if refused:
                    assert r.status == 403 and json.loads(text)["error"]["code"] == "router_field_not_allowed"
                else:
                    assert r.status == 200 and ("stream_ids" not in fields or "\n: ids 0 " in "\n" + text), text
    asyncio.run(main())


def test_a_forced_tool_call_continues_whole(server):
    """A forced call cut inside its arguments: the parser resumed from the replayed text, the
    call's name and arguments are the undisturbed ones, finish_reason tool_calls."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}}}
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 40, "temperature": 1.0,
            "seed": 3, "tools": [weather], "tool_choice": "required", "parallel_tool_calls": False}
    full = check_cuts(server, "/v1/chat/completions", body, cuts=[0, 3, 6, 10])
    assert full.finish[0] == "tool_calls" and full.calls[(0, 0)][0] == "get_weather"


def test_logprobs_and_echo_continue_with_their_offsets(server):
    """Completions with echo and logprobs: the continuation echoes nothing, and its tokens,
    logprobs and text offsets go on from the client's."""
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 8, "logprobs": 2, "echo": True}
    full = check_cuts(server, "/v1/completions", body, cuts=[0, 2, 6])
    assert len(full.lps[0][0]) > 10


def test_a_decode_worker_alone_continues_a_colocated_answer(server, pd_cluster):
    """R served by the colocated worker, continued on the split cluster's decode worker (decode
    alone: its own local room computes prompt and ids): greedy and n = 2 seeded."""
    decode = pd_cluster.decode[0]
    check_cuts(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0},
               cuts=[0, 4, 9], to=decode)
    check_cuts(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
                                                "temperature": 1.0, "seed": 6, "n": 2}, cuts=[1, 6], to=decode)
