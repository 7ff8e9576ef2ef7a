"""The prefix cache (``engine/page_allocator.py``, ``engine/scheduler.py``): its page account, and
outputs token-identical to an engine without it — over conversations whose turns share prefixes
across page boundaries, with preemption forced and with cached pages evicted between turns, greedy
and seeded. Every test that compares also checks that the cache did hit (and that preemption or
eviction did happen where it is forced), so none can pass with the cache off."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from splitserve.config import EngineConfig
from splitserve.engine.engine import LLMEngine, merge_outputs
from splitserve.engine.io import GenerateRequest, SamplingParams
from splitserve.engine.page_allocator import PageAllocator, page_keys

P = 16


# -- the account ---------------------------------------------------------------------------------


def account(a: PageAllocator) -> tuple[int, int, int]:
    assert a.num_free + a.num_cached + a.num_owned == a.num_pages
    return a.num_free, a.num_cached, a.num_owned


def test_cached_pages_are_shared_read_only_and_evicted_least_recently_used():
    a = PageAllocator(6)
    keys = page_keys(list(range(3 * P)), P, 3)
    pages = a.allocate(3)
    assert [a.insert(p, k) for p, k in zip(pages, keys)] == [True, True, True]
    assert account(a) == (3, 0, 3)
    a.free(pages)  # the owner is done: cached, evictable
    assert account(a) == (3, 3, 0)
    shared = a.match(keys[:2]) + a.match(keys[:1])  # two owners of page 0, one of page 1
    assert shared == [pages[0], pages[1], pages[0]] and account(a) == (3, 1, 2)
    a.free(shared[:2])
    assert account(a) == (3, 2, 1)  # page 0 still owned once
    a.free([pages[0]])
    with pytest.raises(ValueError):
        a.free([pages[0]])  # a cached page no one owns cannot be freed again
    assert a.allocate(4) and account(a) == (0, 2, 4)  # one eviction: the least recently used (page 2)
    assert a.evictions == 1 and a.match(keys[2:]) == [] and not a.is_cached(pages[2])
    assert a.flush() == 2 and account(a) == (2, 0, 4)


def test_each_page_reads_as_free_evictable_or_owned_with_its_references():
    a = PageAllocator(4)
    keys = page_keys(list(range(2 * P)), P, 2)
    pages = a.allocate(3)
    assert all(a.insert(p, k) for p, k in zip(pages, keys))
    a.free(pages[:2])
    assert a.match(keys[:1]) + a.match(keys[:1]) == [pages[0]] * 2  # two owners; page 1 none; page 2 plain
    assert [a.is_free(p) for p in range(4)] == [False, False, False, True]
    assert [a.is_evictable(p) for p in range(4)] == [False, True, False, False]
    assert dict(a.refcounts()) == {pages[0]: 2, pages[1]: 0}
    with pytest.raises(TypeError):
        a.refcounts()[pages[0]] = 1  # read-only: the account is the allocator's


def test_keys_chain_every_page_before_and_the_salt():
    tokens = list(range(3 * P))
    base = page_keys(tokens, P, 3)
    assert page_keys(tokens, P, 3) == base and len(set(base)) == 3
    changed = page_keys([99] + tokens[1:], P, 3)
    assert all(a != b for a, b in zip(base, changed))  # a change in page 0 changes every later key
    assert page_keys(tokens, P, 3, salt="tenant-b")[0] != base[0]
    assert page_keys(tokens[P:], P, 2, parent=base[0]) == base[1:]  # extending a chain
    assert page_keys(tokens[:P + 3], P, 3) == base[:1]  # only full pages


def test_an_allocator_without_cache_never_keeps_a_page():
    a = PageAllocator(4, cache=False)
    pages = a.allocate(2)
    assert not a.insert(pages[0], page_keys(list(range(P)), P, 1)[0])
    a.free(pages)
    assert account(a) == (4, 0, 0) and a.match(page_keys(list(range(P)), P, 1)) == []


# -- outputs against an engine without the cache ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return str(tiny_model("llama"))  # the tests' model cache: built once, not per module


def engine(model: str, cache: bool, pages: int = 512, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, page_size=P, max_total_tokens=pages * P, prefix_cache=cache, **kw))


def conversation(vocab: int, seed: int, turns: int = 3) -> list[list[int]]:
    """Prompts of a multi-turn conversation: each turn's prompt is the previous one plus a new
    message (lengths not multiples of the page size, so turns share partly filled pages too)."""
    g = torch.Generator().manual_seed(seed)
    prompt, out = torch.randint(10, vocab, (37,), generator=g).tolist(), []
    for _ in range(turns):
        out.append(list(prompt))
        prompt += torch.randint(10, vocab, (21,), generator=g).tolist()
    return out


def run(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> list[list[int]]:
    """One request per prompt, each after the previous one ended (as turns do)."""
    answers = []
    for i, ids in enumerate(prompts):
        out = eng.generate([GenerateRequest(f"{tag}{i}", tuple(ids), params)])[f"{tag}{i}"]
        assert out.finished and out.error is None, out
        answers.append(list(out.token_ids))
    return answers


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=20),
                                    pytest.param(SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20),
                                                 marks=pytest.mark.long)],  # everyday: greedy
                         ids=["greedy", "seeded"])
def test_turns_that_share_a_prefix_match_an_engine_without_the_cache(tiny, params):
    with_cache, without = engine(tiny, True), engine(tiny, False)
    prompts = [p for seed in (1, 2) for p in conversation(with_cache.spec.vocab_size, seed)]
    prompts.append(prompts[0])  # an identical prompt: all but its last token from the cache
    assert run(with_cache, prompts, params, "c") == run(without, prompts, params, "n")
    stats = with_cache.stats()
    assert stats.cache_hit_tokens >= 2 * 32 + (37 // P) * P, stats  # every later turn hit
    assert stats.prompt_tokens_computed < without.stats().prompt_tokens_computed
    assert without.stats().cache_hit_tokens == 0 and without.stats().pages_cached == 0


def generate_squeezed(eng: LLMEngine, reqs: list[GenerateRequest], first: int, last: int) -> dict:
    """``eng.generate(reqs)``, with every available page out of the scheduler's account (as a decode
    room's are) from step ``first`` to ``last``: running sequences that need a page preempt others."""
    for r in reqs:
        eng.add_request(r)
    acc, step, taken = {r.rid: [] for r in reqs}, 0, []
    while eng.has_work():
        if step == first:
            taken = eng.allocator.allocate(eng.allocator.num_available)
        if step == last:
            eng.allocator.free(taken)
        for out in eng.step().outputs:
            acc[out.rid].append(out)
        step += 1
    return {rid: merge_outputs(outs) for rid, outs in acc.items()}


def test_forced_preemption_and_evictions_keep_the_outputs(tiny):
    """A pool of 12 pages, two conversations at once with long answers while the free pages leave
    the account for a while: sequences are preempted (their pages freed, their full pages kept
    cached), and cached prefixes are evicted between turns to make room — and the answers are
    still those of an engine without the cache."""
    params = SamplingParams(temperature=0.0, max_tokens=60)
    small = engine(tiny, True, pages=12, max_running_requests=2)
    ref = engine(tiny, False, pages=64)
    convs = [conversation(small.spec.vocab_size, seed, turns=2) for seed in (3, 4)]
    answers = {}
    for turn in range(2):
        reqs = [GenerateRequest(f"c{k}-{turn}", tuple(conv[turn]), params) for k, conv in enumerate(convs)]
        out = generate_squeezed(small, reqs, 2, 20)
        answers.update({rid: list(o.token_ids) for rid, o in out.items()})
    want = {f"c{k}-{turn}": run(ref, [conv[turn]], params, f"r{k}{turn}")[0]
            for k, conv in enumerate(convs) for turn in range(2)}
    assert answers == want
    s = small.stats()
    assert s.preemptions > 0 and s.cache_evictions > 0 and s.cache_hit_tokens > 0, s
    assert s.pages_owned == 0 and s.pages_free + s.pages_cached == s.pages_total


def test_requests_with_another_salt_share_nothing(tiny):
    eng = engine(tiny, True)
    ids = tuple(conversation(eng.spec.vocab_size, 5, turns=1)[0])
    params = SamplingParams(temperature=0.0, max_tokens=4)
    eng.generate([GenerateRequest("a", ids, params, cache_salt="tenant-a")])
    eng.generate([GenerateRequest("b", ids, params, cache_salt="tenant-b")])
    assert eng.stats().cache_hit_tokens == 0
    eng.generate([GenerateRequest("c", ids, params, cache_salt="tenant-a")])
    assert eng.stats().cache_hit_tokens == (len(ids) - 1) // P * P


# -- across the split ------------------------------------------------------------------------------


def test_turns_through_a_split_pair_hit_both_caches_and_cross_only_the_missing_pages():
    """Two conversations of three turns through a router in front of one prefill and one decode
    worker (tcp transfer); each turn's prompt is the last one, its answer and a new message. The
    answers equal a colocated worker's without the cache; decode found the earlier turns in its own
    cache (so prefill wrote only the missing pages: fewer KV bytes crossed than the prompts hold),
    and prefill found them in its cache (it computed fewer prompt tokens than it received)."""
    from cluster import Cluster, generate, metric_sum, metrics, pages_back_to_total
    from conftest import ServerProcess

    greedy = {"temperature": 0}
    ref = ServerProcess("--no-prefix-cache", "--page-size", str(P)).spawn()  # loads while the cluster starts
    with ref, Cluster(1, 1, "tcp", worker_args=["--page-size", str(P)]) as c:
        ref.wait_ready()
        vocab = 2048
        prompt_tokens = 0
        for seed in (11, 12):
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(10, vocab, (45,), generator=g).tolist()
            for turn in range(3):
                got = generate(c.url, ids, 12, **greedy)
                assert got == generate(ref.url, ids, 12, **greedy), (seed, turn)
                prompt_tokens += len(ids)
                ids = ids + got + torch.randint(10, vocab, (19,), generator=g).tolist()
        P_, D = c.prefill[0], c.decode[0]
        pm, dm = metrics(P_), metrics(D)
        page_bytes = 4 * 2 * P * 2 * 32 * 4  # tiny llama: layers x (k, v) x page x kv heads x head dim x float32
        written = metric_sum(pm, "splitserve_kv_transfer_bytes_total", role="prefill")
        full_pages = prompt_tokens / P
        assert metric_sum(dm, "splitserve_prefix_cache_hit_tokens_total", role="decode") >= 4 * 3 * P, dm
        assert metric_sum(pm, "splitserve_prefix_cache_hit_tokens_total", role="prefill") >= 4 * 3 * P, pm
        assert metric_sum(pm, "splitserve_prompt_tokens_computed_total", role="prefill") < prompt_tokens
        assert 0 < written < 0.75 * full_pages * page_bytes, (written, full_pages * page_bytes)
        assert metric_sum(dm, "splitserve_kv_transfer_bytes_total", role="decode") == written
        for w in c.workers:
            pages_back_to_total(w)
