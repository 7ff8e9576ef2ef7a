"""The engine against `transformers` on the tiny models: greedy tokens identical to `generate`
under continuous batching with staggered arrival, chunked prefill on and off, forced preemption,
seeded sampling independent of the batch, a cache that really matters, and no leaked page."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from helpers.hf_greedy import hf_greedy
from helpers.prompts import prompts
from splitserve.config import EngineConfig
from splitserve.engine.engine import LLMEngine, merge_outputs
from splitserve.engine.io import GenerateRequest, SamplingParams

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request):
    return str(tiny_model(request.param))  # the tests' model cache: built once, not per module


@pytest.fixture(scope="module")
def tiny_llama():
    return str(tiny_model("llama"))


def make_engine(model: str, **kw) -> LLMEngine:
    kw.setdefault("page_size", 16)
    kw.setdefault("max_total_tokens", 8192)
    return LLMEngine(EngineConfig(model=model, **kw))


def run_staggered(engine: LLMEngine, reqs: list[GenerateRequest], every: int = 2,
                  squeeze: tuple[int, int] = (-1, -1)) -> dict[str, list[int]]:
    """Submit one request every ``every`` steps while the others run; return generated ids. From
    step ``squeeze[0]`` to ``squeeze[1]`` every available page is out of the scheduler's account
    (as a decode room's are): running sequences that need a page preempt others."""
    pending, outs = list(reqs), {r.rid: [] for r in reqs}
    step, taken = 0, []
    while pending or engine.has_work():
        if step == squeeze[0]:
            taken = engine.allocator.allocate(engine.allocator.num_available)
        if step == squeeze[1]:
            engine.allocator.free(taken)
        if pending and step % every == 0:
            engine.add_request(pending.pop(0))
        for out in engine.step().outputs:
            outs[out.rid].append(out)
        step += 1
    merged = {rid: merge_outputs(o) for rid, o in outs.items()}
    assert all(m.finished and m.error is None for m in merged.values())
    return {rid: list(m.token_ids) for rid, m in merged.items()}


def assert_pool_full(engine: LLMEngine):
    """Nothing owned any more; once the prefix cache is flushed, every page free."""
    s = engine.stats()
    assert s.pages_owned == 0 and s.waiting == 0 and s.running == 0, s
    assert s.pages_free + s.pages_cached == s.pages_total, s
    engine.flush_cache()
    assert engine.stats().pages_free == s.pages_total


def test_greedy_matches_transformers_generate_with_staggered_arrival(tiny):
    engine = make_engine(tiny, max_batch_tokens=128)  # small budget: prompts are chunked while others decode
    ps = prompts(engine.spec.vocab_size)
    got = run_staggered(engine, [GenerateRequest(f"r{i}", tuple(p), GREEDY) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == hf_greedy(tiny, p, NEW_TOKENS), f"prompt {i} ({len(p)} tokens)"
    assert_pool_full(engine)


def test_chunked_unchunked_and_preempted_runs_agree(tiny_llama):
    ps = prompts(2048, [30, 70, 120, 200, 33, 90])
    reqs = [GenerateRequest(f"r{i}", tuple(p), SamplingParams(temperature=0.0, max_tokens=40)) for i, p in enumerate(ps)]
    chunked = make_engine(tiny_llama, max_batch_tokens=64, chunked_prefill=True)
    unchunked = make_engine(tiny_llama, max_batch_tokens=64, chunked_prefill=False)
    # 40 pages of 16 tokens cannot hold all six requests at full length: they wait their turn, and
    # while the free pages are out of the account, running ones are preempted and recompute
    tight = make_engine(tiny_llama, max_batch_tokens=64, max_total_tokens=40 * 16)
    a = run_staggered(chunked, reqs, every=1)
    b = run_staggered(unchunked, reqs, every=1)
    c = run_staggered(tight, reqs, every=1, squeeze=(8, 30))
    assert tight.stats().preemptions > 0
    assert a == b == c
    for e in (chunked, unchunked, tight):
        assert_pool_full(e)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny_llama):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=32)
    ps = prompts(2048, [50, 20, 80, 10])
    alone = make_engine(tiny_llama).generate([GenerateRequest("s", tuple(ps[0]), params)])["s"]
    engine = make_engine(tiny_llama, max_batch_tokens=32)
    others = [GenerateRequest(f"o{i}", tuple(p), SamplingParams(temperature=1.0, max_tokens=40)) for i, p in enumerate(ps[1:])]
    got = run_staggered(engine, others[:2] + [GenerateRequest("s", tuple(ps[0]), params)] + others[2:], every=3)
    assert got["s"] == list(alone.token_ids)
    unseeded = make_engine(tiny_llama).generate(
        [GenerateRequest("u", tuple(ps[0]), SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=99, max_tokens=32))])
    assert list(unseeded["u"].token_ids) != got["s"]  # the seed matters
    assert_pool_full(engine)


def test_changing_one_kv_page_changes_the_tokens(tiny_llama):
    engine = make_engine(tiny_llama)
    prompt = tuple(prompts(2048, [300], seed=5)[0])
    params = SamplingParams(temperature=0.0, max_tokens=32)
    clean = engine.generate([GenerateRequest("clean", prompt, params)])["clean"].token_ids
    engine.add_request(GenerateRequest("hit", prompt, params))
    outs = []
    while not outs:  # run until the prompt is in the cache and the first token is out
        outs += engine.step().outputs
    seq = engine._seqs["hit"]
    victim = seq.pages[len(seq.pages) // 2]  # a page in the middle of the prompt
    engine.kv.buffer[victim] = torch.randn_like(engine.kv.buffer[victim])
    while engine.has_work():
        outs += engine.step().outputs
    hit = merge_outputs(outs).token_ids
    assert hit[0] == clean[0]  # the first token was sampled before the page changed
    assert hit != clean
    assert_pool_full(engine)


def test_stop_strings_eos_and_abort_end_requests_and_free_pages(tiny_llama):
    engine = make_engine(tiny_llama)
    p = tuple(prompts(2048, [20], seed=9)[0])
    full = engine.generate([GenerateRequest("f", p, SamplingParams(temperature=0.0, max_tokens=30))])["f"]
    assert full.finish_reason == "length" and full.completion_tokens == 30
    stop = full.text[10:13]
    cut = engine.generate([GenerateRequest("s", p, SamplingParams(temperature=0.0, max_tokens=30, stop=(stop,)))])["s"]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]
    stop_id = full.token_ids[5]
    by_id = engine.generate([GenerateRequest("t", p, SamplingParams(temperature=0.0, max_tokens=30,
                                                                    stop_token_ids=(stop_id,)))])["t"]
    assert by_id.finish_reason == "stop" and list(by_id.token_ids) == list(full.token_ids[:full.token_ids.index(stop_id) + 1])
    engine.add_request(GenerateRequest("a", p, SamplingParams(temperature=0.0, max_tokens=30)))
    engine.step()
    out = engine.abort("a")
    assert out.finished and out.error and out.finish_reason is None
    assert engine.abort("a") is None  # a second abort is a no-op
    assert_pool_full(engine)


def test_a_step_of_prompt_chunks_only_samples_nothing(tiny_llama):
    # a prompt longer than the step budget: the first steps run chunks and sample no token
    engine = make_engine(tiny_llama, max_batch_tokens=64)
    prompt = tuple(prompts(2048, [200], seed=4)[0])
    engine.add_request(GenerateRequest("long", prompt, SamplingParams(temperature=0.0, max_tokens=4)))
    for _ in range(3):
        report = engine.step()
        assert report.outputs == [] and [seq.rid for seq in report.chunks] == ["long"]
    outs = []
    while engine.has_work():
        outs += engine.step().outputs
    assert merge_outputs(outs).token_ids == tuple(hf_greedy(tiny_llama, list(prompt), 4))
    assert_pool_full(engine)
