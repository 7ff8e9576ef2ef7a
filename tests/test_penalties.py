"""Penalties and biases: ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` on the
OpenAI routes, SGLang's ``presence_penalty``, ``frequency_penalty`` and ``repetition_penalty`` on
``/generate``. Checked: the arithmetic of ``adjust_logits`` (and that rows asking for none are
not touched, a batch asking for none not copied); one request's penalties change no other's
tokens; over HTTP a bias of +100 forces a token and -100 bans it, a frequency penalty changes a
greedy repetition exactly as the raw logprobs (which stay unpenalized) predict; across the split
the first token, sampled on prefill, is biased too and the answers equal a colocated worker's;
bad values are 400s naming the field.

Servers: the session's tiny-model worker and the session's 1 prefill + 1 decode cluster."""

from __future__ import annotations

import pytest
import requests
import torch

from splitserve.engine.io import GenerateRequest, SamplingParams
from splitserve.engine.sampler import adjust_logits

PROMPT_IDS = [11, 300, 42, 7, 1999, 5, 640]


def test_adjust_logits_arithmetic():
    logits = torch.tensor([[1.0, -2.0, 3.0, 0.5, 0.0],
                           [1.0, -2.0, 3.0, 0.5, 0.0],
                           [1.0, -2.0, 3.0, 0.5, 0.0]])
    plain = SamplingParams(temperature=0)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, logit_bias=((4, -100.0), (0, 2.0)))
    r = SamplingParams(repetition_penalty=2.0)
    # row 1: prompt [3], answer [2, 2, 0]; row 2: prompt [1], answer [2]
    out = adjust_logits(logits, [plain, p, r], [[3, 0], [3, 2, 2, 0], [1, 2]], [1, 1, 1])
    assert out[0].tolist() == logits[0].tolist()  # asked for nothing: untouched
    # token 0: once in the answer, +2 bias; token 2: twice; token 3 only in the prompt: not counted
    assert out[1].tolist() == pytest.approx([1.0 - 0.5 - 0.25 + 2.0, -2.0, 3.0 - 1.0 - 0.25, 0.5, -100.0])
    # repetition: prompt and answer tokens, positive divided, negative multiplied
    assert out[2].tolist() == pytest.approx([1.0, -4.0, 1.5, 0.5, 0.0])
    assert logits[1].tolist() == [1.0, -2.0, 3.0, 0.5, 0.0]  # the raw logits are not written
    assert adjust_logits(logits, [plain] * 3, [[1]] * 3, [1] * 3) is logits  # nothing asked: no copy
    inf = torch.tensor([[float("inf"), float("-inf"), 1.0]])
    got = adjust_logits(inf, [SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0)], [[0, 1, 0, 1]], [2])
    assert got[0, 0] == float("inf") and got[0, 1] == float("-inf")  # infinities stay what they were


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine


def test_one_requests_penalties_change_no_other_tokens(engine):
    prompt = tuple(PROMPT_IDS)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    pen = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True, frequency_penalty=2.0,
                         presence_penalty=1.0, repetition_penalty=1.3, logit_bias=((9, 100.0),))
    alone = {k: engine.generate([GenerateRequest(k, prompt, sp)])[k].token_ids
             for k, sp in (("g", greedy), ("s", seeded), ("p", pen))}
    assert alone["p"] == (9,) * 12
    batched = engine.generate([GenerateRequest(k, prompt, sp) for k, sp in (("g", greedy), ("p", pen), ("s", seeded))])
    assert {k: o.token_ids for k, o in batched.items()} == alone


# -- over HTTP -----------------------------------------------------------------------------------------


def _completion(url: str, **body) -> dict:
    body = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **body}
    r = requests.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _generate(url: str, n: int = 24, **sampling) -> dict:
    r = requests.post(url + "/generate", json={"input_ids": PROMPT_IDS, "return_logprob": True, "top_logprobs_num": 20,
                                               "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                                   "ignore_eos": True, **sampling}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _first_repeat(ids: list[int]) -> int:
    """The position of the first token the answer already held."""
    return next(i for i, t in enumerate(ids) if t in ids[:i])


def test_bias_forces_and_bans_a_token(server):
    forced = _completion(server.url, logit_bias={"77": 100}, logprobs=0)
    assert len(forced["logprobs"]["tokens"]) == 8 and len(set(forced["logprobs"]["tokens"])) == 1
    # a -100 on every token of the greedy answer: none of them comes back
    plain = _generate(server.url, 6)["output_ids"]
    plain_tokens = _completion(server.url, max_tokens=6, logprobs=0)["logprobs"]["tokens"]
    lp = _completion(server.url, max_tokens=6, logit_bias={str(t): -100 for t in plain}, logprobs=1)["logprobs"]
    whole = {t for t in plain_tokens if "\ufffd" not in t}  # a byte of a character: other ids read alike
    assert whole and not set(lp["tokens"]) & whole
    # the raw logprobs still rank the banned greedy token first
    assert list(lp["top_logprobs"][0]) == [plain_tokens[0]]
    assert lp["token_logprobs"][0] < list(lp["top_logprobs"][0].values())[0]
    chat = requests.post(server.url + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0,
        "ignore_eos": True, "logit_bias": {"77": 100}, "logprobs": True}, timeout=120)
    assert chat.status_code == 200, chat.text
    tokens = [c["token"] for c in chat.json()["choices"][0]["logprobs"]["content"]]
    assert tokens == [forced["logprobs"]["tokens"][0]] * 5


def test_frequency_penalty_changes_a_greedy_repetition_as_the_raw_logprobs_say(server):
    plain = _generate(server.url)
    ids = plain["output_ids"]
    at = _first_repeat(ids)  # the greedy answer repeats a token here
    for sampling in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        pen = _generate(server.url, **sampling)
        got = pen["output_ids"]
        assert got[:at] == ids[:at] and got[at] != ids[at], sampling
        # every token is the argmax of the raw logprobs (reported unpenalized) minus the penalty
        tops = pen["meta_info"]["output_top_logprobs"]
        chosen = pen["meta_info"]["output_token_logprobs"]
        for i, token in enumerate(got):
            counts = {t: got[:i].count(t) for t in set(got[:i])}
            scored = {t: lp - 2.0 * (counts.get(t, 0) if "frequency_penalty" in sampling else counts.get(t, 0) > 0)
                      for lp, t, *_ in tops[i]}
            assert token == max(scored, key=lambda t: (scored[t], -t)), (sampling, i)
            assert chosen[i][0] == pytest.approx(dict((t, lp) for lp, t, *_ in tops[i])[token], abs=1e-6)
        # and the OpenAI route gives the same tokens
        body = {("frequency_penalty" if "frequency_penalty" in sampling else "presence_penalty"): 2.0}
        assert _completion(server.url, max_tokens=24, **body)["text"] == pen["text"]
    rep = _generate(server.url, repetition_penalty=1.5)["output_ids"]
    assert rep != ids and len(set(rep)) > len(set(ids))


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"frequency_penalty": "1"}, "frequency_penalty"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": True}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"-1": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"2048": 1}}, "logit_bias"),  # beyond the tiny vocabulary
    ("/v1/completions", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": [1, 2]}, "logit_bias"),
    ("/v1/chat/completions", {"presence_penalty": -2.01}, "presence_penalty"),
    ("/v1/chat/completions", {"logit_bias": {"5": -1e9}}, "logit_bias"),
    ("/generate", {"sampling_params": {"repetition_penalty": 0}}, "sampling_params.repetition_penalty"),
    ("/generate", {"sampling_params": {"repetition_penalty": 2.5}}, "sampling_params.repetition_penalty"),
    ("/generate", {"sampling_params": {"frequency_penalty": 9}}, "sampling_params.frequency_penalty"),
])
def test_bad_penalties_are_400(server, route, body, param):
    base = {"/v1/completions": {"prompt": "x"}, "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}]},
            "/generate": {"text": "x"}}[route]
    r = requests.post(server.url + route, json={**base, **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_split_biases_the_first_token_and_equals_colocated(pd_cluster, server):
    """The first token is sampled on prefill: the bias is applied there too, or it would be the
    unbiased greedy token; the rest on decode, with the penalties over the answer so far."""
    forced = _completion(pd_cluster.url, logit_bias={"77": 100}, logprobs=0)
    assert forced["logprobs"]["tokens"] == _completion(server.url, logit_bias={"77": 100}, logprobs=0)["logprobs"]["tokens"]
    assert len(set(forced["logprobs"]["tokens"])) == 1
    plain = _generate(server.url)["output_ids"]
    banned = _completion(pd_cluster.url, logit_bias={str(plain[0]): -100}, logprobs=0)
    assert banned["text"] == _completion(server.url, logit_bias={str(plain[0]): -100}, logprobs=0)["text"]
    assert banned["text"] != _completion(server.url, logprobs=0)["text"]
    for sampling in ({"frequency_penalty": 2.0, "presence_penalty": 0.5}, {"repetition_penalty": 1.5}):
        assert _generate(pd_cluster.url, **sampling)["output_ids"] == _generate(server.url, **sampling)["output_ids"]
    seeded = {"temperature": 1.0, "seed": 11, "frequency_penalty": 1.5}
    assert _generate(pd_cluster.url, **seeded)["output_ids"] == _generate(server.url, **seeded)["output_ids"]
