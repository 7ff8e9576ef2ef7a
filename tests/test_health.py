"""Health that sees the engine loop: a worker whose engine loop is wedged or dead is out of the
router's rotation within a stated time, its clients are answered meanwhile, and ``/health``,
``/metrics`` and ``/debug/requests`` never wait on the loop.

Of prefill ``P1`` and decodes ``D1`` and ``D2`` behind a router, ``D2`` wedges its engine loop as
soon as it holds a request (``--inject-faults wedge_loop``). With ``--loop-stall-s 2`` and the router checking
health every 0.5 s (out after 2 failures):

- every request sent to ``D2`` ends (an error naming the wedged loop) within loop bound + slack;
- ``D2``'s ``/health`` answers 503, ``/metrics`` shows ``splitserve_engine_loop_age_seconds``
  past the bound, and ``/debug/requests`` lists the stuck request — each answered though the loop
  never returns — and ``splitserve_requests_late`` counts it once it is past half its deadline (read
  from the clock);
- the router takes ``D2`` out of rotation within loop bound + health bound (+ slack): from then on
  every request succeeds on ``D1``.

The same cluster holds a second prefill ``P2`` outside the router, whose transfer thread hangs
(``--inject-faults hang_transfer``), driven by hand with ``D1``: one start of the workers for both
scenarios. Each scenario kills its faulty worker at its end.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from cluster import Cluster, RouterProcess, metric, metrics, pages_back_to_total, post_generate
from conftest import ServerProcess, free_port
from helpers.fault_deadlines import DEADLINES, PEER_SILENCE_S, SHOW_FAILURES
from helpers.prompts import GREEDY, new_room, prompt
from helpers.split_pair import direct_pair, kill9
from helpers.waiting import wait_for

LOOP_STALL_S = 2.0
HEALTH_S, HEALTH_FAILURES = 0.5, 2
SLACK_S = 10.0  # what a busy machine may add to a stated bound; each bound still stays below the clients' timeouts


@pytest.fixture(scope="module")
def wedging():
    """Prefill ``P1`` and decodes ``D1`` and ``D2`` (its loop wedges) behind a router; prefill
    ``P2`` (its transfer thread hangs) outside it. The cluster and the router."""
    c = Cluster(2, 2, "nixl", worker_args=DEADLINES + ["--loop-stall-s", str(LOOP_STALL_S)],
                prefill_args=[[], ["--inject-faults", "hang_transfer"]],
                decode_args=[[], ["--inject-faults", "wedge_loop"]], router=False)
    with c:
        P1 = c.prefill[0]
        router = RouterProcess([(P1.url, P1.bootstrap_port)], [d.url for d in c.decode],
                               "--health-interval-s", str(HEALTH_S), "--health-failures", str(HEALTH_FAILURES),
                               "--policy", "round_robin", *SHOW_FAILURES)
        try:
            yield c, router.start()
        finally:
            router.stop()


def test_a_wedged_decode_is_out_of_rotation_and_its_clients_are_answered(wedging):
    c, router = wedging
    D2 = c.decode[1]
    started = time.monotonic()

    def one(i: int):
        t0 = time.monotonic()
        try:
            resp = post_generate(router.url, prompt(20 + i, 300 + i), 4, timeout=60, **GREEDY)
        except requests.RequestException as exc:
            return i, exc, t0, time.monotonic()
        return i, resp, t0, time.monotonic()

    with ThreadPoolExecutor(2) as pool:
        first = list(pool.map(one, range(4)))  # round robin: some land on D2, which wedges
    wedged_at = started
    for i, resp, t0, t1 in first:
        assert isinstance(resp, requests.Response), resp
        if resp.status_code != 200:  # D2's: answered by the watchdog, not by the wedged loop
            assert t1 - t0 <= LOOP_STALL_S + SLACK_S, f"request {i} took {t1 - t0:.1f}s"
    failed = [r for _, r, _, _ in first if r.status_code != 200]
    assert failed, "no request reached the wedged decode"
    assert all(r.status_code == 503 and "engine loop" in r.text for r in failed), [r.text for r in failed]

    # the loop never comes back: an endpoint that waited on it would never answer (ReadTimeout)
    health = requests.get(D2.url + "/health", timeout=10)
    rows = requests.get(D2.url + "/debug/requests", timeout=10)
    age = metric(metrics(D2), "splitserve_engine_loop_age_seconds")
    assert health.status_code == 503 and "engine loop" in health.text, health.text
    assert rows.status_code == 200 and rows.json(), rows.text
    assert age > LOOP_STALL_S, age
    # the stuck room's deadline cannot fire (the loop is wedged), but it is counted late from the
    # clock at scrape time, next to the loop's age: a wedged loop shows, it does not hide
    stuck = rows.json()[0]
    late_by = stuck["state_age_s"] + stuck["deadline_s"]  # all its state allows: late after half
    late = wait_for("the stuck request counted late on the wedged D2", lambda: metric(
        metrics(D2), "splitserve_requests_late", role="decode", state=stuck["state"]), late_by + SLACK_S)
    assert late >= 1 and metric(metrics(D2), "splitserve_engine_loop_age_seconds") > age

    out_by = LOOP_STALL_S + HEALTH_S * (HEALTH_FAILURES + 1) + SLACK_S
    wait_for("the router takes D2 out of rotation",
             lambda: not [w for w in requests.get(router.url + "/health", timeout=2).json()["decode"]
                          if w["url"] == D2.url and w["healthy"]], out_by)
    assert time.monotonic() - wedged_at <= out_by + LOOP_STALL_S
    for i in range(6):
        resp = post_generate(router.url, prompt(10 + i, 400 + i), 4, timeout=30, **GREEDY)
        assert resp.status_code == 200, resp.text
    kill9(D2)  # its loop never comes back: a graceful stop would wait out the drain


def test_a_hung_transfer_thread_is_seen_and_its_peers_are_let_go(wedging):
    """Prefill ``P2``'s transfer thread hangs once a write is in flight (``--inject-faults
    hang_transfer``), as a backend call that never returns would. It cannot be restarted, but it is
    seen: within the loop bound ``P2``'s ``/health`` answers 503 naming the thread, the room fails on
    both sides (``P2`` declares decode ``D1`` lost; ``D1`` fences ``P2``'s session and frees its
    pages)."""

    c, _ = wedging
    P, D = c.prefill[1], c.decode[0]
    started = time.monotonic()
    pleg, dleg = direct_pair(P, D, prompt(60, 7), 4, new_room(), 60)
    bound = LOOP_STALL_S + PEER_SILENCE_S + SLACK_S
    for who, leg in (("prefill", pleg), ("decode", dleg)):
        resp, ended = leg.outcome(60)
        assert getattr(resp, "status_code", None) == 502, (who, resp, getattr(resp, "text", ""))
        assert ended - started <= bound + 2, f"{who} answered {ended - started:.1f}s after the request"
    health = requests.get(P.url + "/health", timeout=2)
    assert health.status_code == 503 and "transfer thread" in health.text, health.text
    pages_back_to_total(D, 10)
    kill9(P)




def test_a_blocked_zmq_io_thread_is_seen_by_health():
    """The ZMQ I/O thread moves every control socket's bytes; blocked (libzmq #3575), it freezes a
    decode's whole control plane, which ``/health`` must show. Decode ``D`` blocks it as soon as a
    room arrives (``--inject-faults block_zmq_io``: a monitor whose reader is closed, then an
    event). Within the loop bound ``/health`` answers 503 naming it (a loopback probe through the
    context stops coming back), the probe's age shows in ``/metrics``, and the room still ends by
    its own deadline."""
    D = ServerProcess("--role", "decode", "--transfer-backend", "tcp", "--loop-stall-s", str(LOOP_STALL_S),
                      "--prealloc-s", "3", "--inject-faults", "block_zmq_io").start()
    try:
        assert requests.get(D.url + "/health", timeout=5).status_code == 200
        assert metric(metrics(D), "splitserve_zmq_io_age_seconds", role="decode") < LOOP_STALL_S
        extra = {"bootstrap_host": "127.0.0.1", "bootstrap_port": free_port(), "bootstrap_room": 7}
        with ThreadPoolExecutor(1) as pool:
            leg = pool.submit(post_generate, D.url, prompt(20, 1), 2, timeout=30, extra=extra, **GREEDY)
            health = wait_for("decode's /health fails naming the ZMQ I/O thread",
                              lambda: (r := requests.get(D.url + "/health", timeout=5)).status_code == 503 and r.text,
                              LOOP_STALL_S + SLACK_S, interval=0.2)
            assert "ZMQ I/O thread" in health, health
            assert metric(metrics(D), "splitserve_zmq_io_age_seconds", role="decode") > LOOP_STALL_S
            resp = leg.result(30)
            assert resp.status_code >= 500, resp.text
    finally:
        kill9(D)  # a blocked I/O thread never lets the process's context end


class _FakeClock:
    """The engine loop's clock, moved by the test alone (a layer "takes" what the test says)."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_slow_step_that_moves_is_not_a_wedge_and_a_stuck_layer_is(monkeypatch):
    """A long step that moves is no wedge (a 2,048-token step on a loaded machine can outlast
    ``--loop-stall-s``): the loop's age is the age of its last progress (an iteration begun or a
    decoder layer finished), not of its last iteration. An in-process colocated engine loop over the
    tiny model (4 decoder layers) on a fake clock, under a 1.5 s bound: a forward hook moves the
    clock during each layer and asks ``loop_stalled()``. A step of 4 layers of 1 s each is never
    stalled; a layer of 2 s is."""
    import asyncio

    from conftest import CACHE_DIR
    from splitserve.config import EngineConfig
    from splitserve.engine.async_engine import AsyncEngine
    from splitserve.engine.engine import ModelParts
    from splitserve.engine.io import GenerateRequest, SamplingParams
    from splitserve.models.loader import load_model
    from splitserve.sim.model import ByteTokenizer
    from splitserve.testing.tiny import tiny_model_path

    monkeypatch.setenv("SPLITSERVE_CACHE", str(CACHE_DIR))
    model, spec = load_model(tiny_model_path("llama"))
    clock, layer_s, seen = _FakeClock(), [], []
    ae = AsyncEngine(EngineConfig(model="tiny", max_total_tokens=256, max_running_requests=2), loop_stall_s=1.5,
                     parts=ModelParts(model, spec, ByteTokenizer()))  # ids in, ids out: no tokenizer to load
    ae.clock = clock  # the loop's one clock (the simulator swaps it the same way)
    for i, layer in enumerate(model.model.layers):
        def slow(module, args, out, i=i):
            clock.t += layer_s[i]
            seen.append(ae.loop_stalled())
        layer.register_forward_hook(slow)

    async def one(times: list[float]) -> list[bool]:
        layer_s[:], seen[:] = times, []
        req = GenerateRequest(rid=f"step-{times}", prompt_ids=tuple(range(5, 40)),
                              sampling=SamplingParams(temperature=0.0, max_tokens=1))
        outs = [out async for out in ae.submit(req)]
        assert outs[-1].finished and outs[-1].error is None and sum(len(o.token_ids) for o in outs) == 1, outs
        return list(seen)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, ae.start, loop)
        assert len(model.model.layers) == 4
        moving = await one([1.0, 1.0, 1.0, 1.0])
        assert moving == [False] * 4, moving
        stuck = await one([0.5, 2.0, 0.5, 0.5])
        assert stuck == [False, True, False, False], stuck

    try:
        asyncio.run(main())
    finally:
        ae.shutdown()
