"""A real prefill worker at the edges of its lifecycle table: what it owes a decode worker after its
own part is over.

Prefill ``P`` drops half of its KV notifications (``--inject-faults notify_drop=0.5``): the
``KVDone`` that tells decode the KV has landed is lost on its way, after ``P`` counted the room a
success and freed its pages. Decode ``D`` re-sends its registration every ``--register-resend-s``
while it waits; that re-sent registration must get the ``KVDone`` again. That it did is read
off decode's counters, not the clock: had the re-sent registration gone unanswered, the room would
have waited out ``--kv-wait-s`` and recomputed its prompt on decode (a KV fallback), which decode
counts; a busy machine only makes the requests slower.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster import Cluster, metric, metric_sum, metrics, post_generate
from helpers.fault_deadlines import DEADLINES
from helpers.prompts import GREEDY, prompt
from helpers.worker_checks import assert_clean

RESEND_S = 0.5


def test_a_lost_kv_done_is_sent_again_when_decode_asks_again():
    args = DEADLINES + ["--register-resend-s", str(RESEND_S)]
    with Cluster(1, 1, "nixl", worker_args=args, prefill_args=["--inject-faults", "notify_drop=0.5,seed=3"]) as c:
        def one(i: int):
            t0 = time.monotonic()
            resp = post_generate(c.url, prompt(30 + i, 200 + i), 4, timeout=60, **GREEDY)
            return resp, time.monotonic() - t0

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(one, range(12)))
        for resp, _ in results:
            assert resp.status_code == 200, (resp.status_code, resp.text, c.output())
        decode = metrics(c.decode[0])
        assert metric_sum(decode, "splitserve_kv_fallback_total") == 0, "a lost KVDone was recomputed, not resent"
        assert metric(decode, "splitserve_decode_prompts_computed_total") == 0
        dropped = c.prefill[0].stderr().count("injected fault: notification to")
        assert dropped >= 3, f"only {dropped} notifications were dropped"
        for w in c.workers:
            assert_clean(w)
        served = metric(metrics(c.prefill[0]), "splitserve_requests_total", role="prefill", outcome="finished",
                        reason="transferred")
        assert served == 12
    print(f"\n{dropped} KVDone notifications dropped; every request served, slowest {max(s for _, s in results):.1f}s")
