"""Retries before the commit (``splitserve/router/retry.py``, ``docs/router.md``), through the
real router process:

- among two workers of each role, a refusing (503) prefill and a dead (connection refused) one
  of each role beside a real prefill and a real decode worker: every request succeeds, each
  attempt had a room of its own (the workers' own timelines and the fakes' records say which),
  counted by cause;
- a 429 is tried again only on another worker, never on the one that shed the load; with no
  other worker the client gets the 429;
- the retry budget: once spent, the failure reaches the client (counted as denied by budget);
- decode alone and the fallback to it (``split.py``) give the split's tokens on the real pair;
- a decode stream that breaks before anything reached the client is tried again; one that
  breaks after the first byte is not.

The fakes are ``test_router``'s (real sockets in a thread of this process); a "dead" worker is a
fake that the router saw healthy and that then stopped listening (the router's health checks
are slowed so that it stays in rotation, as a worker killed between two checks does).
"""

from __future__ import annotations

import asyncio
import json

import pytest
import requests
from aiohttp import web

from cluster import RouterProcess
from helpers.fake_workers import COMPLETION, MODEL, FakeWorker, reply, sse
from helpers.fake_workers import fake_loop, fakes  # noqa: F401 (fixtures)
from helpers.router_fixture import start_router  # noqa: F401 (a fixture)
from helpers.sse import sse_events
from helpers.waiting import wait_for

SLOW_HEALTH = ("--health-interval-s", "600")
BOOTSTRAP = {"bootstrap_host", "bootstrap_port", "bootstrap_room"}  # a worker that dies stays in rotation for the test


def retries(router: RouterProcess) -> dict:
    m = router.metrics()
    return {dict(labels)["role"] + ":" + dict(labels)["cause"]: v for (name, labels), v in m.items()
            if name == "splitserve_router_retries_total" and v}


def denied(router: RouterProcess) -> dict:
    m = router.metrics()
    return {dict(labels)["reason"]: v for (name, labels), v in m.items()
            if name == "splitserve_router_retries_denied_total" and v}


def record(router: RouterProcess, rid: str) -> dict:
    resp = requests.get(f"{router.url}/debug/requests/{rid}", timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()


def dead(fakes) -> FakeWorker:
    """A fake the router will see healthy at its start; :func:`kill` then closes its port."""
    return fakes(reply(200, {"who": "dead"}))


def kill(*workers: FakeWorker) -> None:
    for w in workers:
        w.stop_listening()


@pytest.fixture(scope="module")
def real_pair(pd_cluster):
    """A real prefill and decode worker: the session's split pair (``conftest.pd_cluster``), with
    routers of these tests in front of them."""
    return pd_cluster


DRAINING = {"error": {"message": "draining", "type": "x", "param": None, "code": "draining"}}


def ask(router: RouterProcess, rids: list[str]) -> None:
    """One completion per rid (every other one streamed): each a whole answer of 4 tokens."""
    for i, rid in enumerate(rids):
        body = {"prompt": "a b c d", "max_tokens": 4, "temperature": 0, "stream": i % 2 == 1}
        resp = requests.post(router.url + "/v1/completions", json=body, headers={"X-Request-Id": rid}, timeout=60)
        assert resp.status_code == 200, resp.text + router.output()
        if body["stream"]:
            events = sse_events(resp)
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events
        else:
            assert resp.json()["usage"]["completion_tokens"] == 4, resp.text
        assert resp.headers["X-Request-Id"] == rid


def check_attempts(router: RouterProcess, rids: list[str], prefill, decode) -> list[int]:
    """Each request's attempts, from the router's record: a room each, never one twice; all but
    the last failed; the last on the real pair, which knew the request by that attempt's id and
    room only (their own timelines). Every room of every request."""
    every_room: list[int] = []
    for rid in rids:
        entry = record(router, rid)
        attempts = entry["router"]["attempts"]
        rooms = [a["room"] for a in attempts]
        every_room += rooms
        assert all(a["failed"] for a in attempts[:-1]) and attempts[-1]["failed"] is None, attempts
        last = attempts[-1]
        assert (last["prefill"], last["decode"]) == (prefill.url, decode.url), attempts
        timelines = {a["url"]: a["timeline"] for a in entry["workers"] if a["timeline"] is not None}
        assert {timelines[prefill.url]["room"], timelines[decode.url]["room"]} == {last["room"]}, entry
        assert timelines[decode.url]["rid"] == last["rid"] and timelines[prefill.url]["rid"] == last["rid"]
    assert len(set(every_room)) == len(every_room), every_room
    return every_room


def test_a_refusing_or_dead_worker_is_replaced_with_a_fresh_room(real_pair, fakes, start_router):
    refusing = fakes(reply(503, DRAINING))
    dead_prefill, dead_decode = dead(fakes), dead(fakes)
    (prefill,), (decode,) = real_pair.prefill, real_pair.decode
    routers = start_router.together(
        ([(refusing.url, 1), (dead_prefill.url, 1), (prefill.url, prefill.bootstrap_port)], [decode.url], *SLOW_HEALTH),
        ([(prefill.url, prefill.bootstrap_port)], [dead_decode.url, decode.url], *SLOW_HEALTH))
    kill(dead_prefill, dead_decode)  # each router checked every worker healthy before it listened

    by_prefill, by_decode = routers
    rids = [f"p-{i}" for i in range(3)]
    ask(by_prefill, rids)  # round robin: the refusing one, the dead one, the real one in turn
    rooms = check_attempts(by_prefill, rids, prefill, decode)
    assert refusing.requests and not set(refusing.rooms()) - set(rooms)
    counted = retries(by_prefill)
    assert counted["prefill:unavailable"] == len(refusing.requests) and counted["prefill:unreachable"] >= 1, counted
    assert sum(counted.values()) == len(rooms) - len(rids)

    rids = [f"d-{i}" for i in range(2)]
    rooms = check_attempts(by_decode, rids, prefill, decode) if ask(by_decode, rids) is None else []
    counted = retries(by_decode)
    assert set(counted) == {"decode:unreachable"} and counted["decode:unreachable"] == len(rooms) - len(rids)
    assert by_prefill.metric("splitserve_router_requests_total", outcome="finished") == 3
    assert by_decode.metric("splitserve_router_requests_total", outcome="finished") == 2
    real_pair.assert_no_leaks()


def test_a_429_is_tried_again_only_on_another_worker(fakes, start_router):
    shedding = fakes(reply(429, {"error": {"message": "full", "type": "x", "param": None, "code": "overloaded"}},
                           headers={"Retry-After": "1"}))
    other, decode = fakes(reply(200, {"who": "prefill"})), fakes(reply(200, {"who": "decode"}))
    router, alone = start_router.together(([(shedding.url, 1), (other.url, 2)], [decode.url], "--policy", "round_robin"),
                                          ([(shedding.url, 1)], [decode.url]))
    wait_for("the router's pair",
             lambda: requests.get(router.url + "/health", timeout=2).status_code == 200, 30)
    for i in range(4):
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}, "rid": f"shed-{i}"}
        resp = requests.post(router.url + "/generate", json=body, timeout=30)
        assert resp.status_code == 200 and resp.json() == {"who": "decode"}, resp.text
    # each request met the shedding worker at most once, and was then served by the other one
    shed = [body["rid"] for _, body in shedding.requests]
    assert shed and len(shed) == len({rid.split("~")[0] for rid in shed}), shed
    assert sorted(body["rid"].split("~")[0] for _, body in other.requests) == [f"shed-{i}" for i in range(4)]
    assert retries(router) == {"prefill:overloaded": len(shed)}
    rooms = shedding.rooms() + other.rooms()
    assert len(set(rooms)) == len(rooms)
    assert len({body["bootstrap_room"] for _, body in decode.requests}) == len(rooms)

    wait_for("the router's pair", lambda: requests.get(alone.url + "/health", timeout=2).status_code == 200, 30)
    resp = requests.post(alone.url + "/v1/completions", json={"model": MODEL, **COMPLETION}, timeout=30)
    assert resp.status_code == 200 and resp.json() == {"who": "decode"}  # no other prefill: decode alone
    assert len(shedding.requests) == len(shed) + 1  # once, not again
    assert not BOOTSTRAP & set(decode.requests[-1][1])
    assert denied(alone) == {"no_other_worker": 1}


def test_a_spent_retry_budget_lets_the_failure_through(fakes, start_router):
    prefill, ok = fakes(reply(200, {"who": "prefill"})), fakes(reply(200, {"who": "decode"}))
    refusing = fakes(reply(503, DRAINING))
    router = start_router([(prefill.url, 1)], [refusing.url, ok.url], "--retry-budget-min", "1",
                          "--retry-budget-ratio", "0")
    url = router.url + "/v1/completions"
    statuses = [requests.post(url, json={"model": MODEL, **COMPLETION}, timeout=30).status_code for _ in range(3)]
    # the first refusal was tried again on the other decode (the budget's one retry); every later
    # one reached the client as the refusal it was
    assert statuses[0] == 200 and 503 in statuses, statuses
    assert retries(router) == {"decode:unavailable": 1}
    assert denied(router) == {"budget": statuses.count(503)}
    assert router.metric("splitserve_router_requests_total", outcome="decode_failed") == statuses.count(503)


def broken_stream(events: list[dict], wait: float = 0.0):
    """Decode's SSE headers and ``events``, then after ``wait`` seconds the connection closed
    without ``[DONE]``."""
    async def behaviour(fake, request, _body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        for event in events:
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await asyncio.sleep(wait)
        request.transport.close()
        return resp
    return behaviour


def slow_headers(seconds: float):
    """Prefill: its SSE headers (it accepted) after ``seconds``, then the end."""
    async def behaviour(fake, request, _body):
        await asyncio.sleep(seconds)
        return await sse([])(fake, request, _body)
    return behaviour


TOKEN = {"choices": [{"index": 0, "text": "tok", "finish_reason": None}]}


def test_a_decode_stream_broken_before_the_commit_is_tried_again_never_after(fakes, start_router):
    # prefill accepts after 1 s, decode breaks at once: nothing reached the client yet
    prefill = fakes(slow_headers(1.0))
    gone, good = fakes(broken_stream([])), fakes(sse([TOKEN, TOKEN]))
    late = fakes(broken_stream([TOKEN], wait=1.0))  # for router2, below
    gone_alone = fakes(broken_stream([]))  # for router3 (decode alone), below
    router, router2, router3 = start_router.together(
        ([(prefill.url, 1)], [gone.url, good.url]),
        ([(fakes(sse([])).url, 1)], [late.url, good.url]),
        ([(fakes(sse([])).url, 1)], [gone_alone.url, good.url], "--pd-threshold-tokens", "100000",
         "--policy", "round_robin"))
    wait_for("both decode workers up",
             lambda: router.metric("splitserve_router_worker_healthy", role="decode", url=good.url) == 1, 30)
    body = {"model": MODEL, **COMPLETION, "stream": True}
    with requests.post(router.url + "/v1/completions", json=body, stream=True, timeout=30) as resp:
        assert resp.status_code == 200
        events = sse_events(resp)
    assert events == [TOKEN, TOKEN, "[DONE]"], events
    assert len(gone.requests) == 1 and len(good.requests) == 1
    # the retry's prefill leg is read by the fake on its own loop: it may land just after the answer
    wait_for("the retry's prefill leg at prefill", lambda: len(prefill.requests) == 2, 30)
    assert len(set(prefill.rooms())) == 2
    assert retries(router) == {"decode:gone": 1}

    # prefill accepts at once, decode sends a token and breaks 1 s later: the token reached the
    # client, so the break is its answer's end (an error event), and no other worker is asked
    wait_for("both decode workers up",
             lambda: router2.metric("splitserve_router_worker_healthy", role="decode", url=good.url) == 1, 30)
    with requests.post(router2.url + "/v1/completions", json=body, stream=True, timeout=30) as resp:
        events = sse_events(resp)
    assert events[0] == TOKEN and "error" in events[1] and events[-1] == "[DONE]", events
    assert len(late.requests) == 1 and len(good.requests) == 1  # the good one was not asked again
    assert retries(router2) == {}
    assert router2.metric("splitserve_router_requests_total", outcome="decode_failed") == 1

    # decode alone (no prefill leg: nothing to wait for before the commit), its stream broken
    # after the headers, before any event: nothing reached the client, so another decode takes it
    wait_for("both decode workers up",
             lambda: router3.metric("splitserve_router_worker_healthy", role="decode", url=good.url) == 1, 30)
    for _ in range(2):  # round robin: one of the two lands on the broken worker first
        with requests.post(router3.url + "/v1/completions", json=body, stream=True, timeout=30) as resp:
            assert resp.status_code == 200
            events = sse_events(resp)
        assert events == [TOKEN, TOKEN, "[DONE]"], events
    assert len(gone_alone.requests) >= 1 and retries(router3) == {"decode:gone": len(gone_alone.requests)}



def test_decode_alone_and_the_fallback_give_the_split_s_tokens(real_pair, fakes, start_router):
    """The real pair: a request split, the same request sent to decode alone (a threshold above
    its length), and the same request whose only prefill refused (503: no retry left, so it falls
    back to decode alone) all give the same greedy tokens; decode's first room of the fallback was
    ended with the cause, and nothing is left held."""
    (prefill,), (decode,) = real_pair.prefill, real_pair.decode
    pair = [(prefill.url, prefill.bootstrap_port)]
    split, alone, fallback = start_router.together((pair, [decode.url]),
                                                   (pair, [decode.url], "--pd-threshold-tokens", "100000"),
                                                   ([(fakes(reply(503, DRAINING)).url, 1)], [decode.url]))
    body = {"prompt": "one two three four five", "max_tokens": 6, "temperature": 0}
    texts = {}
    for name, router in (("split", split), ("alone", alone), ("fallback", fallback)):
        for stream in (False, True):
            rid = f"{name}-{stream}"
            resp = requests.post(router.url + "/v1/completions", json={**body, "stream": stream},
                                 headers={"X-Request-Id": rid}, timeout=60)
            assert resp.status_code == 200, resp.text
            text = "".join(e["choices"][0]["text"] for e in sse_events(resp)[:-1]) if stream else \
                resp.json()["choices"][0]["text"]
            texts[rid] = text
    assert len(set(texts.values())) == 1, texts
    on_prefill = requests.get(f"{prefill.url}/debug/requests/alone-False", timeout=5)
    assert on_prefill.status_code == 404  # no prefill leg at all
    attempts = record(fallback, "fallback-False")["router"]["attempts"]
    assert attempts[1]["prefill"] is None and attempts[1]["room"] is None, attempts
    said = f"room={attempts[0]['room']} ended ABORTED(client_abort): the prefill worker"
    # the abort reaches decode's loop after the client's answer: wait for it (a busy machine)
    wait_for("decode's log line naming the cause", lambda: said in decode.stderr(), 30)  # not only "client gone"
    first = requests.get(f"{decode.url}/debug/rooms/{attempts[0]['room']}", timeout=5)
    assert first.status_code == 200 and first.json()["ending"] == "ABORTED(client_abort)", first.text
    assert decisions_of(fallback) == {"split": 2, "fallback": 2} and decisions_of(alone) == {"alone": 2}
    real_pair.assert_no_leaks()


def decisions_of(router: RouterProcess) -> dict:
    return {dict(labels)["decision"]: v for (name, labels), v in router.metrics().items()
            if name == "splitserve_router_pd_decisions_total" and v}
