"""A choice of ``n`` > 1 that ends before the others ends with the text ``n`` = 1 gives: what its
detokenizer still held back (bytes of an unfinished character, shown as U+FFFD at the end) is
released with its last delta, not dropped because other choices are still running."""

from __future__ import annotations

import requests

BODY = {"model": "tiny", "prompt": "日本語の文章と中文的句子", "temperature": 1.0}


def test_a_choice_ending_beside_others_keeps_its_held_back_tail(server):
    """Seeds whose answer ends inside a character: choice 0 of ``n`` = 2 is the ``n`` = 1 answer."""
    for seed, max_tokens in ((3, 7), (6, 9), (9, 5)):
        body = {**BODY, "seed": seed, "max_tokens": max_tokens}
        one = requests.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        two = requests.post(server.url + "/v1/completions", json={**body, "n": 2}, timeout=60).json()["choices"]
        assert one.endswith("\ufffd"), (seed, one)  # the case this is about
        assert next(c["text"] for c in two if c["index"] == 0) == one, (seed, max_tokens)
