"""n > 1: several choices from one prompt. Choice i > 0 forks from choice 0 once the prompt has
run: its first token is drawn from the same logits with its own seed (the choice index enters the
draw), it takes the prompt's full pages from the prefix cache (shared) and computes its partial
last page and on. Checked: seeded choices differ from each other and are the same whatever else
is batched, choice 0 is the n = 1 answer, pages all come back, an abort ends every choice; the
OpenAI shapes through the official client, streamed and not; a disaggregated worker refuses
n > 1 (a room runs one sequence)."""

from __future__ import annotations

import pytest
import requests

from conftest import tiny_llama_engine
from splitserve.engine.io import GenerateRequest, SamplingParams

openai = pytest.importorskip("openai")

PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def engine():
    return tiny_llama_engine()


def _run(engine, reqs) -> dict:
    """Every delta of every request, by (rid, choice): tokens, the finish reason, and whether the
    request's last delta came last."""
    for r in reqs:
        engine.add_request(r)
    got: dict = {}
    ended: dict = {}
    while engine.has_work():
        for out in engine.step().outputs:
            assert out.rid not in ended, "a delta after the request's last one"
            entry = got.setdefault((out.rid, out.index), {"tokens": [], "finish": None})
            entry["tokens"] += out.token_ids
            if out.finish_reason is not None:
                entry["finish"] = out.finish_reason
            if out.finished:
                ended[out.rid] = True
    return got


def _account(engine) -> None:
    s = engine.stats()
    assert s.pages_free + s.pages_cached == s.pages_total and s.pages_owned == 0
    assert not engine.live_sequences()


def test_seeded_choices_differ_and_hold_whatever_is_batched(engine):
    prompt = tuple(engine.tokenizer.encode(PROMPT))
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=4, ignore_eos=True)
    alone = _run(engine, [GenerateRequest("a", prompt, sp)])
    _account(engine)
    assert sorted(alone) == [("a", i) for i in range(4)]
    answers = [tuple(alone[("a", i)]["tokens"]) for i in range(4)]
    assert all(len(a) == 8 for a in answers) and len(set(answers)) == 4
    assert all(alone[("a", i)]["finish"] == "length" for i in range(4))
    one = _run(engine, [GenerateRequest("one", prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=7,
                                                                      ignore_eos=True))])
    assert tuple(one[("one", 0)]["tokens"]) == answers[0]  # choice 0 is the n = 1 answer
    other = GenerateRequest("b", tuple(engine.tokenizer.encode("Something else entirely")),
                            SamplingParams(max_tokens=5, temperature=1.0, seed=1))
    batched = _run(engine, [other, GenerateRequest("a2", prompt, sp)])
    assert [tuple(batched[("a2", i)]["tokens"]) for i in range(4)] == answers
    _account(engine)


def test_choices_share_the_prompts_pages_and_end_alone_or_together(engine):
    prompt = tuple(engine.tokenizer.encode("A prompt of its own, about pages and forks, said twice over"))
    before = engine.stats()
    got = _run(engine, [GenerateRequest("s", prompt, SamplingParams(max_tokens=2, temperature=1.0, seed=3, n=3))])
    assert all(len(got[("s", i)]["tokens"]) == 2 for i in range(3))
    full = (len(prompt) - 1) // 4 * 4  # each fork takes the prompt's full pages from the cache...
    after = engine.stats()
    assert after.cache_hit_tokens - before.cache_hit_tokens == 2 * full
    # ...and computes only the rest of it: its partial last page
    assert after.prompt_tokens_computed - before.prompt_tokens_computed == len(prompt) + 2 * (len(prompt) - full)
    _account(engine)
    # max_tokens 1: the forks end with their first token, computing nothing
    one = _run(engine, [GenerateRequest("s1", prompt, SamplingParams(max_tokens=1, temperature=1.0, seed=3, n=3))])
    assert [one[("s1", i)]["tokens"] for i in range(3)] == [got[("s", i)]["tokens"][:1] for i in range(3)]
    _account(engine)
    # the request ends once, with its last choice, whichever finishes first
    got = _run(engine, [GenerateRequest("t", prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=4, n=3,
                                                                    stop_token_ids=tuple(range(0, 2048, 3))))])
    assert len(got) == 3
    _account(engine)


def test_an_abort_ends_every_choice(engine):
    prompt = tuple(engine.tokenizer.encode(PROMPT))
    engine.add_request(GenerateRequest("x", prompt, SamplingParams(max_tokens=50, temperature=1.0, seed=2, n=3,
                                                                   ignore_eos=True)))
    for _ in range(3):
        engine.step()
    assert len(engine.live_sequences()) == 3
    out = engine.abort("x")
    assert out.finished and out.error is not None and out.completion_tokens >= 3
    assert engine.abort("x") is None
    _account(engine)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_n_through_the_openai_client(client, server):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=5, n=3,
                                    logprobs=1, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) == 3
    assert all(len(c.logprobs.tokens) == 6 and c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 18
    again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=5, n=3,
                                      extra_body={"ignore_eos": True}, stream=True)
    texts = {}
    for chunk in again:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(3)] == [c.text for c in out.choices]

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=5, temperature=1.0, seed=9, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 10
    streamed = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], n=2,
                                              max_tokens=5, temperature=1.0, seed=9, extra_body={"ignore_eos": True},
                                              stream=True)
    contents: dict = {}
    for chunk in streamed:
        for c in chunk.choices:
            contents[c.index] = contents.get(c.index, "") + (c.delta.content or "")
    assert [contents[i] for i in range(2)] == [c.message.content for c in chat.choices]


def test_bad_n_is_400(server):
    for body in [{"prompt": "x", "n": 0}, {"prompt": "x", "n": 10**6}, {"prompt": "x", "n": 2.0},
                 {"prompt": "x", "n": 2, "echo": True, "max_tokens": 0}]:
        r = requests.post(server.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
