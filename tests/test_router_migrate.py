"""A decode lost after the client's answer began is continued on another decode worker
(``splitserve/router/migrate.py``, ``attempts.Attempts.after``, ``docs/router.md``):

- :class:`StreamTrack` drops every SSE comment and keeps decode's ids, at every cut of the bytes;
- through the real router process, in front of fake decode workers that speak the wire (``: ids``
  comments when asked with ``stream_ids``; a body with ``continuation`` streams the rest): a
  stream whose decode closes its connection, goes silent past ``--stream-stall-s`` or ends with a
  worker's error reaches the client as one uninterrupted stream, with the ids it had sent named in
  the continuation; a request's own error, no other decode left, and ``--max-migrations 0`` are
  not continued; a whole answer whose decode broke or left rotation is sent again whole;
- real processes (``make check-long``): a decode SIGKILLed mid-stream, continued with the tokens
  of an undisturbed run.

The fakes are ``test_router``'s (real sockets in a thread of this process).
"""

from __future__ import annotations

import asyncio
import json
from typing import Optional

import pytest
import requests
from aiohttp import web

from cluster import Cluster, RouterProcess, pages_back_to_total
from helpers.fake_workers import MODEL, reply, sse
from helpers.fake_workers import fake_loop, fakes  # noqa: F401 (fixtures)
from helpers.router_fixture import start_router  # noqa: F401 (a fixture)
from helpers.sse import sse_events
from helpers.waiting import wait_for

from splitserve.router.migrate import MAX_IDS, StreamTrack

TOTAL = 6  # tokens of every fake answer
CREATED = 1700000000
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8"}
BOOTSTRAP = {"bootstrap_host", "bootstrap_port", "bootstrap_room"}


def event(i: int, rid: str = "cmpl-wire", created: int = CREATED) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": MODEL,
            "choices": [{"index": 0, "text": f" t{i}", "finish_reason": "length" if i == TOTAL - 1 else None}]}


def wire_decoder(cut: Optional[int] = None, how: str = "close"):
    """A decode worker of the wire: token ``i`` has id ``100 + i`` (named in a ``: ids`` comment,
    cut in two writes, when the body asks ``stream_ids``); a keep-alive comment after token 1. A
    body with ``continuation`` streams the tokens after the ids it names, with its id and created.
    An original leg is lost before token ``cut``: ``close`` (the connection), ``silent`` (until
    the test ends) or ``error:CODE`` (an error event and ``[DONE]``)."""
    async def behaviour(fake, request, body):
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        cont = body.get("continuation")
        start = len(cont["choices"][0]["ids"]) if cont else 0
        rid, created = (cont["id"], cont["created"]) if cont else ("cmpl-wire", CREATED)
        for i in range(start, TOTAL):
            if cont is None and i == cut:
                return await lose(fake, request, resp, how)
            if body.get("stream_ids"):
                await resp.write(b": id")
                await asyncio.sleep(0.005)
                await resp.write(f"s 0 {100 + i}\n".encode())
            await resp.write(f"data: {json.dumps(event(i, rid, created))}\n\n".encode())
            if i == 1 and body.get("stream_ids"):
                await resp.write(b": keepalive\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    return behaviour


async def lose(fake, request, resp, how: str):
    if how == "close":
        await asyncio.sleep(0.05)  # what was written reaches the router first
        request.transport.close()
        await asyncio.sleep(1)
    elif how == "silent":
        await fake.release.wait()
    else:
        code = how.split(":", 1)[1]
        error = {"error": {"message": "lost", "type": "x", "param": None, "code": code}}
        await resp.write(f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
    return resp


def texts(events: list) -> list[str]:
    return [e["choices"][0]["text"] for e in events if isinstance(e, dict) and "choices" in e]


def migrations(router: RouterProcess) -> dict:
    return {dict(labels)["reason"]: v for (name, labels), v in router.metrics().items()
            if name == "splitserve_router_migrations_total" and v}


def retried(router: RouterProcess) -> dict:
    return {dict(labels)["role"] + ":" + dict(labels)["cause"]: v for (name, labels), v in router.metrics().items()
            if name == "splitserve_router_retries_total" and v}


def decodes_up(router: RouterProcess, *decodes) -> None:
    """Until the router counts every one of ``decodes`` healthy."""
    for w in decodes:
        wait_for("both decode workers up",
                 lambda: router.metric("splitserve_router_worker_healthy", role="decode", url=w.url) == 1, 30)


def stream(router: RouterProcess, rid: str) -> tuple[bytes, list]:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": TOTAL, "stream": True}
    with requests.post(router.url + "/v1/completions", json=body, headers={"X-Request-Id": rid}, timeout=60,
                       stream=True) as resp:
        assert resp.status_code == 200, resp.text
        raw = resp.raw.read()
    return raw, sse_events(raw)


# -- the track, at every cut ----------------------------------------------------------------------


def wire_bytes() -> tuple[bytes, bytes]:
    """Decode's bytes (comments, a keep-alive, three events, [DONE]) and what the client is to get."""
    client = b"".join(f"data: {json.dumps(event(i))}\n\n".encode() for i in range(3))
    wire = b": keepalive\n\n" + b"".join(f": ids 0 {100 + i} {200 + i}\r\ndata: {json.dumps(event(i))}\n\n".encode()
                                         for i in range(3)) + b": keepalive\n\n" + b"data: [DONE]\n\n"
    return wire, client


def test_the_track_drops_every_comment_and_keeps_the_ids_at_every_cut():
    """Fed in two pieces cut at every byte (and byte by byte), the client's bytes are decode's
    without a comment line or the blank line of a comment-only block; the ids, id and created are
    kept; ``[DONE]`` is held back; ids whose event has not passed yet are not counted."""
    wire, client = wire_bytes()
    pieces = [[wire[:cut], wire[cut:]] for cut in range(len(wire) + 1)] + [[wire[i:i + 1] for i in range(len(wire))]]
    for chunks in pieces:
        track = StreamTrack(1)
        out = b"".join(track.feed(c) for c in chunks) + track.flush()
        assert out == client, chunks
        assert track.held == b"data: [DONE]\n\n" and track.error_code is None
        assert track.ids == {0: [100, 200, 101, 201, 102, 202]} and (track.id, track.created) == ("cmpl-wire", CREATED)
    track = StreamTrack(1)
    track.feed(wire[:wire.index(b"data: {", wire.index(b": ids 0 101"))])  # event 1's ids, not yet its event
    assert track.ids == {0: [100, 200]}
    assert track.continuation() == {"id": "cmpl-wire", "created": CREATED, "choices": [{"index": 0, "ids": [100, 200]}],
                                    "finished_tokens": 0}


def test_the_track_names_only_unfinished_choices_and_refuses_what_it_cannot_read():
    """``n`` = 2 with choice 1 finished: the continuation carries choice 0 only; a malformed ids
    line or a choice index out of range leaves nothing to continue from; the worker's error event
    is held with its code."""
    track = StreamTrack(2)
    done = {**event(0), "choices": [{"index": 1, "text": "x", "finish_reason": "stop"}]}
    track.feed(b": ids 0 5\n" + f"data: {json.dumps(event(0))}\n\n".encode()
               + b": ids 1 7\n" + f"data: {json.dumps(done)}\n\n".encode()
               + b'data: {"error": {"code": "loop_stalled"}}\n\n')
    assert track.continuation()["choices"] == [{"index": 0, "ids": [5]}]
    assert track.continuation()["finished_tokens"] == 1
    assert track.error_code == "loop_stalled" and track.held.startswith(b'data: {"error"')
    track.feed(b"data: x\n" * 20000)  # after the error event: kept, bounded
    assert len(track.held) < 100 << 10
    for bad in (b": ids 0 x\n", b": ids 2 1\n", b": ids 0 -1\n", b": ids 0 2147483648\n"):
        track = StreamTrack(2)
        track.feed(f"data: {json.dumps(event(0))}\n\n".encode() + bad)
        assert track.continuation() is None, bad


def test_ids_waiting_for_their_event_count_toward_the_bound():
    """A worker that sends ids lines without the events they belong to holds no more than
    ``MAX_IDS`` of them: past it the stream cannot be continued and what was kept is let go."""
    track = StreamTrack(1)
    track.feed(f"data: {json.dumps(event(0))}\n\n".encode())
    line = b": ids 0 " + b" ".join([b"7"] * (MAX_IDS // 4)) + b"\n"
    for _ in range(4):
        track.feed(line)
    assert not track.bad
    track.feed(b": ids 0 7\n")
    assert track.bad and not track.ids
    track.feed(line + f"data: {json.dumps(event(0))}\n\n".encode())
    assert track.continuation() is None and not track.ids


# -- through the router ---------------------------------------------------------------------------


@pytest.mark.parametrize("how, reason", [("close", "broken"), ("silent", "stalled"),
                                         ("error:not_ready", "worker_error"),
                                         ("error:peer_failed", "worker_error")])
def test_a_stream_whose_decode_is_lost_is_continued_on_another(how, reason, fakes, start_router):
    """Decode lost after 3 tokens reached the client: the client gets one stream of all 6 tokens
    with one id and created, no comment and one [DONE]; the other decode got the continuation
    (the 3 ids, the id and created; no bootstrap fields; decode alone); the lost leg was closed;
    counted once by reason, not as a retry; the request's record names both legs."""
    decoder = wire_decoder(cut=3, how=how)
    first, second = fakes(decoder), fakes(decoder)
    router = start_router([(fakes(sse([])).url, 1)], [first.url, second.url], "--max-migrations", "2",
                          "--stream-stall-s", "1", "--pd-threshold-tokens", "0")
    decodes_up(router, first, second)
    raw, events = stream(router, f"lost-{reason}")
    assert texts(events) == [f" t{i}" for i in range(TOTAL)], raw
    assert {(e["id"], e["created"]) for e in events[:-1]} == {("cmpl-wire", CREATED)}
    assert events[-1] == "[DONE]" and raw.count(b"[DONE]") == 1
    assert not any(line.startswith(b":") for line in raw.split(b"\n")) and b"\n\n\n" not in raw, raw
    legs = first.requests + second.requests
    assert len(legs) == 2 and legs[0][1]["stream_ids"] is True
    cont = legs[1][1]
    assert cont["continuation"] == {"id": "cmpl-wire", "created": CREATED, "finished_tokens": 0,
                                    "choices": [{"index": 0, "ids": [100, 101, 102]}]}, cont
    assert cont["stream_ids"] is True and not BOOTSTRAP & set(cont)
    lost = first if "continuation" not in first.requests[0][1] else second
    assert how.startswith("error") or lost.aborted.wait(10)  # the abandoned leg was closed (if still open)
    assert migrations(router) == {reason: 1} and retried(router) == {}
    assert router.metric("splitserve_router_requests_total", outcome="finished") == 1
    record = requests.get(f"{router.url}/debug/requests/lost-{reason}", timeout=10).json()["router"]
    attempts = record["attempts"]
    assert len(attempts) == 2 and attempts[1]["prefill"] is None and reason in attempts[0]["failed"], attempts
    assert record["status"] == 200 and record["outcome"] == "finished", record


def test_what_is_not_continued_ends_as_before(fakes, start_router):
    """The request's own error event passes to the client as it came; with every decode lost the
    client gets an error event and [DONE] after what it had (one migration, then none left); with
    ``--max-migrations 0`` no leg is asked for ids and nothing is continued, and a
    decode silent past ``--stream-stall-s`` ends the stream with an error event (its leg closed);
    a client's own ``stream_ids`` and ``continuation`` never reach a worker."""
    own = wire_decoder(cut=2, how="error:grammar_exhausted")
    a, b = fakes(own), fakes(own)
    router, off = start_router.together(
        ([(fakes(sse([])).url, 1)], [a.url, b.url], "--max-migrations", "2", "--pd-threshold-tokens", "100000"),
        ([(fakes(sse([])).url, 1)], [a.url], "--pd-threshold-tokens", "100000", "--stream-stall-s", "1",
         "--max-migrations", "0"))
    decodes_up(router, a, b)
    raw, events = stream(router, "own")
    assert texts(events) == [" t0", " t1"] and events[2]["error"]["code"] == "grammar_exhausted", raw
    assert events[-1] == "[DONE]" and len(a.requests) + len(b.requests) == 1

    for w in (a, b):  # every leg is lost, the continuation's too
        w.reset(lost_always())
    raw, events = stream(router, "all-lost")
    assert texts(events) == [" t0", " t1"] and "error" in events[2] and events[-1] == "[DONE]", raw
    assert migrations(router) == {"broken": 1}
    assert len(a.requests) + len(b.requests) == 2

    a.reset(wire_decoder(cut=2, how="close"))
    wait_for("decode up", lambda: off.metric("splitserve_router_worker_healthy", role="decode", url=a.url) == 1, 30)
    raw, events = stream(off, "off")
    assert texts(events) == [" t0", " t1"] and "error" in events[2] and events[-1] == "[DONE]", raw
    assert "stream_ids" not in a.requests[0][1] and migrations(off) == {}

    a.reset(wire_decoder(cut=2, how="silent"))  # a stopped decode no longer pins the stream
    raw, events = stream(off, "silent")
    assert texts(events) == [" t0", " t1"] and "stream_stall_s" in events[2]["error"]["message"], raw
    assert events[-1] == "[DONE]" and a.aborted.wait(10)

    # a client's own router-only fields never reach a worker
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "stream": True, "stream_ids": True,
            "continuation": {"id": "cmpl-x", "created": 1, "choices": [{"index": 0, "ids": [1]}]}}
    a.reset(wire_decoder())
    resp = requests.post(off.url + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400 or not {"stream_ids", "continuation"} & set(a.requests[-1][1]), resp.text


def lost_always():
    """Two tokens (with ids), then the connection closed: every leg, the continuation's too."""
    async def behaviour(fake, request, body):
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        cont = body.get("continuation")
        start = len(cont["choices"][0]["ids"]) if cont else 0
        for i in range(start, 2):
            await resp.write(f": ids 0 {100 + i}\ndata: {json.dumps(event(i))}\n\n".encode())
        return await lose(fake, request, resp, "close")
    return behaviour


def test_a_whole_answer_whose_decode_is_lost_is_sent_again(fakes, start_router):
    """Non-streamed: a decode whose connection breaks before its answer, and one that leaves
    rotation (its health checks fail) while the router waits, each give way to the other decode
    worker, which gets the whole request (no continuation, no ids asked); so does a stream whose
    decode is silent past ``--stream-stall-s`` before anything reached the client; counted as
    migrations, not retries."""
    ok = reply(200, {"who": "whole"})
    state = {"n": 0}

    async def breaks_first(fake, request, body):
        state["n"] += 1
        if state["n"] == 1:
            request.transport.close()
            await asyncio.sleep(1)
        return await ok(fake, request, body)

    a, b = fakes(breaks_first), fakes(breaks_first)
    router = start_router([(fakes(sse([])).url, 1)], [a.url, b.url], "--max-migrations", "2",
                          "--pd-threshold-tokens", "100000", "--health-interval-s", "0.3", "--stream-stall-s", "1")
    decodes_up(router, a, b)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": TOTAL}
    resp = requests.post(router.url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200 and resp.json() == {"who": "whole"}, resp.text
    legs = a.requests + b.requests
    assert len(legs) == 2 and not {"continuation", "stream_ids"} & set(legs[1][1])
    assert migrations(router) == {"broken": 1} and retried(router) == {}

    def first_sickens_then(then):
        """The first request: its worker leaves rotation (health 503) and holds it until released;
        every later one is answered by ``then``."""
        async def handler(fake, request, body):
            state["n"] += 1
            if state["n"] == 1:
                fake.health_status = 503
                await fake.release.wait()
            return await then(fake, request, body)
        return handler

    state["n"] = 0
    a.reset(first_sickens_then(ok))
    b.reset(first_sickens_then(ok))
    resp = requests.post(router.url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200 and resp.json() == {"who": "whole"}, resp.text
    assert len(a.requests) == 1 and len(b.requests) == 1
    assert (a if a.health_status == 503 else b).aborted.wait(10)
    assert migrations(router) == {"broken": 1, "unhealthy": 1}

    # a stream whose decode sent its headers and then nothing past --stream-stall-s: nothing
    # reached the client, so it is sent again whole (no continuation)
    silent_first, rest = wire_decoder(cut=0, how="silent"), wire_decoder()
    state["n"] = 0

    async def first_silent(fake, request, body):
        state["n"] += 1
        return await (silent_first if state["n"] == 1 else rest)(fake, request, body)

    a.reset(first_silent)
    b.reset(first_silent)
    raw, events = stream(router, "silent-before")
    assert texts(events) == [f" t{i}" for i in range(TOTAL)] and events[-1] == "[DONE]", raw
    legs = a.requests + b.requests
    assert len(legs) == 2 and "continuation" not in legs[1][1] and legs[1][1]["stream_ids"] is True
    assert migrations(router) == {"broken": 1, "unhealthy": 1, "stalled": 1}

    # a stream whose decode sends no headers (stopped before it took the request) and leaves
    # rotation: nothing reached the client, so it goes whole to the other decode, well before
    # the header timeout (--worker-header-timeout-s, 30 s by default, not reached here)
    state["n"] = 0
    for w in (a, b):
        w.health_status = 200
        w.reset(first_sickens_then(rest))
    decodes_up(router, a, b)
    raw, events = stream(router, "stopped-before-headers")
    assert texts(events) == [f" t{i}" for i in range(TOTAL)] and events[-1] == "[DONE]", raw
    legs = a.requests + b.requests
    assert len(legs) == 2 and "continuation" not in legs[1][1]
    assert migrations(router) == {"broken": 1, "unhealthy": 2, "stalled": 1}


# -- real workers -----------------------------------------------------------------------------------


@pytest.mark.long
def test_a_killed_decode_s_stream_ends_as_an_undisturbed_run_s(monkeypatch):
    """Real processes (tiny model, the compiled kernels): 1 prefill and 2 decode workers behind a
    router with ``--max-migrations 2``. A seeded, sampled stream of ``n`` = 2 with its usage is
    asked twice; the second time the decode serving it is SIGKILLed after 2 events reached the
    client. The client gets the same events (text, logprobs, finish reasons, usage; one [DONE],
    no comment), the same id on every chunk, and the request was continued once; nothing is left
    held on the surviving workers."""
    monkeypatch.setenv("SPLITSERVE_KERNELS", "1")

    body = {"prompt": "one two three four five six seven", "max_tokens": 160, "temperature": 0.8, "seed": 7,
            "n": 2, "logprobs": 2, "stream": True, "stream_options": {"include_usage": True}}
    with Cluster(prefill=1, decode=2, router_args=["--max-migrations", "2", "--pd-threshold-tokens", "0"]) as c:
        c.wait_in_rotation()  # the cut request's second decode is there to continue it
        ref, _ = real_stream(c.url, body, "undisturbed")
        got, raw = real_stream(c.url, body, "cut", kill_after=2, decode=c.decode)
        assert not any(line.startswith(b":") for line in raw.split(b"\n"))
        assert len({e["id"] for e in got[:-1]}) == 1 and got[-1] == "[DONE]" and raw.count(b"[DONE]") == 1
        strip = [{k: v for k, v in e.items() if k not in ("id", "created")} if isinstance(e, dict) else e for e in got]
        assert strip == [{k: v for k, v in e.items() if k not in ("id", "created")} if isinstance(e, dict) else e
                         for e in ref]
        assert migrations(c.router) == {"broken": 1}
        survivors = [d for d in c.decode if d.proc.poll() is None]
        assert len(survivors) == 1
        for worker in (*survivors, *c.prefill):
            pages_back_to_total(worker)


def real_stream(url: str, body: dict, rid: str, kill_after: Optional[int] = None, decode=()) -> tuple[list, bytes]:
    """The stream's events and raw bytes; with ``kill_after``, the decode worker the router chose
    (its record says which) SIGKILLed once that many events came."""
    raw, seen = b"", 0
    with requests.post(url + "/v1/completions", json=body, headers={"X-Request-Id": rid}, stream=True,
                       timeout=180) as resp:
        assert resp.status_code == 200, resp.text
        for chunk in resp.iter_content(chunk_size=None):
            raw += chunk
            seen = raw.count(b"\ndata: ") + raw.startswith(b"data: ")
            if kill_after is not None and seen >= kill_after:
                chosen = requests.get(f"{url}/debug/requests/{rid}", timeout=10).json()["router"]["decode"]
                next(d for d in decode if d.url == chosen).proc.kill()
                kill_after = None
    return sse_events(raw), raw


@pytest.mark.parametrize("how", ["close", "error:not_ready"])
def test_a_stream_lost_before_its_first_event_is_sent_whole_to_another(how, fakes, start_router):
    """Decode answered with its headers and lost the stream before any event: the client has no
    token, so the request goes whole (no continuation) to the other decode, and the client gets
    one stream of all 6 tokens and one [DONE]."""
    legs = []
    lose_first, serve = wire_decoder(cut=0, how=how), wire_decoder()

    async def decoder(fake, request, body):  # whichever decode gets the first leg loses it
        legs.append(body)
        return await (lose_first if len(legs) == 1 else serve)(fake, request, body)
    first, second = fakes(decoder), fakes(decoder)
    router = start_router([(fakes(sse([])).url, 1)], [first.url, second.url], "--max-migrations", "2",
                          "--stream-stall-s", "1", "--pd-threshold-tokens", "0")
    decodes_up(router, first, second)
    raw, events = stream(router, "lost-at-once")
    assert texts(events) == [f" t{i}" for i in range(TOTAL)], raw
    assert events[-1] == "[DONE]" and raw.count(b"[DONE]") == 1 and b'"error"' not in raw, raw
    assert len(legs) == 2 and "continuation" not in legs[1], legs  # a retry or a migration, whole
