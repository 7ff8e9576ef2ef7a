"""Per-request disaggregation through the router process (``splitserve/router/split.py``,
``docs/router.md``), against fake workers that record what reaches them: a short prompt goes to a
decode worker alone (no bootstrap fields, no prefill leg), a long one is split; ``cache_aware``
subtracts what it knows decode holds; ``0`` splits everything; a split request whose prefill
refused, with no retry left, goes to its decode worker alone, and that worker's first leg is
ended with the cause (``POST /abort_request``), not only closed. Against real workers:
``test_router_retry.py::test_a_refused_prefill_falls_back_to_decode_alone``.
"""

from __future__ import annotations

import requests

from helpers.fake_workers import MODEL, reply
from helpers.fake_workers import fake_loop, fakes  # noqa: F401 (fixtures)
from helpers.router_fixture import start_router  # noqa: F401 (a fixture)
from helpers.waiting import wait_for

BOOTSTRAP = {"bootstrap_host", "bootstrap_port", "bootstrap_room"}


def decisions(router) -> dict:
    return {dict(labels)["decision"]: v for (name, labels), v in router.metrics().items()
            if name == "splitserve_router_pd_decisions_total" and v}


def completion(router, prompt: str, **extra) -> requests.Response:
    resp = requests.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                                               **extra}, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp


def test_short_prompts_go_to_decode_alone_long_ones_split(fakes, start_router):
    prefill, decode = fakes(reply(200, {"who": "prefill"})), fakes(reply(200, {"who": "decode"}))
    router = start_router([(prefill.url, 7)], [decode.url], "--pd-threshold-tokens", "16",
                          "--pd-chars-per-token", "2")
    completion(router, "x" * 30)  # 15 tokens by the estimate: alone
    completion(router, "x" * 32, bootstrap_host="10.9.9.9", bootstrap_port=1, bootstrap_room=5)  # 16: split
    ids = {"model": MODEL, "sampling_params": {"max_new_tokens": 2}}
    for n in (15, 16):  # token ids count exactly, whatever their digits
        assert requests.post(router.url + "/generate", json={**ids, "input_ids": [12345] * n},
                             timeout=30).status_code == 200
    bodies = [body for _, body in decode.requests]
    assert [bool(BOOTSTRAP & set(b)) for b in bodies] == [False, True, False, True], bodies
    assert len(prefill.requests) == 2 and prefill.requests[0][1] == bodies[1]
    assert bodies[1]["bootstrap_host"] == "127.0.0.1" and bodies[1]["bootstrap_port"] == 7  # the router's, not the client's
    assert decisions(router) == {"alone": 2, "split": 2}

    always = start_router([(prefill.url, 7)], [decode.url], "--pd-threshold-tokens", "0")
    completion(always, "x")
    assert BOOTSTRAP <= set(decode.requests[-1][1]) and len(prefill.requests) == 3
    assert decisions(always) == {"split": 1}


def test_what_runs_on_one_worker_goes_to_decode_alone_whatever_its_length(fakes, start_router):
    """The prompt's logprobs (lm-eval's loglikelihood requests: ``echo`` with ``logprobs``) and
    ``max_tokens`` 0 are refused by a split worker: the router sends them to decode alone even
    when it splits every request."""
    prefill, decode = fakes(reply(200, {"who": "prefill"})), fakes(reply(200, {"who": "decode"}))
    router = start_router([(prefill.url, 7)], [decode.url], "--pd-threshold-tokens", "0")
    completion(router, "x" * 300, echo=True, logprobs=1, max_tokens=1)
    completion(router, "x" * 300, echo=True, max_tokens=0)
    completion(router, "x" * 300, echo=True, max_tokens=3)  # the prompt's text only: split
    assert requests.post(router.url + "/generate", json={"model": MODEL, "input_ids": [7] * 300, "return_logprob": True,
                                                         "logprob_start_len": 0, "sampling_params": {
                                                             "max_new_tokens": 0}}, timeout=30).status_code == 200
    bodies = [body for _, body in decode.requests]
    assert [bool(BOOTSTRAP & set(b)) for b in bodies] == [False, False, True, False], bodies
    assert len(prefill.requests) == 1
    assert decisions(router) == {"alone": 3, "split": 1}


def test_cache_aware_subtracts_what_decode_is_known_to_hold(fakes, start_router):
    prefill, decode = fakes(reply(200, {"who": "prefill"})), fakes(reply(200, {"who": "decode"}))
    router = start_router([(prefill.url, 7)], [decode.url], "--policy", "cache_aware", "--pd-threshold-tokens",
                          "32", "--pd-chars-per-token", "1", "--cache-block-chars", "8")
    system = "s" * 64
    completion(router, system)  # 64 tokens, nothing cached: split, and the index learns it
    completion(router, system + "q" * 16)  # 80, of which 64 known to be on decode: 16 left, alone
    completion(router, "t" * 64)  # another prompt: split
    bodies = [body for _, body in decode.requests]
    assert [bool(BOOTSTRAP & set(b)) for b in bodies] == [True, False, True], bodies
    assert decisions(router) == {"split": 2, "alone": 1}


def test_a_refused_split_falls_back_to_decode_alone_and_ends_its_first_leg_with_the_cause(fakes, start_router):
    refusing = fakes(reply(503, {"error": {"message": "draining", "type": "x", "param": None, "code": "draining"}}))
    decode = fakes(reply(200, {"who": "decode"}))
    router = start_router([(refusing.url, 7)], [decode.url], "--pd-threshold-tokens", "0")
    resp = requests.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 2,
                                                               "rid": "fb-1"}, timeout=30)
    assert resp.status_code == 200 and resp.json() == {"who": "decode"}, resp.text
    (_, split), (_, alone) = decode.requests
    assert split["bootstrap_room"] == refusing.requests[0][1]["bootstrap_room"]
    assert not BOOTSTRAP & set(alone)
    # the client's rid, on an OpenAI route too, is each attempt's own: decode may still hold the first
    assert (split["rid"], alone["rid"]) == ("fb-1", "fb-1~1") and resp.headers["X-Request-Id"] == "fb-1"
    (ended,) = decode.abort_requests
    assert ended["bootstrap_room"] == split["bootstrap_room"] and ended["reason"] == "client_abort"
    assert refusing.url in ended["detail"] and "503" in ended["detail"] and "alone" in ended["detail"], ended
    assert decisions(router) == {"split": 1, "fallback": 1}
    assert router.metric("splitserve_router_requests_total", outcome="finished") == 1
    attempts = requests.get(router.url + "/debug/requests/fb-1", timeout=10).json()["router"]["attempts"]
    assert [a["prefill"] for a in attempts] == [refusing.url, None] and attempts[1]["room"] is None, attempts


def test_with_no_prefill_up_a_split_request_goes_to_decode_alone(fakes, start_router):
    prefill, decode = fakes(reply(200, {"who": "prefill"})), fakes(reply(200, {"who": "decode"}))
    router = start_router([(prefill.url, 7)], [decode.url], "--health-interval-s", "0.1")
    prefill.health_status = 500
    wait_for("the prefill worker to leave the rotation",
             lambda: router.metric("splitserve_router_worker_healthy", role="prefill", url=prefill.url) == 0, 5.0)
    assert completion(router, "hello").json() == {"who": "decode"}
    assert not prefill.requests and not BOOTSTRAP & set(decode.requests[-1][1])
    assert decisions(router) == {"fallback": 1}
    strict = start_router([(prefill.url, 7)], [decode.url], "--no-pd-fallback")
    resp = requests.post(strict.url + "/v1/completions", json={"model": MODEL, "prompt": "hello"}, timeout=30)
    assert resp.status_code == 503 and "no healthy prefill worker" in resp.json()["error"]["message"]
