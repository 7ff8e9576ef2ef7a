"""The scheduler without a model: budgets, chunking, admission order, preemption and page counts."""

from splitserve.engine.io import SamplingParams
from splitserve.engine.page_allocator import PageAllocator
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.sequence import Sequence, SeqStatus


def seq(rid, n):
    return Sequence(rid=rid, token_ids=list(range(n)), num_prompt_tokens=n, sampling=SamplingParams(), seed=0)


def advance(batch):
    """What the engine does after a forward: mark tokens computed, append a token where sampled."""
    for item in batch:
        sampled = item.samples
        item.seq.num_computed += item.num_tokens
        if sampled:
            item.seq.token_ids.append(0)


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


def test_out_of_pages_preempts_the_newest_and_frees_its_pages():
    s = make(pages=4, page=4, budget=64)
    a, b = seq("a", 8), seq("b", 7)
    s.add(a)
    s.add(b)
    advance(s.schedule())  # a: 8 tokens in 2 pages (+ sampled), b: 7 tokens in 2 pages (+ sampled)
    assert s.allocator.num_free == 0
    batch = s.schedule()  # a needs a 3rd page for token 9: b is preempted
    assert [i.seq.rid for i in batch] == ["a"]
    assert b.status is SeqStatus.WAITING and b.pages == [] and b.num_computed == 0
    assert list(s.waiting) == [b] and len(b) == 8  # its generated token is kept for recompute
    assert s.allocator.num_free == 1
    s.finish(a)
    s.finish(b)
    assert s.allocator.num_free == 4
