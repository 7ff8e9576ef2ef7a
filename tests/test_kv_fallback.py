"""A decode worker whose KV will not come, shown with a prefill played by the test
(:class:`fake_prefill.FakePrefill`: the real protocol and tcp writer, answering as the test says),
against a colocated worker's tokens:

- ``POST /abort_request`` ends decode's leg with an explicit cause: ``client_abort`` (the client
  left) or ``prefill_failed`` (its KV will not come: decode computes the prompt itself);
- under ``--kv-failure-policy recompute`` a room whose prefill fails it, sends KV that is not its
  own, or goes silent, is recomputed here and answered with exactly the tokens of an undisturbed
  (colocated) run, greedy and seeded; its fallback is counted and in its timeline.

One colocated worker, one decode worker and one fake prefill, shared by the module; every test
ends with the decode worker's pages all free and no live room. The real prefill's faults (chunks
written, killed, stopped) are ``tests/test_recompute_faults.py``.
"""

from __future__ import annotations

import functools
import random
import threading
import time
from typing import Optional

import pytest
import requests

from cluster import generate, metric, metrics, pages_back_to_total, post_generate
from conftest import ServerProcess
from fake_prefill import FakePrefill, decode_info
from helpers.prompts import prompt
from splitserve.disagg import protocol as p

PAGE = 16
PROMPT_HIGH = 2000  # the top token id of a prompt
SAME = ["--page-size", str(PAGE), "--max-total-tokens", "2048", "--max-batch-tokens", "48"]
DEADLINES = ["--prealloc-s", "20", "--kv-wait-s", "30", "--heartbeat-interval-s", "0.2", "--heartbeat-misses", "10",
             "--register-resend-s", "1", "--quarantine-resend-s", "0.5", "--decode-stall-s", "10",
             "--tombstone-s", "120"]
GREEDY = {"temperature": 0}
SEEDED = {"temperature": 0.9, "top_p": 0.9, "seed": 77}


@pytest.fixture(scope="module")
def trio():
    colocated = ServerProcess(*SAME).spawn()
    decode = ServerProcess("--role", "decode", "--transfer-backend", "tcp", "--kv-failure-policy", "recompute",
                           "--insecure-control-plane",  # the fake prefill speaks plaintext
                           *SAME, *DEADLINES).spawn()
    try:
        colocated.wait_ready()
        decode.wait_ready()
        with FakePrefill(decode_info(decode)) as fake:
            yield colocated, decode, fake
    finally:
        decode.stop()
        colocated.stop()


class Leg:
    """A split request sent to the decode worker in a thread, as the router's decode leg."""

    def __init__(self, decode, fake, ids: list[int], sampling: dict, max_new_tokens: int = 10, rid: str = "",
                 completion: Optional[dict] = None):
        """``completion``: a ``/v1/completions`` body to send instead of ``/generate``'s."""
        self.room = random.getrandbits(63)
        self.rid = rid or f"leg-{self.room}"
        extra = {"bootstrap_host": fake.host, "bootstrap_port": fake.port, "bootstrap_room": self.room,
                 "rid": self.rid}
        self.resp = None
        if completion is not None:
            send = functools.partial(requests.post, decode.url + "/v1/completions", json={**completion, **extra},
                                     timeout=120)
        else:
            send = functools.partial(post_generate, decode.url, ids, max_new_tokens, extra=extra, ignore_eos=True,
                                     timeout=120, **sampling)
        self.thread = threading.Thread(target=lambda: setattr(self, "resp", send()))
        self.thread.start()

    def registered(self, fake, timeout: float = 60.0) -> p.RegisterRoom:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for reg in fake.messages(p.RegisterRoom):
                if reg.room == self.room:
                    return reg
            time.sleep(0.05)
        raise AssertionError(f"room {self.room} never registered with the fake prefill")

    def answer(self, timeout: float = 120.0) -> requests.Response:
        self.thread.join(timeout)
        assert self.resp is not None, "the decode leg never answered"
        return self.resp


def abort_request(decode, **body) -> requests.Response:
    return requests.post(decode.url + "/abort_request", json=body, timeout=30)


def steps(decode, rid: str) -> list[str]:
    return [s["state"] for s in requests.get(decode.url + f"/debug/requests/{rid}", timeout=10).json()["steps"]]


def fallbacks(decode, reason: str) -> float:
    return metric(metrics(decode), "splitserve_kv_fallback_total", reason=reason)


# -- POST /abort_request -----------------------------------------------------------------------------


def test_abort_request_client_abort_ends_the_leg_as_the_client_leaving(trio):
    colocated, decode, fake = trio
    leg = Leg(decode, fake, prompt(40, 1, high=PROMPT_HIGH), GREEDY)
    leg.registered(fake)
    resp = abort_request(decode, bootstrap_room=leg.room, reason="client_abort", detail="the router: client left")
    assert resp.status_code == 200 and resp.json() == {"found": True}, resp.text
    answer = leg.answer()
    assert answer.status_code == 499, answer.text
    assert answer.json()["error"]["code"] == "client_abort"
    assert abort_request(decode, rid=leg.rid).json() == {"found": False}, "ended: no longer here"
    pages_back_to_total(decode)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_abort_request_prefill_failed_makes_decode_compute_the_prompt(trio, sampling):
    """The router's prefill leg was refused: decode's leg is answered as if the KV had come. The
    room was registered, so it waits for the fake's WritesSettled (RECLAIMING) first."""
    colocated, decode, fake = trio
    ids = prompt(70, 2, high=PROMPT_HIGH)
    want = generate(colocated.url, ids, 10, ignore_eos=True, **sampling)
    before = fallbacks(decode, "peer_failed")
    leg = Leg(decode, fake, ids, sampling)
    leg.registered(fake)
    resp = abort_request(decode, rid=leg.rid, reason="prefill_failed", detail="the router: prefill answered 503")
    assert resp.json() == {"found": True}, resp.text
    answer = leg.answer()
    assert answer.status_code == 200, answer.text
    assert answer.json()["output_ids"] == want
    assert fallbacks(decode, "peer_failed") == before + 1
    assert steps(decode, leg.rid)[:5] == ["PREALLOC", "AWAITING_KV", "RECLAIMING", "PREFILLING", "DECODING"]
    pages_back_to_total(decode)


def test_a_recomputed_room_of_n_choices_gives_the_colocated_n(trio):
    """n = 3 through the fallback: decode computes the prompt itself, then forks the other choices
    as a colocated worker does: the same three answers."""
    colocated, decode, fake = trio
    body = {"model": "tiny", "prompt": prompt(70, 4, high=PROMPT_HIGH), "max_tokens": 6, "n": 3, "ignore_eos": True,
            **SEEDED}
    r = requests.post(colocated.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    want = [c["text"] for c in r.json()["choices"]]
    assert len(set(want)) == 3
    leg = Leg(decode, fake, [], {}, completion=body)
    leg.registered(fake)
    assert abort_request(decode, rid=leg.rid, reason="prefill_failed", detail="the router: prefill lost").json() == \
        {"found": True}
    answer = leg.answer()
    assert answer.status_code == 200, answer.text
    assert [c["text"] for c in answer.json()["choices"]] == want
    pages_back_to_total(decode)


def test_abort_request_prefill_failed_before_the_request_came_is_kept_for_it(trio):
    """The router's legs race: its prefill_failed reaches decode before the request. The request,
    when it comes, computes its prompt at once (it never registers with a prefill)."""
    colocated, decode, fake = trio
    ids = prompt(33, 3, high=PROMPT_HIGH)
    want = generate(colocated.url, ids, 10, ignore_eos=True, **GREEDY)
    rid = f"early-{random.getrandbits(32)}"
    assert abort_request(decode, rid=rid, reason="prefill_failed", detail="the router: prefill refused").json() \
        == {"found": False}
    leg = Leg(decode, fake, ids, GREEDY, rid=rid)
    answer = leg.answer()
    assert answer.status_code == 200 and answer.json()["output_ids"] == want, answer.text
    assert steps(decode, rid)[:3] == ["PREALLOC", "PREFILLING", "DECODING"]
    assert not [r for r in fake.messages(p.RegisterRoom) if r.room == leg.room]
    pages_back_to_total(decode)


@pytest.mark.parametrize("body, param", [
    ({}, "rid"), ({"rid": "a", "bootstrap_room": 1}, "rid"), ({"rid": ""}, "rid"), ({"rid": 5}, "rid"),
    ({"bootstrap_room": -1}, "bootstrap_room"), ({"bootstrap_room": 2**63}, "bootstrap_room"),
    ({"bootstrap_room": True}, "bootstrap_room"), ({"rid": "a", "reason": "bored"}, "reason"),
    ({"rid": "a", "detail": "x" * 257}, "detail"), ({"rid": "a", "detail": "\ud800"}, "detail"),
    ({"rid": "a", "why": 1}, "why"),
], ids=lambda v: str(v)[:40] if not isinstance(v, str) else v)
def test_abort_request_refuses_bad_input_by_name(trio, body, param):
    colocated, decode, fake = trio
    resp = abort_request(decode, **body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["code"] == "bad_request", error
    on_colocated = abort_request(colocated, rid="a", reason="prefill_failed")
    assert on_colocated.status_code == 400 and on_colocated.json()["error"]["param"] == "reason"
