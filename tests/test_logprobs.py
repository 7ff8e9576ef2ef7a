"""Logprobs: values from the model's raw logits (before temperature, top-k/top-p) that agree with
``transformers``' log-softmax in float32 on the tiny model of each family; the OpenAI shapes
(completions, chat, streamed per chunk) read by the official ``openai`` client; SGLang's
``/generate`` fields; and across the split the first token's logprobs, computed on prefill,
reaching the client through decode equal to a colocated worker's.

Servers: the session's colocated worker and its split cluster behind the router (``server``,
``pd_cluster``)."""

from __future__ import annotations

import math

import pytest
import requests
import torch

from conftest import CACHE_DIR
from splitserve.engine.io import GenerateRequest, InvalidRequest, SamplingParams, TokenLogprob

openai = pytest.importorskip("openai")

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
TOL = 1e-4  # |ours - transformers| per logprob, float32 on both sides (measured ~1e-6)
SAME = 5e-5  # between two runs of one request on our workers (measured 4e-6; 1.1e-5 seen on a busy machine)


# -- the engine against transformers, every family ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    from splitserve.testing.tiny import ARCHS, tiny_model_path

    mp = pytest.MonkeyPatch()
    mp.setenv("SPLITSERVE_CACHE", str(CACHE_DIR))
    try:
        return {arch: tiny_model_path(arch) for arch in ARCHS}
    finally:
        mp.undo()


def _reference_logprobs(path, ids: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax of the logits at every position of ``ids`` [T, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_engine_logprobs_are_the_raw_models(tiny_paths, arch):
    """Sampled at temperature 1.7 with top_k 3: the logprobs are still the raw distribution's."""
    from splitserve.config import EngineConfig
    from splitserve.engine.engine import LLMEngine

    path = tiny_paths[arch]
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", quantization="none", max_total_tokens=512))
    prompt = engine.tokenizer.encode(PROMPT)
    sampling = SamplingParams(max_tokens=6, temperature=1.7, top_k=3, seed=5, ignore_eos=True, logprobs=4)
    out = engine.generate([GenerateRequest("a", tuple(prompt), sampling)])["a"]
    assert len(out.logprobs) == len(out.token_ids) == 6
    ref = _reference_logprobs(path, prompt + list(out.token_ids))
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert abs(lp.logprob - row[token].item()) < TOL, (arch, i)
        values, ids = torch.topk(row, 4)
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=TOL)
        assert [t for t, _ in lp.top] == ids.tolist() or _near_tie(values), (arch, i)
        assert lp.top[0][1] >= lp.logprob  # the first alternative is the most likely


def _same(ours: list[dict], theirs: list[dict]) -> None:
    """Chat logprob items alike: the same tokens, logprobs within SAME (a prompt computed in
    another batch shape, or partly read from the prefix cache, rounds differently in float32)."""
    assert [(i["token"], [t["token"] for t in i["top_logprobs"]]) for i in ours] == \
        [(i["token"], [t["token"] for t in i["top_logprobs"]]) for i in theirs]
    for a, b in zip(ours, theirs):
        assert [a["logprob"]] + [t["logprob"] for t in a["top_logprobs"]] == pytest.approx(
            [b["logprob"]] + [t["logprob"] for t in b["top_logprobs"]], abs=SAME)


def _near_tie(values: torch.Tensor) -> bool:
    return bool((values[:-1] - values[1:]).min() < 10 * TOL)


def test_wire_form_round_trips_and_is_checked():
    lp = TokenLogprob(-0.5, ((3, -0.25), (7, -1.5)))
    assert TokenLogprob.from_bytes(lp.to_bytes(), 2, 2048) == lp
    assert len(TokenLogprob(-1.0, tuple((i, -1.0) for i in range(20))).to_bytes()) == 164
    for data, top in [(lp.to_bytes(), 3), (lp.to_bytes()[:-1], 2), (b"", 0),
                      (TokenLogprob(0.5).to_bytes(), 0), (TokenLogprob(float("nan")).to_bytes(), 0),
                      (TokenLogprob(-1.0, ((5000, -1.0),)).to_bytes(), 1)]:
        with pytest.raises(InvalidRequest):
            TokenLogprob.from_bytes(data, top, 2048)
    assert TokenLogprob.from_bytes(TokenLogprob(float("-inf")).to_bytes(), 0, 2048).logprob == float("-inf")


# -- over HTTP -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def colocated(server):
    """The session's worker: the tiny checkpoint is float32 safetensors, which ``--quantization
    auto`` loads unquantized (``models/quantized.py``), as transformers runs it."""
    return server


@pytest.fixture(scope="module")
def pd(pd_cluster):
    return pd_cluster


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _generate(url: str, ids: list[int], n: int, **extra) -> dict:
    r = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": n, "temperature": 0, "ignore_eos": True}, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def tokenizer(colocated):
    from transformers import AutoTokenizer

    path = requests.get(colocated.url + "/get_model_info", timeout=10).json()["tokenizer_path"]
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def test_generate_logprobs_match_transformers(colocated, tokenizer):
    ids = tokenizer.encode(PROMPT)
    body = _generate(colocated.url, ids, 8, return_logprob=True, top_logprobs_num=3, return_text_in_logprobs=True,
                     logprob_start_len=-1)
    meta, out = body["meta_info"], body["output_ids"]
    path = requests.get(colocated.url + "/get_model_info", timeout=10).json()["model_path"]
    ref = _reference_logprobs(path, ids + out)
    assert [e[1] for e in meta["output_token_logprobs"]] == out
    assert meta["input_token_logprobs"] == [] and len(meta["output_top_logprobs"]) == len(out)
    for i, ((lp, token, text), top) in enumerate(zip(meta["output_token_logprobs"], meta["output_top_logprobs"])):
        assert abs(lp - ref[len(ids) - 1 + i, token].item()) < TOL
        assert text == tokenizer.decode([token])
        assert len(top) == 3 and top[0][1] == token and top[0][0] == lp  # greedy: the argmax
    plain = _generate(colocated.url, ids, 8)
    assert plain["output_ids"] == out and "output_token_logprobs" not in plain["meta_info"]
    no_text = _generate(colocated.url, ids, 2, return_logprob=True)["meta_info"]
    assert [e[2] for e in no_text["output_token_logprobs"]] == [None, None]
    assert no_text["output_top_logprobs"] == [[], []]


def test_completions_logprobs_through_the_openai_client(colocated, tokenizer):
    client = _client(colocated.url)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    ids = _generate(colocated.url, tokenizer.encode(PROMPT), 8)["output_ids"]
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == out.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(d) <= 3 for d in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(max(d.values()) == v for d, v in zip(lp.top_logprobs, lp.token_logprobs))  # greedy
    none = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0)
    assert none.choices[0].logprobs is None

    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                       extra_body={"ignore_eos": True}, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == out.choices[0].text
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == lp.tokens
    assert [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs] == pytest.approx(lp.token_logprobs,
                                                                                                 abs=SAME)
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == lp.text_offset


def test_chat_logprobs_through_the_openai_client(colocated, tokenizer):
    client = _client(colocated.url)
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0.9, seed=3,
                                         logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 8
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.top_logprobs[0].logprob >= item.logprob
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token or "\ufffd" in item.token
    joined = b"".join(bytes(item.bytes) for item in content)
    assert joined.decode("utf-8", errors="replace") == out.choices[0].message.content
    bare = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0,
                                          logprobs=True)
    assert all(item.top_logprobs == [] for item in bare.choices[0].logprobs.content)

    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0.9, seed=3,
                                            logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
                                            stream=True)
    streamed = [item for c in stream if c.choices and c.choices[0].logprobs
                for item in c.choices[0].logprobs.content]
    _same([i.model_dump() for i in streamed], [i.model_dump() for i in content])


def test_bad_logprobs_are_400(colocated):
    for path, body, param in [
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 1000}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        ("/generate", {"input_ids": [1], "return_logprob": True, "top_logprobs_num": 10**6}, "top_logprobs_num"),
    ]:
        r = requests.post(colocated.url + path, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# -- across the split ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_split_logprobs_equal_colocated(pd, colocated, tokenizer, stream):
    """The first token's logprobs are computed on prefill and cross with the first token; the
    rest on decode: the client reads exactly what a colocated worker answers."""
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0.8, "seed": 11,
            "logprobs": True, "top_logprobs": 5, "ignore_eos": True, "stream": stream}

    def content(url: str) -> list:
        r = requests.post(url + "/v1/chat/completions", json=body, timeout=120, stream=stream)
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()["choices"][0]["logprobs"]["content"]
        import json

        items = []
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0]["logprobs"]:
                    items += chunk["choices"][0]["logprobs"]["content"]
        return items

    ours, theirs = content(pd.url), content(colocated.url)
    assert len(ours) == 6
    _same(ours, theirs)
    assert all(math.isfinite(item["logprob"]) and len(item["top_logprobs"]) == 5 for item in ours)


# -- the prompt's logprobs (echo) ----------------------------------------------------------------------


def test_engine_prompt_logprobs_are_the_raw_models(tiny_paths):
    """Computed in chunks of 8 (the step budget), with the prompt's pages already in the prefix
    cache (bypassed: every prompt position is computed), with max_tokens 0 (the prompt alone)."""
    from splitserve.config import EngineConfig
    from splitserve.engine.engine import LLMEngine

    path = tiny_paths["llama"]
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", quantization="none", max_total_tokens=512,
                                    max_batch_tokens=8, page_size=4))
    prompt = tuple(engine.tokenizer.encode(PROMPT + " and the capital of Italy is Rome"))
    engine.generate([GenerateRequest("warm", prompt, SamplingParams(max_tokens=1, temperature=0))])
    assert engine.stats().pages_cached > 0
    ref = _reference_logprobs(path, list(prompt))
    for max_tokens in (0, 2):
        out = engine.generate([GenerateRequest(f"p{max_tokens}", prompt, SamplingParams(
            max_tokens=max_tokens, temperature=0, prompt_logprobs=2, logprobs=2))])[f"p{max_tokens}"]
        assert len(out.token_ids) == max_tokens and out.finish_reason == "length"
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for p in range(1, len(prompt)):
            lp = out.prompt_logprobs[p]
            assert abs(lp.logprob - ref[p - 1, prompt[p]].item()) < TOL, p
            assert [v for _, v in lp.top] == pytest.approx(torch.topk(ref[p - 1], 2).values.tolist(), abs=TOL)
    assert engine.stats().pages_free + engine.stats().pages_cached == engine.stats().pages_total


def test_echo_logprobs_through_the_openai_client(colocated, tokenizer):
    client = _client(colocated.url)
    ids = tokenizer.encode(PROMPT)
    path = requests.get(colocated.url + "/get_model_info", timeout=10).json()["model_path"]
    ref = _reference_logprobs(path, ids)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == PROMPT and out.usage.completion_tokens == 0 and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([ref[p - 1, ids[p]].item() for p in range(1, len(ids))], abs=TOL)

    more = client.completions.create(model="tiny", prompt=ids, max_tokens=3, echo=True, logprobs=1, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert more.choices[0].text.startswith(tokenizer.decode(ids))
    assert len(more.choices[0].logprobs.tokens) == len(ids) + 3
    assert more.choices[0].logprobs.token_logprobs[:len(ids)] == pytest.approx(lp.token_logprobs, abs=SAME)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, echo=True, temperature=0)
    assert plain.choices[0].text.startswith(PROMPT) and plain.choices[0].logprobs is None

    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, echo=True, logprobs=1,
                                       temperature=0, extra_body={"ignore_eos": True}, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[0].text.startswith(PROMPT)
    streamed = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    assert streamed == lp.tokens + more.choices[0].logprobs.tokens[len(ids):]

    body = _generate(colocated.url, ids, 0, return_logprob=True, logprob_start_len=2, top_logprobs_num=1)
    meta = body["meta_info"]
    assert body["output_ids"] == [] and [e[1] for e in meta["input_token_logprobs"]] == ids[2:]
    assert [e[0] for e in meta["input_token_logprobs"]] == pytest.approx(lp.token_logprobs[2:], abs=SAME)
    assert [len(t) for t in meta["input_top_logprobs"]] == [1] * (len(ids) - 2)


def test_bad_echo_is_400(colocated):
    for body, param in [({"prompt": "x", "echo": 1}, "echo"), ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "x", "echo": True, "max_tokens": -1}, "max_tokens")]:
        r = requests.post(colocated.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = requests.post(colocated.url + "/generate", json={"input_ids": [5, 6], "return_logprob": True,
                                                         "logprob_start_len": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_start_len", r.text


def test_echo_logprobs_on_decode_alone_equal_colocated(pd, colocated):
    """A decode worker given no bootstrap fields computes the prompt itself: its prompt logprobs
    are a colocated worker's; a prefill worker refuses them (they run on one worker)."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "echo": True, "logprobs": 2, "temperature": 0}

    def logprobs(url: str) -> dict:
        r = requests.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]

    ours, theirs = logprobs(pd.decode[0].url), logprobs(colocated.url)
    assert ours["tokens"] == theirs["tokens"] and ours["token_logprobs"][0] is None
    assert ours["token_logprobs"][1:] == pytest.approx(theirs["token_logprobs"][1:], abs=SAME)
    split = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": pd.prefill[0].bootstrap_port,
             "bootstrap_room": 12345}
    r = requests.post(pd.prefill[0].url + "/v1/completions", json=split, timeout=60)
    assert r.status_code == 400 and "one worker" in r.json()["error"]["message"], r.text


def test_prompt_logprobs_through_the_router_of_a_split_cluster_equal_colocated(pd, colocated):
    """lm-eval's loglikelihood request (``echo``, ``logprobs`` 1, ``max_tokens`` 1, greedy) and the
    prompt alone (``max_tokens`` 0), through the router that splits every request: it sends them to
    decode alone (``router/split.py``), and the answer is a colocated worker's."""
    for extra in ({"max_tokens": 1, "temperature": 0, "seed": 1234}, {"max_tokens": 0}):
        ours, theirs = (_client(url).completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=1, **extra)
                        for url in (pd.url, colocated.url))
        a, b = ours.choices[0], theirs.choices[0]
        assert a.text == b.text and a.logprobs.tokens == b.logprobs.tokens and a.finish_reason == b.finish_reason
        assert a.logprobs.token_logprobs[0] is None and len(a.logprobs.tokens) >= len(PROMPT) // 8
        assert a.logprobs.token_logprobs[1:] == pytest.approx(b.logprobs.token_logprobs[1:], abs=SAME)
        assert ours.usage.completion_tokens == extra["max_tokens"]
