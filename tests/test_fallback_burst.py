"""A burst of fallbacks on one decode worker is answered, not failed as stalled.

A split pair behind the router (tiny model, real processes over NIXL, ``SPLITSERVE_KERNELS=1`` as
``test_recompute_faults.py`` sets it): 16 prompts of 100 to 160 tokens, held mid-transfer by the
prefill's ``stall_writes_after=1`` until every room waits for its KV on decode; then the prefill
is SIGKILLed. The router sends each request again to the decode worker alone (its prefill leg
broke before its answer), so 16 prompts queue on one decode that computes them in chunks of 16
tokens, one room after another, with a short ``--prefill-stall-s`` (2 s): the last rooms wait for
their turn far longer than that. A room waiting behind work the engine is doing is not stalled
(``docs/lifecycle.md``, decode's ``PREFILLING``): every request is answered. Outcomes are counted,
never timed. Before the bound started at the scheduler's admission most of them ended 504
``stalled: no chunk of its prompt computed here``.

Long (``make check-long``): three processes and a few thousand prompt tokens in 16-token chunks
took 140 s to 260 s on a loaded 2-core machine.
"""

from __future__ import annotations

import random
import signal
import threading
import time

import pytest
import requests

from cluster import Cluster, pages_back_to_total, post_generate

PAGE = 16
N_PROMPTS, NEW_TOKENS = 16, 4
SHARED = ["--page-size", str(PAGE), "--max-total-tokens", "8192", "--heartbeat-interval-s", "0.2",
          "--heartbeat-misses", "10", "--register-resend-s", "1", "--quarantine-resend-s", "0.5",
          "--transfer-s-per-gib", "0", "--kv-wait-s", "120", "--tombstone-s", "300"]
PREFILL = ["--inject-faults", "stall_writes_after=1", "--transfer-floor-s", "120", "--max-batch-tokens", "512"]
DECODE = ["--kv-failure-policy", "recompute", "--max-batch-tokens", "16", "--prefill-stall-s", "2",
          "--queue-s", "240", "--transfer-floor-s", "120"]


def prompts() -> list[list[int]]:
    rng = random.Random(35)
    return [[rng.randint(10, 2000) for _ in range(rng.randint(100, 160))] for _ in range(N_PROMPTS)]


def rooms_in(worker, state: str) -> int:
    return sum(r["state"] == state for r in requests.get(worker.url + "/debug/requests", timeout=10).json())


def wait_until(what: str, check, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g}s")
        time.sleep(0.05)


@pytest.fixture
def kernels(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_KERNELS", "1")


@pytest.mark.long
def test_a_burst_of_fallbacks_on_one_decode_is_answered_not_stalled(kernels):
    cluster = Cluster(1, 1, "nixl", worker_args=SHARED, prefill_args=[PREFILL], decode_args=[DECODE])
    with cluster:
        answers: list = [None] * N_PROMPTS

        def send(i: int, ids: list[int]) -> None:
            try:
                answers[i] = post_generate(cluster.url, ids, NEW_TOKENS, ignore_eos=True, timeout=300,
                                           temperature=0)
            except requests.RequestException as exc:
                answers[i] = exc

        threads = [threading.Thread(target=send, args=(i, ids), daemon=True) for i, ids in enumerate(prompts())]
        for t in threads:
            t.start()
        prefill, decode = cluster.prefill[0], cluster.decode[0]
        wait_until("every room waiting for its KV on decode", lambda: rooms_in(decode, "AWAITING_KV") == N_PROMPTS)
        prefill.send_signal(signal.SIGKILL)
        prefill.wait(10)
        for t in threads:
            t.join(300)
        outcomes: dict = {}
        for a in answers:
            key = a.status_code if isinstance(a, requests.Response) else type(a).__name__
            outcomes[key] = outcomes.get(key, 0) + 1
        failed = [a.text[:300] for a in answers if isinstance(a, requests.Response) and a.status_code != 200]
        assert outcomes == {200: N_PROMPTS}, f"outcomes {outcomes}; failures: {failed[:3]}"
        assert all(len(a.json()["output_ids"]) == NEW_TOKENS for a in answers)
        pages_back_to_total(decode, timeout=30)
