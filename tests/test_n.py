"""n > 1: several choices from one prompt. Choice i > 0 forks from choice 0 once the prompt has
run: it takes the prompt's full pages from the prefix cache (shared), computes its partial last
page and samples its first token there with its own seed (the choice index enters the draw).
Checked: seeded choices differ from each other and are the same whatever else is batched, choice
0 is the n = 1 answer, pages all come back, an abort ends every choice; the OpenAI shapes through
the official client, streamed and not. Across the split (the session's ``pd_cluster``) one
prefill room serves one decode room of n sequences: prefill samples choice 0's first token,
decode forks the rest once the KV is in, so the answer is the colocated one — through the router,
and on decode alone."""

from __future__ import annotations

import json

import pytest
import requests

from cluster import pages_back_to_total
from splitserve.engine.io import Bootstrap, GenerateRequest, SamplingParams

openai = pytest.importorskip("openai")

PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine


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
    # max_tokens 1: the forks end with their first token, sampled after their partial last page
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


def _decode_room(engine, rid: str, prompt: tuple, sp: SamplingParams):
    """What a split does, in one engine: a prefill room computes the prompt and choice 0's first
    token; its KV is copied into pages of a decode room (the transfer), which starts decoding."""
    pre = engine.add_request(GenerateRequest(rid + "-p", prompt, sp, bootstrap=Bootstrap("127.0.0.1", 1, 1)),
                             prefill_only=True)
    while pre not in engine.step().first_tokens:
        pass
    pages = engine.allocator.allocate(len(pre.pages))
    for src, dst in zip(pre.pages, pages):
        engine.kv.buffer[dst] = engine.kv.buffer[src]
    engine.release(pre)
    return engine.start_decoding(GenerateRequest(rid, prompt, sp, bootstrap=Bootstrap("127.0.0.1", 1, 2)), pages,
                                 pre.token_ids[-1])


def test_a_decode_room_of_n_forks_as_colocated_and_its_cancel_ends_every_choice(engine):
    prompt = tuple(engine.tokenizer.encode(PROMPT))
    for max_tokens in (4, 1):  # 1: choice 0 ends with prefill's token, and the others still fork
        sp = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=7, n=3, ignore_eos=True)
        want = _run(engine, [GenerateRequest("c", prompt, sp)])
        room, outs = _decode_room(engine, "d", prompt, sp)
        got: dict = {}
        while True:
            for out in outs:
                got.setdefault(out.index, []).extend(out.token_ids)
            if not engine.has_work():
                break
            outs = engine.step().outputs
        assert outs[-1].finished and got == {i: want[("c", i)]["tokens"] for i in range(3)}
        engine.release(room)  # the room frees its pages; the other choices freed their own
        _account(engine)
    sp = SamplingParams(max_tokens=50, temperature=1.0, seed=2, n=3, ignore_eos=True)
    room, _ = _decode_room(engine, "x", prompt, sp)
    for _ in range(3):
        engine.step()
    assert len(engine.live_sequences()) == 3
    assert engine.cancel("x") is room and not engine.live_sequences()
    engine.release(room)
    _account(engine)


def _pool_engine(pages: int):
    """An engine on the simulator's fake forward pass (``sim/model.py``), pages of 16 tokens."""
    from splitserve.config import EngineConfig
    from splitserve.engine.engine import LLMEngine
    from splitserve.sim.model import fake_parts

    return LLMEngine(EngineConfig(model="sim", max_total_tokens=pages * 16, page_size=16), parts=fake_parts())


def _finish_steps(engine, arrivals: dict, limit: int = 2000) -> dict:
    """Run ``arrivals`` ({step: [requests]}) to the end; the step each request ended at."""
    ended, step = {}, 0
    while (engine.has_work() or step <= max(arrivals)) and step < limit:
        for r in arrivals.get(step, []):
            engine.add_request(r)
        step += 1
        for out in engine.step().outputs:
            if out.finished:
                assert out.error is None, out
                ended[out.rid] = step
    return ended


def _shorts(k: int, tag: str = "s") -> list:
    return [GenerateRequest(f"{tag}{i}", tuple(range(50, 60)), SamplingParams(max_tokens=8, temperature=1.0, seed=i,
                                                                             ignore_eos=True)) for i in range(k)]


def test_a_request_whose_choices_cannot_all_fit_is_refused_at_once_and_later_ones_are_served():
    """n = 16 choices of 32 + 200 tokens each fit the pool (64 pages of 16) one at a time, not all
    together: refused at submission (400, param n); short requests that come while it would have
    run are served in their own time (8 tokens, 8 steps)."""
    from splitserve.engine.io import InvalidRequest

    engine = _pool_engine(64)
    big = GenerateRequest("big", tuple(range(40, 72)), SamplingParams(max_tokens=200, n=16, temperature=1.0, seed=1,
                                                                       ignore_eos=True))
    refused = None
    try:
        engine.check_fits(big)  # what a worker does at submission (``role.check``)
        engine.add_request(big)
    except InvalidRequest as exc:
        refused = exc
    ended = _finish_steps(engine, {0: [], 60: _shorts(6)})
    assert {rid: ended[rid] - 60 for rid in ended if rid != "big"} == {f"s{i}": 8 for i in range(6)}
    assert refused is not None and refused.status == 400 and refused.param == "n" and "225 pages" in str(refused)
    engine.check_fits(GenerateRequest("one", big.prompt_ids, SamplingParams(max_tokens=200)))  # one choice fits


def test_a_request_of_16_choices_that_does_not_fit_yet_is_passed_by_short_ones_then_served():
    """A long request holds 40 of 64 pages; n = 16 choices (49 pages) wait for it, while short
    requests that fit what is left pass them and are served in their own time; the 16 choices
    are admitted together when the long one ends, and nothing is preempted."""
    engine = _pool_engine(64)
    long = GenerateRequest("long", tuple(range(40, 72)), SamplingParams(max_tokens=600, ignore_eos=True))
    big = GenerateRequest("big", tuple(range(40, 72)), SamplingParams(max_tokens=32, n=16, temperature=1.0, seed=1,
                                                                       ignore_eos=True))
    engine.check_fits(big)
    ended = _finish_steps(engine, {0: [long], 5: [big], 10: _shorts(6), 100: _shorts(4, "t")})
    assert all(ended[f"s{i}"] == 10 + 8 for i in range(6)) and all(ended[f"t{i}"] == 100 + 8 for i in range(4))
    assert ended["long"] == 600 and ended["big"] == 600 + 33  # its prompt, its fork, 32 tokens
    s = engine.stats()
    assert s.preemptions == 0 and s.pages_owned == 0 and s.pages_free + s.pages_cached == s.pages_total


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


def _generate(url: str, stream: bool = False):
    body = {"text": PROMPT, "stream": stream, "sampling_params": {"n": 3, "max_new_tokens": 6, "temperature": 1.0,
                                                                  "seed": 5, "ignore_eos": True}}
    r = requests.post(url + "/generate", json=body, timeout=120, stream=stream)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()
    last: dict = {}  # each chunk is its choice's answer so far
    for line in r.iter_lines():
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            last[chunk.pop("index")] = chunk
    return [last[i] for i in sorted(last)]


def test_n_on_generate_is_sglangs_list(server, pd_cluster):
    """``sampling_params.n`` on ``/generate``: a list of one answer per choice (streamed: chunks
    that name their ``index``), the choices of the same request on the OpenAI route, split or not."""
    want = [text for text, _, _ in (_completion(server.url)[i] for i in range(3))]
    for url, stream in ((server.url, False), (pd_cluster.url, False), (pd_cluster.url, True)):
        answers = _generate(url, stream)
        assert [a["text"] for a in answers] == want, (url, stream)
        assert [a["meta_info"]["completion_tokens"] for a in answers] == [6, 6, 6]
        assert [a["meta_info"]["finish_reason"] for a in answers] == [{"type": "length"}] * 3
        assert all(len(a["output_ids"]) == 6 for a in answers)


def test_bad_n_is_400(server):
    for body in [{"prompt": "x", "n": 0}, {"prompt": "x", "n": 10**6}, {"prompt": "x", "n": 2.0},
                 {"prompt": "x", "n": 2, "echo": True, "max_tokens": 0}]:
        r = requests.post(server.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


# -- across the split ------------------------------------------------------------------------------


def _completion(url: str, stream: bool = False, **extra) -> dict:
    """{index: (text, tokens of its logprobs, finish_reason)} of a seeded n = 3 completion."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 5, "n": 3,
            "logprobs": 1, "ignore_eos": True, "stream": stream, **extra}
    r = requests.post(url + "/v1/completions", json=body, timeout=120, stream=stream)
    assert r.status_code == 200, r.text
    if not stream:
        return {c["index"]: (c["text"], c["logprobs"]["tokens"], c["finish_reason"]) for c in r.json()["choices"]}
    got: dict = {}
    for line in r.iter_lines():
        if line.startswith(b"data: {"):
            for c in json.loads(line[6:])["choices"]:
                text, tokens, reason = got.get(c["index"], ("", [], None))
                got[c["index"]] = (text + c["text"], tokens + (c["logprobs"] or {}).get("tokens", []),
                                   c["finish_reason"] or reason)
    return got


@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=pytest.mark.long)], ids=["unary", "stream"])
def test_n_across_the_split_is_the_colocated_answer(pd_cluster, server, stream):
    """Streamed through the router: ``long`` (test_n_on_generate streams n choices through it)."""
    want = _completion(server.url)
    assert sorted(want) == [0, 1, 2] and len({text for text, _, _ in want.values()}) == 3
    assert _completion(pd_cluster.url, stream) == want  # the router splits it: prefill, then decode forks
    assert _completion(pd_cluster.decode[0].url, stream) == want  # decode alone: it forks as colocated
    for w in pd_cluster.workers:
        pages_back_to_total(w)


def test_n_across_the_split_through_the_openai_client(pd_cluster, server):
    messages = [{"role": "user", "content": "Hi"}]
    answers = [openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
               .chat.completions.create(model="tiny", messages=messages, n=2, max_tokens=5, temperature=1.0,
                                        seed=9, extra_body={"ignore_eos": True})
               for url in (pd_cluster.url, server.url)]
    ours, theirs = ([(c.index, c.message.content, c.finish_reason) for c in a.choices] for a in answers)
    assert ours == theirs and len({content for _, content, _ in ours}) == 2
    assert answers[0].usage.completion_tokens == 10


def test_an_abort_across_the_split_ends_every_choice(pd_cluster):
    """The client leaves a streamed n = 3 answer: decode's room ends all three sequences, and every
    page of both workers comes back."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "temperature": 1.0, "n": 3, "ignore_eos": True,
            "stream": True, "rid": "n-abort-1"}
    with requests.post(pd_cluster.url + "/v1/completions", json=body, timeout=120, stream=True) as r:
        assert r.status_code == 200, r.text
        seen = set()
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                seen |= {c["index"] for c in json.loads(line[6:])["choices"]}
            if len(seen) == 3:
                break
    assert seen == {0, 1, 2}
    for w in pd_cluster.workers:
        pages_back_to_total(w, timeout=60)
    timeline = requests.get(pd_cluster.decode[0].url + "/debug/requests/n-abort-1", timeout=10).json()
    assert timeline["ending"] == "ABORTED(client_abort)", timeline
