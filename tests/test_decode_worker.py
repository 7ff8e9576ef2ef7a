"""A real decode worker at the edges of its lifecycle table: what a faulty prefill sends, and the
decode worker's own page queue.

One decode worker ``D`` (tiny model, tcp transfer, a pool of 16 pages of 16 tokens, short
deadlines) and a :class:`fake_prefill.FakePrefill` that speaks the real protocol and answers each
registration the way the test says. Requests go straight to ``D`` with the fake's bootstrap
address, as the router would send them. Every test ends with ``D`` clean: every page free, no live
room.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time

import msgpack
import pytest
import requests

from cluster import metric, metrics, pages_back_to_total, post_generate
from conftest import ServerProcess
from fake_prefill import FakePrefill, decode_info
from helpers.client_text import assert_in_words, logged_ending
from splitserve.disagg import protocol as p

PAGE, PAGES = 16, 16
DEADLINES = ["--prealloc-s", "20", "--kv-wait-s", "30", "--heartbeat-interval-s", "0.2", "--heartbeat-misses", "10",
             "--register-resend-s", "1", "--quarantine-resend-s", "0.5", "--decode-stall-s", "10",
             "--tombstone-s", "120"]
SLACK_S = 5.0  # on top of a bound, for two busy shared cores


@pytest.fixture(scope="module")
def setup():
    decode = ServerProcess("--role", "decode", "--transfer-backend", "tcp", "--page-size", str(PAGE),
                           "--insecure-control-plane",  # the fake prefill speaks plaintext
                           "--max-total-tokens", str(PAGE * PAGES), *DEADLINES).start()
    try:
        with FakePrefill(decode_info(decode)) as fake:
            yield decode, fake
    finally:
        decode.stop()


def ask(decode, fake, n_prompt: int, max_new_tokens: int = 4, timeout: float = 60, seed: int = 0):
    rng = random.Random(seed)
    extra = {"bootstrap_host": fake.host, "bootstrap_port": fake.port, "bootstrap_room": rng.getrandbits(63)}
    ids = [rng.randint(10, 2000) for _ in range(n_prompt)]
    return post_generate(decode.url, ids, max_new_tokens, timeout=timeout, extra=extra, temperature=0), extra


def answer_with(first_token: int):
    return lambda fake, peer, reg: fake.kv_done(peer, reg, first_token)


@pytest.mark.parametrize("first_token", [-1, 2**40])
def test_a_first_token_outside_the_vocabulary_fails_its_room_and_frees_its_pages(setup, first_token):
    """A KVDone whose first token is not a token of this model is the prefill's fault: that room
    fails (502, transfer_error in words: the log names the token and the prefill), its pages are
    freed, and the worker goes on serving."""
    decode, fake = setup
    fake.on_register = answer_with(first_token)
    started = time.monotonic()
    resp, _ = ask(decode, fake, 40, seed=first_token % 1000)
    assert resp.status_code == 502, (resp.status_code, resp.text, decode.output_tail(3000))
    assert_in_words(resp.json()["error"], "transfer_error", fake.port)
    line = logged_ending(decode, resp.headers["X-Request-Id"], "transfer_error")
    assert f"the first token {first_token} from " in line, line
    assert time.monotonic() - started < SLACK_S + 5
    pages_back_to_total(decode, 10)

    fake.on_register = answer_with(5)
    ok, _ = ask(decode, fake, 40, seed=first_token % 1000 + 1000)
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 4, ok.text
    pages_back_to_total(decode, 10)


def test_a_room_that_ends_while_waiting_for_pages_leaves_the_page_queue(setup):
    """``B`` holds 10 of the 16 pages (its prefill never answers); ``A`` needs 12 and waits for
    pages; ``A``'s client hangs up. ``C`` needs 1 page and 6 are free: it must get them at once, not
    wait behind the ended ``A`` until ``B`` ends."""
    decode, fake = setup
    held = threading.Event()
    registered: dict[int, tuple] = {}

    def on_register(fake, peer, reg):
        registered[reg.room] = (peer, reg)
        if reg.prompt_len == 160:
            held.set()  # B: held, never answered

    fake.on_register = on_register
    b_done = []
    b = threading.Thread(target=lambda: b_done.append(_swallow(lambda: ask(decode, fake, 160, timeout=8, seed=2))))
    b.start()
    assert held.wait(15), f"B never registered\n{decode.output_tail(3000)}"
    a = _swallow(lambda: ask(decode, fake, 192, timeout=1.5, seed=3))  # times out: the client hangs up
    assert isinstance(a, requests.exceptions.ReadTimeout), a
    time.sleep(0.5)  # the abort reaches D

    fake.on_register = lambda fake, peer, reg: (registered.__setitem__(reg.room, (peer, reg)),
                                               fake.kv_done(peer, reg, 5))
    started = time.monotonic()
    c, extra = ask(decode, fake, 16, timeout=60, seed=4)
    waited = time.monotonic() - started
    assert c.status_code == 200, (c.status_code, c.text)
    assert waited < SLACK_S, f"C waited {waited:.1f}s for one page while 6 were free"
    b.join(15)
    pages_back_to_total(decode, 20)


def test_a_full_pool_with_work_it_cannot_schedule_does_not_spin(setup):
    """``B`` holds 14 of the 16 pages (its prefill answers late); ``A`` (the other 2) decodes its
    first token and needs a third page for the next: the engine has work it can schedule none of.
    The loop must not spin on it (thousands of empty steps a second, a core busy): it waits for an
    event or a deadline as an idle loop does (at most the role's 50 ms): over the window the empty
    steps are bounded by its wake-ups (100 a second is twice the 50 ms cadence); then ``B``'s client
    hangs up and ``A`` ends."""
    decode, fake = setup
    held = {}

    def on_register(fake, peer, reg):
        if reg.prompt_len == 32:
            fake.kv_done(peer, reg, 5)  # A: at once
        else:
            held[reg.room] = (peer, reg)  # B: later

    fake.on_register = on_register
    body = json.dumps({"input_ids": list(range(300, 524)), "sampling_params": {"max_new_tokens": 4},
                       "bootstrap_host": fake.host, "bootstrap_port": fake.port, "bootstrap_room": 21}).encode()
    b_client = socket.create_connection(("127.0.0.1", decode.port))  # B's client: hangs up when told
    b_client.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 30
    while not held and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held, f"B never registered\n{decode.output_tail(3000)}"
    a_done = []
    a_extra = {"bootstrap_host": fake.host, "bootstrap_port": fake.port, "bootstrap_room": 22}
    a = threading.Thread(target=lambda: a_done.append(_swallow(lambda: (post_generate(
        decode.url, list(range(100, 132)), 40, timeout=60, extra=a_extra, temperature=0, ignore_eos=True), a_extra))))
    a.start()

    def a_decoding() -> bool:
        rows = requests.get(decode.url + "/debug/requests", timeout=5).json()
        return any(row["room"] == 22 and row["state"] == "DECODING" for row in rows)

    deadline = time.monotonic() + 30
    while not a_decoding() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a_decoding(), f"A never decoded\n{decode.output_tail(3000)}"
    before, t0 = metric(metrics(decode), "splitserve_engine_unschedulable_steps_total"), time.monotonic()
    time.sleep(2.0)
    empty = metric(metrics(decode), "splitserve_engine_unschedulable_steps_total") - before
    window = time.monotonic() - t0
    assert 0 < empty <= 100 * window, f"{empty:.0f} steps that scheduled nothing in {window:.1f}s"
    b_client.close()  # B's pages come back (its prefill settles its writes); A decodes on
    a.join(60)
    resp, _ = a_done[0]
    assert resp.status_code == 200 and len(resp.json()["output_ids"]) == 40, resp.text


def test_a_link_takes_writes_only_into_the_pages_of_its_own_rooms(setup):
    """Whoever holds a receiving link's metadata (the fake prefill got it in ``RegisterPeer``)
    writes junk over decode's whole pool while none of its rooms waits for KV. The tcp link refuses
    every byte of it (the write fails, naming why), and a prompt answered from decode's prefix cache
    answers as before, token for token. (The fake's honest writes, of zeros into each room's pages,
    land.)"""
    import torch

    from splitserve.disagg.transfer.base import Span, create_backend, page_spans

    decode, fake = setup
    fake.on_register = answer_with(5)
    ask(decode, fake, 16, seed=76)  # the fake's session has a link now
    link = fake.messages(p.RegisterPeer)[-1]
    nbytes = msgpack.unpackb(link.agent_metadata)["nbytes"]
    page_nbytes = nbytes // PAGES

    def write(writer, spans) -> object:
        handle = writer.write(link.agent_name, spans, b"")
        deadline = time.monotonic() + 30
        while writer.poll(handle).pending and time.monotonic() < deadline:
            time.sleep(0.01)
        return writer.poll(handle)

    honest = create_backend("tcp", "honest-writer", torch.zeros(nbytes, dtype=torch.uint8))
    junk = create_backend("tcp", "junk-writer", torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                                                               generator=torch.Generator().manual_seed(1)))
    try:
        for writer in (honest, junk):
            writer.add_peer(link.agent_name, link.agent_metadata)
        wrote = []

        def zeros_then_done(fake, peer, reg):  # on the fake's thread: the bytes land before KVDone is sent
            wrote.append(write(honest, page_spans(reg.pages, reg.pages, page_nbytes)))
            fake.kv_done(peer, reg, 5)

        fake.on_register = zeros_then_done
        rng = random.Random(77)
        ids = [rng.randint(10, 2000) for _ in range(3 * PAGE)]  # two whole pages go to the prefix cache

        def answer() -> list:
            extra = {"bootstrap_host": fake.host, "bootstrap_port": fake.port, "bootstrap_room": rng.getrandbits(63)}
            r = post_generate(decode.url, ids, 6, extra=extra, temperature=0)
            assert r.status_code == 200, r.text
            return r.json()["output_ids"]

        first = answer()
        assert answer() == first and wrote and all(w.done for w in wrote), wrote  # the cache's pages, the same KV
        state = write(junk, [Span(0, 0, nbytes)])
        assert state.failed and "not_writable" in state.reason, state
        assert answer() == first, "junk landed in decode's cached pages"
    finally:
        honest.close()
        junk.close()


    pages_back_to_total(decode, 10)


def test_a_bootstrap_address_off_the_allowed_list_is_never_dialed(setup):
    """A client names a prefill of its own (``127.0.0.2``, not on this decode's
    ``--allowed-prefill 127.0.0.1``): 403 naming the list, and the address is never dialed — no
    ``get_info``, no ``register_peer`` with the link's metadata. One on the list is served."""
    decode, fake = setup
    with FakePrefill(fake.info, host="127.0.0.2") as stranger:
        stranger.on_register = answer_with(5)
        resp, _ = ask(decode, stranger, 20, seed=90)
        assert resp.status_code == 403, (resp.status_code, resp.text)
        error = resp.json()["error"]
        assert error["code"] == "bootstrap_not_allowed" and "--allowed-prefill" in error["message"], error
        time.sleep(1.0)  # a dial would have asked for its info by now
        assert stranger.received == [], stranger.received
    fake.on_register = answer_with(5)
    ok, _ = ask(decode, fake, 20, seed=91)
    assert ok.status_code == 200, ok.text
    pages_back_to_total(decode, 10)


def _swallow(fn):
    try:
        return fn()
    except Exception as exc:  # handed to the test as a value
        return exc


def test_a_lone_surrogate_salt_is_refused_and_the_live_rooms_go_on(setup):
    """A ``cache_salt`` of "\\ud800", which the engine loop cannot hash for the prefix cache (its
    catch-all would fail every live room), is refused at the edge (400), and a room decoding
    meanwhile finishes with all its tokens."""
    decode, fake = setup
    fake.on_register = answer_with(5)
    done = []
    live = threading.Thread(target=lambda: done.append(ask(decode, fake, 40, max_new_tokens=40, seed=41)[0]))
    live.start()
    body = ('{"input_ids": %s, "sampling_params": {"max_new_tokens": 4}, "cache_salt": "\\ud800", '
            '"bootstrap_host": "%s", "bootstrap_port": %d, "bootstrap_room": 4242}'
            % (list(range(10, 30)), fake.host, fake.port))
    r = requests.post(decode.url + "/generate", data=body.encode(), headers={"Content-Type": "application/json"},
                      timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    live.join(60)
    assert done and done[0].status_code == 200, (done, decode.output_tail(3000))
    assert "engine loop error" not in decode.output_tail(20000)
    pages_back_to_total(decode, 10)
