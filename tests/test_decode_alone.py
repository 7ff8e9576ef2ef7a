"""Decode alone: a decode worker that gets a request with no bootstrap fields serves it by itself —
it computes the prompt into its own pages and generates — with exactly the tokens a colocated worker
gives, greedy and seeded.

One colocated worker and one decode worker (tiny model, the same pool and batch options), shared
by the module; each test ends with the decode worker's pages all free and no live room.
"""

from __future__ import annotations


import pytest
import requests

from cluster import generate, metric, metrics, pages_back_to_total, post_generate
from conftest import ServerProcess
from helpers.prompts import prompt
from helpers.sse import sse_events

PAGE = 16
PROMPT_HIGH = 2000  # the top token id of a prompt
SAME = ["--page-size", str(PAGE), "--max-total-tokens", "4096", "--max-batch-tokens", "48"]  # prompts run in chunks


@pytest.fixture(scope="module")
def pair():
    colocated = ServerProcess(*SAME).spawn()
    decode = ServerProcess("--role", "decode", "--transfer-backend", "tcp", *SAME).spawn()
    try:
        colocated.wait_ready()
        decode.wait_ready()
        yield colocated, decode
    finally:
        decode.stop()
        colocated.stop()


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.9, "seed": 1234}],
                         ids=["greedy", "seeded"])
def test_decode_alone_gives_the_tokens_of_a_colocated_worker(pair, sampling):
    colocated, decode = pair
    for i, n in enumerate((5, 47, 130)):  # within a page; one chunk less a token; several chunks
        ids = prompt(n, seed=n, high=PROMPT_HIGH)
        want = generate(colocated.url, ids, 12, ignore_eos=True, **sampling)
        assert len(want) == 12
        assert generate(decode.url, ids, 12, ignore_eos=True, **sampling) == want, f"prompt of {n} tokens"
        assert generate(decode.url, ids, 12, stream=bool(i % 2 == 0), ignore_eos=True, **sampling) == want
    pages_back_to_total(decode)


def test_decode_alone_shows_its_prompt_computed_here_and_ends_clean(pair):
    colocated, decode = pair
    before = metrics(decode)
    resp = post_generate(decode.url, prompt(40, seed=7, high=PROMPT_HIGH), 4, extra={"rid": "alone-1"}, temperature=0)
    assert resp.status_code == 200, resp.text
    timeline = requests.get(decode.url + "/debug/requests/alone-1", timeout=10).json()
    states = [s["state"] for s in timeline["steps"]]
    assert states[:3] == ["PREALLOC", "PREFILLING", "DECODING"], states
    assert timeline["ending"] == "FINISHED(length)", timeline
    assert timeline["room"] < 0, "a request that came alone has a local room, never a router's"
    after = pages_back_to_total(decode)
    finished = metric(after, "splitserve_requests_total", role="decode", outcome="finished", reason="length")
    assert finished == metric(before, "splitserve_requests_total", role="decode", outcome="finished",
                              reason="length") + 1


def test_decode_alone_answers_the_openai_routes(pair):
    colocated, decode = pair
    body = {"model": "tiny", "prompt": "Hello, my name is", "max_tokens": 6, "temperature": 0, "stream": True}
    texts = []
    for worker in pair:
        resp = requests.post(worker.url + "/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        events = sse_events(resp.text)
        assert events[-1] == "[DONE]"
        texts.append("".join(e["choices"][0]["text"] for e in events[:-1] if e.get("choices")))
    assert texts[0] == texts[1]
    pages_back_to_total(decode)
