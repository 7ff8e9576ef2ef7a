"""The scheduler without a model: budgets, chunking, admission order, preemption and page counts,
and the admission policy: a request is promised its whole need (every choice, the prompt's full
pages shared) when it fits in what is not promised, in arrival order, passed by later requests
at most ``max_passes`` times; a preempted sequence waits in its request's place, still promised."""

from helpers.scheduler_steps import advance, seq
from splitserve.engine.page_allocator import PageAllocator
from splitserve.engine.scheduler import Scheduler, request_pages
from splitserve.engine.sequence import SeqStatus


def make(pages=64, page=4, running=8, budget=16, chunked=True):
    return Scheduler(PageAllocator(pages), page, running, budget, chunked)


def test_long_prompt_is_chunked_under_the_budget():
    s = make(budget=16)
    a = seq("a", 40)
    s.add(a)
    sizes = []
    while a.num_computed < 40:
        batch = s.schedule()
        sizes.append([(i.seq.rid, i.num_tokens, i.samples) for i in batch])
        advance(batch)
    assert sizes == [[("a", 16, False)], [("a", 16, False)], [("a", 8, True)]]
    assert len(a.pages) == 10  # pages hold computed tokens: 40 -> 10 of 4; the sampled one gets its page next step


def test_unchunked_prompt_runs_in_one_step_even_over_budget():
    s = make(budget=16, chunked=False)
    a = seq("a", 40)
    s.add(a)
    batch = s.schedule()
    assert [(i.num_tokens, i.samples) for i in batch] == [(40, True)]


def test_requests_join_the_running_batch_at_any_step():
    s = make(budget=32)
    a = seq("a", 8)
    s.add(a)
    advance(s.schedule())
    b = seq("b", 6)
    s.add(b)
    batch = s.schedule()
    assert [(i.seq.rid, i.num_tokens) for i in batch] == [("a", 1), ("b", 6)]


def test_running_cap_holds_back_admission():
    s = make(running=2)
    seqs = [seq(str(i), 4) for i in range(3)]
    for q in seqs:
        s.add(q)
    batch = s.schedule()
    assert [i.seq.rid for i in batch] == ["0", "1"]
    assert seqs[2].status is SeqStatus.WAITING


def test_out_of_pages_preempts_the_newest_and_it_waits_in_its_place_still_promised():
    """Pages that leave the scheduler's account (a decode room's, taken by its role) can still run
    short: the latest request's sequence is preempted, its pages freed, and it waits in its place,
    promised: a request that came after it does not start before it."""
    s = make(pages=8, page=4, budget=64)
    a, b = seq("a", 8, max_tokens=8), seq("b", 7, max_tokens=8)  # 4 pages each
    s.add(a)
    s.add(b)
    advance(s.schedule())  # a: 8 tokens in 2 pages (+ sampled), b: 7 tokens in 2 pages (+ sampled)
    taken = s.allocator.allocate(s.allocator.num_free)  # a room takes every free page
    c = seq("c", 2, max_tokens=1)
    s.add(c)
    batch = s.schedule()  # a needs a 3rd page for token 9: b is preempted
    assert [i.seq.rid for i in batch] == ["a"]
    assert b.status is SeqStatus.WAITING and b.pages == [] and b.num_computed == 0 and b.promised
    assert list(s.waiting) == [b, c] and len(b) == 8  # its generated token is kept for recompute
    assert s.allocator.num_free == 1
    s.allocator.free(taken)
    advance(s.schedule())
    assert b.status is SeqStatus.RUNNING and (c.status is SeqStatus.RUNNING) == (s.running[-1] is c)
    assert s.running.index(b) < (s.running.index(c) if c in s.running else len(s.running))
    for q in (a, b, c):
        s.finish(q)
    assert s.allocator.num_free == 8 and s.num_preemptions == 1


def test_the_need_counts_every_choice_and_the_prompts_full_pages_once():
    # 9 prompt tokens + 7 = 16 tokens: 4 pages of 4 a choice; its 2 full prompt pages are shared
    assert request_pages(9, 7, 1, 4, shared_prefix=True) == 4
    assert request_pages(9, 7, 16, 4, shared_prefix=True) == 2 + 16 * 2
    assert request_pages(9, 7, 16, 4, shared_prefix=False) == 16 * 4
    assert request_pages(8, 8, 3, 4, shared_prefix=True) == 1 + 3 * 3  # the last prompt token's page is each one's


def run(s, steps):
    """``steps`` steps; the rids each admitted, in order."""
    started = []
    for _ in range(steps):
        batch = s.schedule()
        started += [q.rid for q in s.admitted]
        advance(batch)
        for item in batch:
            if item.seq.num_output_tokens >= item.seq.sampling.max_tokens:
                s.finish(item.seq)
    return started


def test_admitted_requests_are_promised_their_whole_need_and_never_preempt_one_another():
    s = make(pages=16, page=4, budget=64)
    a, b, c = (seq(r, 8, max_tokens=24) for r in "abc")  # 8 pages each, 2 of them at admission
    for q in (a, b, c):
        s.add(q)
    assert run(s, 1) == ["a", "b"]  # c would fit the free pages now, not the promised ones
    assert s.unpromised_pages() == 0 and c.status is SeqStatus.WAITING and not c.promised
    assert run(s, 23) == []  # a and b end with their 24th token...
    assert run(s, 1) == ["c"] and s.num_preemptions == 0  # ...and only then does c start
    run(s, 24)
    assert not s.has_work() and s.allocator.num_free == 16


def test_a_request_that_does_not_fit_is_passed_at_most_max_passes_times_then_holds_the_head():
    s = Scheduler(PageAllocator(16), 4, 64, 64, True, max_passes=2)
    big = seq("big", 8, max_tokens=32)  # 10 pages
    s.add(big)
    assert run(s, 1) == ["big"]
    wide = seq("wide", 8, max_tokens=32)  # 10 pages: 6 are left
    shorts = [seq(f"s{i}", 4, max_tokens=4) for i in range(5)]  # 2 pages each
    for q in [wide] + shorts:
        s.add(q)
    assert run(s, 1) == ["s0", "s1"]  # two pass it; then nothing more is promised before it
    assert wide.passed == 2 and not any(q.promised for q in shorts[2:])
    started = run(s, 40)
    assert started.index("wide") < started.index("s2")  # its turn came when big ended
    assert sorted(started) == sorted(["wide", "s2", "s3", "s4"])
    run(s, 40)
    assert not s.has_work() and s.allocator.num_free == 16 and s.num_preemptions == 0


def test_a_need_larger_than_the_pool_is_admitted_alone_rather_than_never():
    """A request over the pool is refused at submission (``check_fits``); one that got past it
    anyway (a test's sequence) runs alone instead of pinning the queue."""
    s = make(pages=4, page=4, budget=64)
    big, after = seq("big", 4, max_tokens=40), seq("after", 2, max_tokens=1)
    s.add(big)
    s.add(after)
    assert run(s, 1) == ["big"] and not after.promised
