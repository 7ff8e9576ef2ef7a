"""A colocated worker ends a request at the deadline its sender gave it (``X-Splitserve-Deadline-S``)
as a decode worker does (a split leg, or a request it serves alone): 504 ``request_timeout`` for a whole answer, the error event for a stream,
counted in ``splitserve_requests_total``, every page back, and the worker goes on serving. The
header sent twice, or ``X-Request-Id`` sent twice, is a 400 naming it, before anything runs.
"""

from __future__ import annotations

import pytest
import requests

from cluster import generate, metric_sum, metrics, pages_back_to_total
from conftest import ServerProcess
from helpers.raw_headers import post_json
from helpers.sse import sse_events
from splitserve.validation import DEADLINE, REQUEST_ID

LONG = 7000  # far more tokens than the tiny model makes on a CPU before the deadline
DEADLINE_S = "1.5"
BODY = {"input_ids": [7] * 8, "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
SHORT = {"input_ids": [7] * 8, "sampling_params": {"max_new_tokens": 2}}
ERROR = {"message": f"request_timeout: older than {DEADLINE_S}s", "type": "timeout", "param": None,
         "code": "request_timeout"}


@pytest.fixture(scope="module")
def worker():
    with ServerProcess() as proc:  # colocated: no --role
        yield proc


def timeouts(worker) -> float:
    return metric_sum(metrics(worker), "splitserve_requests_total", outcome="failed", reason="request_timeout")


def still_serves(worker) -> None:
    pages_back_to_total(worker)
    assert len(generate(worker.url, [7] * 8, 4, ignore_eos=True)) == 4


def assert_ends_whole_at_the_deadline(worker) -> None:
    """A whole answer: 504 ``request_timeout``, counted once, every page back, the worker serving."""
    before = timeouts(worker)
    r = requests.post(worker.url + "/generate", json=BODY, headers={DEADLINE: DEADLINE_S}, timeout=120)
    assert r.status_code == 504, r.text[:500]
    assert r.json() == {"error": ERROR}
    assert timeouts(worker) == before + 1
    still_serves(worker)


def assert_ends_stream_at_the_deadline(worker) -> None:
    """A stream: the same error as its last event before ``[DONE]``, fewer tokens than asked."""
    before = timeouts(worker)
    r = requests.post(worker.url + "/generate", json={**BODY, "stream": True}, headers={DEADLINE: DEADLINE_S},
                      timeout=120)
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-2:] == [{"error": ERROR}, "[DONE]"], r.text[-1000:]
    answers = [e for e in events[:-2] if "output_ids" in e]
    assert answers and len(answers[-1]["output_ids"]) < LONG  # ended before its tokens were all made
    assert timeouts(worker) == before + 1
    still_serves(worker)


def test_a_whole_answer_ends_504_request_timeout_at_the_deadline(worker):
    assert_ends_whole_at_the_deadline(worker)


def test_a_stream_ends_with_the_request_timeout_error_event_at_the_deadline(worker):
    assert_ends_stream_at_the_deadline(worker)


@pytest.mark.long
def test_a_decode_worker_serving_a_request_alone_ends_it_the_same_way():
    """The reference: a decode worker given no bootstrap fields (its lifecycle table's deadline)."""
    with ServerProcess("--role", "decode") as decode:
        assert_ends_whole_at_the_deadline(decode)
        assert_ends_stream_at_the_deadline(decode)


@pytest.mark.parametrize("name, values", [(DEADLINE, ("30", "20")), (DEADLINE, ("30", "30")),
                                          (REQUEST_ID, ("a", "b"))])
def test_a_single_valued_header_sent_twice_is_a_400_naming_it(worker, name, values):
    status, body = post_json(worker.url, "/generate", SHORT, [(name, v) for v in values])
    assert status == 400, body
    assert body["error"]["param"] == name and "once" in body["error"]["message"]
    assert post_json(worker.url, "/generate", SHORT, [(name, values[0])])[0] == 200  # once, it is taken
