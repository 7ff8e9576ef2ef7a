"""The router's remaining deadline on a leg (``X-Splitserve-Deadline-S``, ``docs/router.md``):
parsed as untrusted input (a bounded, finite, positive number of seconds, else a 400 naming the
header), and what a worker does with it: refuse at once (503 ``overloaded``) a prompt its best
measured pace could not compute in time, admit everything while it has measured nothing.
"""

from __future__ import annotations

import pytest

from splitserve.engine.page_allocator import PageAllocator
from splitserve.engine.prompt_rate import FORGET_S, KEEP, WINDOW_S, WINDOW_TOKENS, PromptRate, TooLate, refuse_if_late
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.sequence import Sequence
from splitserve.engine.io import InvalidRequest, SamplingParams
from splitserve.errors import error_body
from splitserve.validation import DEADLINE, MAX_DEADLINE_S, check_deadline


@pytest.mark.parametrize("text,value", [("12.5", 12.5), ("0.001", 0.001), ("30", 30.0), ("1e3", 1000.0),
                                        (str(MAX_DEADLINE_S), MAX_DEADLINE_S), (None, None)])
def test_a_good_deadline_is_taken(text, value):
    assert check_deadline(text) == value


@pytest.mark.parametrize("text", ["", "0", "-1", "nan", "NaN", "inf", "-inf", "1e400", "1e7", "12s", " 5",
                                  "0x10", "1" * 33, "5,0", "\u0665", "1_0", "--1", "true"])
def test_a_bad_deadline_is_a_400_naming_the_header(text):
    with pytest.raises(InvalidRequest) as caught:
        check_deadline(text)
    assert caught.value.status == 400 and caught.value.param == DEADLINE
    body = error_body(str(caught.value), 400, caught.value.param)
    assert body["error"]["param"] == DEADLINE and body["error"]["type"] == "invalid_request_error"


NOW = 1000.0


def measured(pace: float) -> PromptRate:
    """A rate that measured ``pace`` prompt tokens per second over one whole window, at ``NOW``."""
    rate = PromptRate()
    tokens = max(WINDOW_TOKENS, int(pace * WINDOW_S) + 1)
    rate.note(tokens, tokens / pace, NOW)
    assert rate.best(NOW) == pytest.approx(pace)
    return rate


def test_a_fresh_worker_admits_whatever_the_deadline():
    fresh = PromptRate()
    assert fresh.seconds_for(10**9 + 10**6, NOW) is None  # no pace measured: nothing to judge by
    assert refuse_if_late(fresh, backlog=10**9, prompt_tokens=10**6, deadline_s=0.001, now=NOW) is None


def test_without_a_deadline_nothing_is_refused():
    rate = measured(100.0)
    assert rate.seconds_for(10**6 + 1000, NOW) > 1000  # far more than any deadline would give
    assert refuse_if_late(rate, backlog=10**6, prompt_tokens=1000, deadline_s=None, now=NOW) is None


def test_work_that_fits_the_deadline_at_the_measured_pace_is_admitted_and_more_is_refused_503():
    rate = measured(1000.0)  # tokens per second
    refuse_if_late(rate, backlog=8000, prompt_tokens=1000, deadline_s=10.0, now=NOW)  # 9 s of prompt
    with pytest.raises(TooLate) as caught:
        refuse_if_late(rate, backlog=10000, prompt_tokens=1000, deadline_s=10.0, now=NOW)  # 11 s
    assert caught.value.status == 503 and caught.value.code == "overloaded"


def test_the_estimate_takes_the_best_recent_pace_so_a_slow_moment_refuses_nothing_more():
    rate = measured(1000.0)
    rate.note(WINDOW_TOKENS, 100.0, NOW + 1)  # one very slow window (a loaded machine)
    assert rate.best(NOW + 1) == pytest.approx(1000.0)
    refuse_if_late(rate, backlog=8000, prompt_tokens=1000, deadline_s=10.0, now=NOW + 1)


def test_a_pace_measured_long_ago_is_forgotten_so_nothing_is_refused_on_it_for_good():
    rate = measured(10.0)  # a slow warm-up, say; then the work it refuses measures nothing new
    with pytest.raises(TooLate):
        refuse_if_late(rate, backlog=0, prompt_tokens=1000, deadline_s=10.0, now=NOW)
    refuse_if_late(rate, backlog=0, prompt_tokens=1000, deadline_s=10.0, now=NOW + FORGET_S + 1)


def test_steps_too_short_to_measure_are_summed_into_a_window_and_old_windows_are_dropped():
    rate = PromptRate()
    rate.note(1, WINDOW_S / 4, NOW)  # not a window yet: too few tokens
    assert rate.best(NOW) is None
    rate.note(0, 5.0, NOW)  # a step that computed no prompt is no pace
    assert rate.best(NOW) is None
    rate.note(WINDOW_TOKENS, WINDOW_S, NOW)
    assert rate.best(NOW) is not None
    for _ in range(KEEP):
        rate.note(WINDOW_TOKENS, WINDOW_TOKENS / 10.0, NOW)  # 10 tokens/s, KEEP times: the fast one is gone
    assert rate.best(NOW) == pytest.approx(10.0)


def test_the_scheduler_counts_its_uncomputed_prompt_tokens():
    sched = Scheduler(PageAllocator(64), page_size=16, max_running=4, max_batch_tokens=32, chunked_prefill=True)
    for rid, n in (("a", 100), ("b", 50)):
        sched.add(Sequence(rid=rid, token_ids=list(range(1, n + 1)), num_prompt_tokens=n,
                           sampling=SamplingParams(max_tokens=4), seed=1))
    assert sched.prompt_backlog == 150
    batch = sched.schedule()
    assert sum(s.num_tokens for s in batch) == 32
    for s in batch:
        s.seq.num_computed += s.num_tokens
    assert sched.prompt_backlog == 150 - 32, "what this step computes is not waited behind"
    [running] = sched.running
    sched.finish(running)  # an aborted prompt is no backlog, also on an engine that steps no more
    assert sched.prompt_backlog == 150 - 100
