"""Disaggregated serving end to end: real prefill and decode workers, KV pages over NIXL (or the
built-in ``tcp`` backend), the router in front, and a colocated worker as the reference. What the
client gets through the split path must be token for token what one colocated worker gives, and
every worker must hand all its KV pages back afterwards.

- 25 prompts of 1 to 3,000 tokens, greedy, every other one streamed, four at a time: 1 prefill +
  1 decode over nixl. One of each length around the boundaries (``BOUNDARY_LENGTHS``: pages of 16,
  chunks of 2,048, the default ``--max-batch-tokens``, and the longest) and ten drawn
  log-uniformly, so that each batch mixes short and long prompts and some lengths fall between
  the boundaries.
- About ten prompts each with 2 prefill + 2 decode workers (nixl) and 1 + 1 over tcp.
- A seeded sampled request (temperature 0.8, top_p 0.9, seed 1234).
- ``/v1/completions`` and ``/v1/chat/completions``, plain and streamed.
- Requests that end on the prefill worker (one new token; a stop token id or a stop string that
  the first token matches) still get their answer from decode.

The 1 + 1 nixl cluster is the session's ``pd_cluster`` (the other shapes are started within their
test) and the colocated reference the session's ``server``. ``pd_cluster``'s decode worker runs
the product's ``--kv-failure-policy recompute``, under which a lost transfer would still give the
colocated tokens (decode computes the prompt itself), as would the router's decode-alone
fallback: every test on it checks that decode computed no prompt (``all_transferred``), so each
answer's KV came over the transfer. The file's duration is printed at the end of the module.
"""

from __future__ import annotations

import math
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from cluster import Cluster, generate, metric, metric_sum, metrics, pages_back_to_total, post_generate
from helpers.sse import sse_events

NEW_TOKENS = 8
CONCURRENCY = 4
VOCAB_LO, VOCAB_HI = 10, 2047  # ordinary tokens of the tiny model
# Around page (16) and chunk (2048, the default --max-batch-tokens) boundaries, and the longest.
BOUNDARY_LENGTHS = [1, 2, 15, 16, 17, 31, 32, 33, 255, 256, 257, 2047, 2048, 2049, 3000]
N_PROMPTS = len(BOUNDARY_LENGTHS) + 10  # each boundary length once, and ten drawn lengths
GREEDY = {"temperature": 0}


def random_prompts(n: int, seed: int, fixed=(), max_len: int = 3000) -> list[list[int]]:
    """``n`` prompts of random ordinary ids: first the ``fixed`` lengths, then lengths drawn
    log-uniformly from 1..``max_len`` (mostly short ones: long prompts cost two CPU cores dearly,
    and the boundaries that matter are in ``fixed``)."""
    rng = random.Random(seed)
    lengths = list(fixed)[:n]
    lengths += [min(max_len, int(math.exp(rng.uniform(0, math.log(max_len + 1))))) or 1
                for _ in range(n - len(lengths))]
    rng.shuffle(lengths)  # long and short prompts mixed in every batch of concurrent requests
    return [[rng.randint(VOCAB_LO, VOCAB_HI) for _ in range(length)] for length in lengths]


def run_all(url: str, prompts: list[list[int]], stream_every_other: bool, new_tokens: int = NEW_TOKENS,
            **sampling) -> list[list[int]]:
    """Every prompt through ``url``, ``CONCURRENCY`` at a time (prompt i streamed when i is odd)."""
    def one(i: int) -> list[int]:
        return generate(url, prompts[i], new_tokens, stream=stream_every_other and i % 2 == 1, **sampling)

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(one, range(len(prompts))))


def assert_same(prompts, got, want, what: str, new_tokens: int = NEW_TOKENS) -> None:
    bad = [(i, len(prompts[i]), got[i], want[i]) for i in range(len(prompts)) if got[i] != want[i]]
    assert not bad, f"{what}: {len(bad)} of {len(prompts)} differ from colocated " \
                    f"(index, prompt length, disaggregated, colocated): {bad[:5]}"
    assert all(len(w) == new_tokens for w in want), "the reference stopped early: the comparison is weaker"


TIMES: dict[str, float] = {}  # what took how long, printed at the end of the module


class timer:
    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        self.started = time.monotonic()

    def __exit__(self, *exc):
        TIMES[self.what] = TIMES.get(self.what, 0.0) + time.monotonic() - self.started


@pytest.fixture(scope="module", autouse=True)
def timed(request):
    """Print how long this file took (and its main parts), past pytest's output capture."""
    started = time.monotonic()
    yield
    parts = ", ".join(f"{k} {v:.1f}s" for k, v in TIMES.items())
    line = f"{request.module.__name__}: {time.monotonic() - started:.1f}s ({parts})"
    capman = request.config.pluginmanager.getplugin("capturemanager")
    reporter = request.config.pluginmanager.getplugin("terminalreporter")
    if capman is None or reporter is None:
        print(line)
        return
    with capman.global_and_fixture_disabled():
        reporter.write_line("\n" + line)


@pytest.fixture(scope="module")
def pd(pd_cluster):
    """One prefill and one decode worker over nixl, with the router in front: the session's."""
    return pd_cluster


def prompts_on_decode(pd) -> tuple[float, float]:
    """Decode's prompts computed there (alone or as a KV fallback) and its KV fallbacks, so far."""
    samples = metrics(pd.decode[0])
    return (metric(samples, "splitserve_decode_prompts_computed_total"),
            metric_sum(samples, "splitserve_kv_fallback_total"))


@pytest.fixture(autouse=True)
def all_transferred(request):
    """A test on ``pd``: decode computed no prompt meanwhile (no KV fallback under its recompute
    policy, no decode-alone fallback of the router): every answer's KV came from prefill."""
    if "pd" not in request.fixturenames:
        yield
        return
    pd = request.getfixturevalue("pd")
    before = prompts_on_decode(pd)
    yield
    assert prompts_on_decode(pd) == before, \
        f"decode computed prompts itself (prompts computed, KV fallbacks: {before} -> {prompts_on_decode(pd)})"


@pytest.fixture(scope="module")
def colocated(server):
    return server


# -- greedy: token for token the colocated answer ----------------------------------------------------


def test_boundary_and_drawn_prompts_match_colocated(pd, colocated):
    """Every boundary length of ``BOUNDARY_LENGTHS`` once and ten drawn ones (the module's
    docstring), through the split and through the colocated worker: the same tokens."""
    prompts = random_prompts(N_PROMPTS, seed=20250101, fixed=BOUNDARY_LENGTHS)
    assert set(BOUNDARY_LENGTHS) <= {len(p) for p in prompts}
    prefill, decode = pd.prefill[0], pd.decode[0]
    finished = [metric_sum(metrics(w), "splitserve_requests_total", outcome="finished") for w in (prefill, decode)]
    with timer(f"{N_PROMPTS} colocated"):
        want = run_all(colocated.url, prompts, stream_every_other=False, **GREEDY)
    with timer(f"{N_PROMPTS} disaggregated"):
        got = run_all(pd.url, prompts, stream_every_other=True, **GREEDY)
    assert_same(prompts, got, want, "1 prefill + 1 decode over nixl")
    for worker in pd.workers + [colocated]:
        pages_back_to_total(worker)
    assert metric_sum(metrics(prefill), "splitserve_requests_total", outcome="finished") - finished[0] >= N_PROMPTS
    assert metric_sum(metrics(decode), "splitserve_requests_total", outcome="finished") - finished[1] >= N_PROMPTS
    assert "ended FINISHED(transferred)" in prefill.stderr()


@pytest.fixture(scope="module")
def ten_prompts(colocated):
    """Ten prompts and their colocated greedy answers, shared by the other cluster shapes."""
    prompts = random_prompts(10, seed=7, fixed=[1, 16, 17, 2049, 3000])
    with timer("10 colocated"):
        return prompts, run_all(colocated.url, prompts, stream_every_other=False, **GREEDY)


@pytest.mark.parametrize("backend, n", [
    # 14 s: `make check-long` (the everyday suite is near its 10 minutes; 2 + 2 workers run every day
    # in the simulator's seeds, with the real roles and router on a simulated network)
    pytest.param("nixl", 2, id="nixl-2x2", marks=pytest.mark.long),
    pytest.param("tcp", 1, id="tcp-1x1"),
])
def test_other_shapes_match_colocated(ten_prompts, backend, n):
    prompts, want = ten_prompts
    with timer(f"start {backend} {n}+{n}"):
        cluster = Cluster(prefill=n, decode=n, backend=backend).start()
    with cluster, timer(f"10 {backend} {n}+{n}"):
        got = run_all(cluster.url, prompts, stream_every_other=True, **GREEDY)
        assert_same(prompts, got, want, f"{n} prefill + {n} decode over {backend}")
        for worker in cluster.workers:
            pages_back_to_total(worker)
            served = metric_sum(metrics(worker), "splitserve_requests_total", outcome="finished")
            assert served >= 1, f"{worker.role} worker {worker.url} served nothing: the router used one only"


def test_decode_preempts_and_recomputes_locally(colocated):
    """A decode pool too small for every request's generated tokens at once (20 pages of 16): decode
    preempts decoding rooms and recomputes their KV itself; the tokens still equal colocated."""
    prompts = random_prompts(6, seed=31, fixed=[60, 61, 62, 63, 64, 65])
    want = run_all(colocated.url, prompts, stream_every_other=False, new_tokens=60, **GREEDY)
    with Cluster(prefill=1, decode=1, decode_args=["--max-total-tokens", "320"]).start() as cluster:
        got = run_all(cluster.url, prompts, stream_every_other=True, new_tokens=60, **GREEDY)
        assert_same(prompts, got, want, "decode with a 320-token pool", new_tokens=60)
        decode = cluster.decode[0]
        assert metric(metrics(decode), "splitserve_preemptions") > 0, "the pool was big enough: nothing tested"
        for worker in cluster.workers:
            pages_back_to_total(worker)


# -- sampling -----------------------------------------------------------------------------------------


def test_seeded_sampling_matches_colocated(pd, colocated):
    prompt = random_prompts(1, seed=99, fixed=[40])[0]
    sampling = {"temperature": 0.8, "top_p": 0.9, "seed": 1234}
    with timer("sampling colocated"):
        want = generate(colocated.url, prompt, 24, **sampling)
        greedy = generate(colocated.url, prompt, 24, **GREEDY)
        again = generate(colocated.url, prompt, 24, **sampling)
    assert want != greedy, "the sampled answer is the greedy one: this test would prove nothing"
    assert again == want, "colocated sampling is not reproducible"
    with timer("sampling disaggregated"):
        assert generate(pd.url, prompt, 24, **sampling) == want
        assert generate(pd.url, prompt, 24, stream=True, **sampling) == want
    pages_back_to_total(pd.decode[0])


# -- the OpenAI API through the router ----------------------------------------------------------------


def _openai(url: str, path: str, body: dict) -> tuple[str, str]:
    """(text, finish_reason) of a completion or chat completion, plain or streamed."""
    resp = requests.post(url + path, json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    chat = path.endswith("chat/completions")
    if not body.get("stream"):
        choice = resp.json()["choices"][0]
        return (choice["message"]["content"] if chat else choice["text"]), choice["finish_reason"]
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]", resp.text
    assert not any("error" in e for e in events[:-1]), resp.text
    text, reason = "", None
    for event in events[:-1]:
        choice = event["choices"][0]
        text += (choice["delta"].get("content") or "") if chat else choice["text"]
        reason = choice.get("finish_reason") or reason
    return text, reason


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "The quick brown fox jumps over the lazy dog. Once upon a time", "max_tokens": 12}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Tell me about the sea."}],
                              "max_tokens": 12}),
], ids=["completions", "chat"])
def test_openai_api_matches_colocated(pd, colocated, path, body, stream):
    body = {**body, "temperature": 0, "stream": stream}
    want = _openai(colocated.url, path, body)
    assert want[0], "the reference answered no text: the comparison would be empty"
    assert _openai(pd.url, path, body) == want


# -- requests that end on the prefill worker ----------------------------------------------------------


def _generate_body(url: str, prompt, stream: bool, **sampling) -> dict:
    """The final ``/generate`` body (the last SSE chunk when streamed)."""
    resp = post_generate(url, prompt, sampling.pop("max_new_tokens"), stream, **sampling)
    assert resp.status_code == 200, resp.text
    if not stream:
        return resp.json()
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), resp.text
    return events[-2]


def _first_token(colocated, prompt) -> tuple[int, str]:
    body = _generate_body(colocated.url, prompt, False, max_new_tokens=1, **GREEDY)
    return body["output_ids"][0], body["text"]


@pytest.fixture(scope="module")
def prompt_with_text(colocated):
    """A prompt whose first greedy token decodes to non-empty text not seen again in the answer."""
    for prompt in random_prompts(20, seed=5, max_len=60):
        token, text = _first_token(colocated, prompt)
        rest = generate(colocated.url, prompt, NEW_TOKENS, **GREEDY)
        if text.strip() and rest[1:].count(token) == 0:
            return prompt, token, text
    pytest.fail("no prompt of 20 starts with a token that has text")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("case", ["max_new_tokens_1", "stop_token_id", "stop_string"])
def test_finished_on_prefill_still_answered_by_decode(pd, colocated, prompt_with_text, case, stream):
    prompt, token, text = prompt_with_text
    sampling = {"max_new_tokens": NEW_TOKENS, **GREEDY}
    if case == "max_new_tokens_1":
        sampling["max_new_tokens"] = 1
    elif case == "stop_token_id":
        sampling["stop_token_ids"] = [token]
    else:
        sampling["stop"] = [text]
    want = _generate_body(colocated.url, prompt, stream, **sampling)
    got = _generate_body(pd.url, prompt, stream, **sampling)
    assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"], (got, want)
    assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    assert len(want["output_ids"]) <= 1  # the answer ended with the first token: on prefill
    pages_back_to_total(pd.decode[0])
    pages_back_to_total(pd.prefill[0])
