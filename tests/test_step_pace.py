"""A step's prompt budget beside decoding sequences (``engine/step_pace.py``): the running
averages it keeps from step timings, the scheduler holding prompt chunks to it only while a
sequence decodes, and a real engine on the tiny model giving the same tokens with and without it
(row invariance) while its mixed steps stay within the budget."""

import pytest

from helpers.scheduler_steps import advance, seq
from splitserve.config import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.io import GenerateRequest, SamplingParams
from splitserve.engine.page_allocator import PageAllocator
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.step_pace import MIN_PROMPT_TOKENS, StepPace


def shape(batch):
    return [(i.seq.rid, i.num_tokens) for i in batch]


def test_no_budget_until_both_costs_are_measured():
    pace = StepPace(1.0)
    assert pace.prompt_budget() is None
    pace.note(decoding=4, prompt_tokens=0, seconds=0.1)
    assert pace.prompt_budget() is None  # a prompt token's cost is not known yet
    pace.note(decoding=4, prompt_tokens=100, seconds=0.6)  # 0.5 s beyond the decode step: 5 ms a token
    assert pace.decode_s == pytest.approx(0.1) and pace.token_s == pytest.approx(0.005)
    assert pace.prompt_budget() == 20  # 1.0 x 0.1 s / 5 ms


def test_budget_follows_the_ratio_and_has_a_floor():
    pace = StepPace(2.0)
    pace.note(4, 0, 0.1)
    pace.note(0, 1000, 1.0)  # prompt alone: 1 ms a token
    assert pace.prompt_budget() == 200
    slow = StepPace(0.01)
    slow.note(4, 0, 0.1)
    slow.note(0, 1000, 1.0)
    assert slow.prompt_budget() == MIN_PROMPT_TOKENS  # 1 token by the ratio: the floor keeps prompts moving


def test_ratio_zero_is_no_limit_and_bad_ratios_refused():
    pace = StepPace(0)
    pace.note(4, 0, 0.1)
    pace.note(4, 100, 0.6)
    assert pace.prompt_budget() is None
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="--prompt-chunk-cost"):
            StepPace(bad)


def test_steps_that_measure_nothing_change_nothing():
    pace = StepPace(1.0)
    for seconds in (0.0, -1.0, float("nan"), float("inf")):
        pace.note(4, 0, seconds)
        pace.note(0, 100, seconds)
    assert pace.decode_s is None and pace.token_s is None
    pace.note(4, 100, 0.5)  # a mixed step before any decode step: its prompt share is unknown
    assert pace.token_s is None


def test_averages_move_toward_new_steps():
    pace = StepPace(1.0)
    pace.note(4, 0, 0.1)
    for _ in range(50):
        pace.note(4, 0, 0.3)  # the machine got slower (or the batch larger)
    assert pace.decode_s == pytest.approx(0.3, rel=1e-3)


def test_scheduler_caps_prompt_chunks_only_beside_a_decoding_sequence():
    s = Scheduler(PageAllocator(256), 4, 8, 256, True)
    a = seq("a", 8)
    s.add(a)
    first = s.schedule(prompt_budget=4)
    assert shape(first) == [("a", 8)]  # nothing decodes: the budget is not applied
    advance(first)
    b = seq("b", 100)
    s.add(b)
    batch = s.schedule(prompt_budget=24)
    assert shape(batch) == [("a", 1), ("b", 24)]  # a decodes: b's chunk is the budget
    advance(batch)
    batch = s.schedule(prompt_budget=30)
    assert shape(batch) == [("a", 1), ("b", 30)]
    advance(batch)
    s.add(seq("c", 100))
    batch = s.schedule(prompt_budget=None)
    assert shape(batch) == [("a", 1), ("b", 46), ("c", 100)]  # no budget: max_batch_tokens alone


@pytest.fixture(scope="module")
def tiny_llama_engine_parts():
    from conftest import tiny_model

    path = str(tiny_model("llama"))
    return lambda **kw: LLMEngine(EngineConfig(model=path, dtype="float32", max_total_tokens=2048, page_size=4,
                                               prefix_cache=False, **kw))


def _run(engine: LLMEngine, reqs: list[GenerateRequest], budget):
    """Submit the first request, the others once it decodes; step with ``budget``. The generated
    ids by request, and the prompt tokens of each step that ran beside a decoding sequence."""
    outs, beside = {r.rid: [] for r in reqs}, []
    engine.add_request(reqs[0])
    pending = list(reqs[1:])
    while pending or engine.has_work():
        decoding = any(s.decoding for s in engine.scheduler.running)
        if decoding and pending:
            engine.add_request(pending.pop(0))
        before = engine.prompt_tokens_computed
        for out in engine.step(budget).outputs:
            outs[out.rid] += out.token_ids
        if decoding:
            beside.append(engine.prompt_tokens_computed - before)
    return outs, beside


def test_engine_gives_the_same_tokens_under_a_prompt_budget(tiny_llama_engine_parts):
    """Row invariance: a chunk's size never changes a token; while a sequence decodes, the long
    prompt that arrives moves at most 16 tokens a step."""
    from helpers.prompts import prompt

    params = SamplingParams(temperature=0.0, max_tokens=24)
    reqs = [GenerateRequest(f"r{i}", tuple(prompt(n, seed=i)), params) for i, n in enumerate((20, 150))]
    free, _ = _run(tiny_llama_engine_parts(), reqs, None)
    held, beside = _run(tiny_llama_engine_parts(), reqs, 16)
    assert held == free and all(len(ids) == 24 for ids in held.values())
    assert max(beside) == 16 and all(n <= 16 for n in beside)



def test_short_prompts_run_between_a_long_prompts_chunks():
    """A long prompt running leaves up to half the step to the short prompts queued behind it
    (before: it took every step until its last chunk, and they waited)."""
    s = Scheduler(PageAllocator(512), 4, 8, 64, True)
    long, short1, short2 = seq("long", 400), seq("s1", 10), seq("s2", 30)
    s.add(long)
    first = s.schedule()
    assert shape(first) == [("long", 64)]  # nothing waits: the whole budget
    advance(first)
    s.add(short1)
    s.add(short2)
    batch = s.schedule()
    assert shape(batch) == [("long", 32), ("s1", 10), ("s2", 22)]  # half kept: 40 wanted, 32 given
    advance(batch)
    assert shape(s.schedule()) == [("s1", 1), ("s2", 8), ("long", 55)]  # theirs first, the long chunk last


def test_no_room_is_kept_for_long_or_unfitting_prompts():
    s = Scheduler(PageAllocator(512), 4, 8, 64, True)
    s.add(seq("long", 400))
    advance(s.schedule())
    s.add(seq("long2", 100))  # more than half the budget: it waits its turn, in order
    s.add(seq("s", 10))  # behind it
    assert shape(s.schedule()) == [("long", 64)]
    tight = Scheduler(PageAllocator(110), 4, 8, 64, True)
    tight.add(seq("long", 400, max_tokens=8))  # 102 pages promised: 8 left
    advance(tight.schedule())
    tight.add(seq("s", 30, max_tokens=8))  # 10 pages: more than are left, so no room is kept for it
    assert shape(tight.schedule()) == [("long", 64)]


def test_the_budget_grows_with_the_prompts_waiting_per_decoding_sequence():
    """One decoding stream and four prompts waiting: four budgets a step (each prompt's wait
    weighs as much as the stream's stall); as more decode, the cap falls back to one budget."""
    s = Scheduler(PageAllocator(512), 4, 8, 512, True)
    a = seq("a", 8)
    s.add(a)
    advance(s.schedule())
    for i in range(4):
        s.add(seq(f"p{i}", 100))
    batch = s.schedule(prompt_budget=16)
    assert shape(batch) == [("a", 1), ("p0", 64)]  # 16 x 4 prompts per decoding sequence
    advance(batch)
    assert sum(n for rid, n in shape(s.schedule(prompt_budget=16)) if rid != "a") == 64


def test_room_for_short_prompts_never_makes_a_chunk_negative():
    """Decoding sequences may take more of a small step than the room kept for short prompts
    leaves: the long chunk then waits a step (0 tokens), never a negative count."""
    s = Scheduler(PageAllocator(1024), 4, 64, 16, True)
    for i in range(12):
        s.add(seq(f"d{i}", 1))
    s.add(seq("long", 100))
    first = s.schedule()
    assert shape(first)[-1] == ("long", 4)  # the twelve 1-token prompts, then 4 of the long one's
    advance(first)
    s.add(seq("s", 6))
    batch = s.schedule()  # twelve decode: 4 tokens left, 6 kept for s
    assert all(item.num_tokens > 0 for item in batch)
    assert sum(item.num_tokens for item in batch) <= 16


def test_a_prompts_one_token_chunk_is_not_decoding(tiny_llama_engine_parts):
    """The step report and the scheduler count decoding sequences by one rule
    (``Sequence.decoding``): a prompt whose last chunk is one token is a prompt, not a decoding
    sequence, so its step is not timed as a decode step; the next step, which computes its
    sampled token, is."""
    engine = tiny_llama_engine_parts(max_batch_tokens=16)
    engine.add_request(GenerateRequest("p", tuple(range(5, 22)), SamplingParams(temperature=0.0, max_tokens=3)))
    first, last, sampled = engine.step(), engine.step(), engine.step()  # 16 prompt tokens, 1, then 1 sampled
    assert (first.decoding, last.decoding, sampled.decoding) == (0, 0, 1)
