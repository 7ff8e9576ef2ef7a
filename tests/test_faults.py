"""Real processes under faults: what a client and an operator see when workers die, the network
breaks and control messages get lost, with the real prefill, decode and router processes.

Every scenario ends the same way: every client was answered (a response or an error, never a
hang) within the bound its deadlines give, and on every live worker the live lifecycle gauges are
0, ``/debug/requests`` is empty and all KV pages are free (none quarantined).

- (a) ``test_client_disconnects_under_load``: 200 concurrent streams through the router, a third
  of the clients hang up at random moments (before the first byte, mid-stream).
- (b) ``test_decode_killed_mid_transfer_then_restarted``: ``kill -9`` of the decode worker while a
  (stalled) write is in flight, then a new decode worker on the same port.
- (c) ``test_prefill_killed_mid_transfer``: ``kill -9`` of the prefill worker mid-transfer.
- (d) ``test_control_messages_dropped_delayed_duplicated``: control-plane faults on both sides.
- ``test_wedged_prefill_engine_loop_is_declared_lost``: a prefill whose engine loop hangs while its
  control thread lives on stops heartbeating, so decode declares it lost and frees what it held.
- (e) ``test_link_cut_mid_transfer``: prefill and decode in network namespaces of their own, the
  veth link between them cut mid-transfer (``tests/netns.py``; skipped unless root with
  ``ip netns``); ``test_same_pair_serves_again_after_the_partition_heals``: once the link is
  back, the same pair serves the next request (a new session; the lost one stays lost);
  ``test_no_late_write_lands_after_the_partition_heals`` (``long``): a real transfer cut mid-way by
  the partition must not land in the decode pool once the link is back, in pages another request
  holds (decode fences the lost prefill by closing its receiving link before it frees a page).

"Mid-transfer" is made true, not hoped for: the prefill worker runs with
``--inject-faults stall_writes`` (every KV write stays pending until cancelled or reset), and the
test polls ``/debug/requests`` until prefill shows the room in ``TRANSFERRING`` and decode in
``AWAITING_KV`` before it strikes.

Deadlines are small (heartbeats every 0.2 s, a peer silent for 1 s is lost; a transfer may take
6 s) so that each scenario runs in seconds; :data:`SLACK_S` on top of a bound absorbs two busy
shared cores. Where a failure has several possible reasons (a heartbeat loss racing the router's
abort) the test accepts each and says which it saw.
"""

from __future__ import annotations

import asyncio
import datetime
import random
import re
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import pytest
import requests

from cluster import Cluster, RouterProcess, metric, metrics, post_generate, start_routers, stop_routers
from conftest import ServerProcess, free_port
from helpers.calls import Call
from helpers.fault_deadlines import (BOOTSTRAP_S, DEADLINES, HEARTBEAT_S, KV_WAIT_S, LOOP_STALL_S, PEER_SILENCE_S,
                                     PREALLOC_S, SHOW_FAILURES, SLACK_S, STALL)
from helpers.prompts import GREEDY, new_room, prompt
from helpers.split_pair import direct_pair, kill9
from helpers.sse import sse_events
from helpers.waiting import wait_for
from helpers.worker_checks import assert_clean, debug_rows


# "prefill request <rid> room=<room> ended FAILED(peer_lost): <detail> last_state=TRANSFERRING age=1.2s"
ENDING = re.compile(r"\b(prefill|decode) request (\S+) room=(\d+) ended (\w+)\((\w+)\)(?::.*?)? "
                    r"last_state=(\w+) age=([\d.]+)s")


# -- helpers -----------------------------------------------------------------------------------------


@dataclass
class Ending:
    role: str
    rid: str
    room: int
    outcome: str
    reason: str
    last_state: str
    age_s: float


def endings(proc) -> list[Ending]:
    """The one-line-per-request endings in a worker's log."""
    text = proc.stderr() + proc.stdout()
    return [Ending(m[1], m[2], int(m[3]), m[4], m[5], m[6], float(m[7])) for m in ENDING.finditer(text)]


def ending_of(proc, room: int) -> Optional[Ending]:
    found = [e for e in endings(proc) if e.room == room]
    assert len(found) <= 1, f"room {room} ended {len(found)} times: {found}"
    return found[0] if found else None


def wait_mid_transfer(prefill, decode, rooms: Optional[set] = None, n: int = 1, timeout: float = 30.0,
                      on_fail=None) -> set[int]:
    """Poll both workers' ``/debug/requests`` until ``n`` rooms (of ``rooms``, if given) are
    ``TRANSFERRING`` on ``prefill`` and ``AWAITING_KV`` on ``decode``; those rooms."""
    def check():
        p = {r["room"] for r in debug_rows(prefill) if r["state"] == "TRANSFERRING"}
        d = {r["room"] for r in debug_rows(decode) if r["state"] == "AWAITING_KV"}
        both = p & d if rooms is None else p & d & rooms
        return both if len(both) >= n else None

    return wait_for(f"{n} room(s) mid-transfer", check, timeout, on_fail=on_fail)


def counted(samples: dict, role: str, outcome: str, reason: str) -> float:
    """``splitserve_requests_total`` for one lifecycle outcome and reason."""
    return metric(samples, "splitserve_requests_total", role=role, outcome=outcome, reason=reason)


def error_message(resp: requests.Response) -> str:
    try:
        return resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return resp.text[:500]


def stream_error(resp: requests.Response) -> str:
    """The message of the error event a failed stream carries before its ``[DONE]``."""
    events = sse_events(resp.text)
    assert events and events[-1] == "[DONE]", f"the stream did not end with [DONE]: {resp.text[-500:]}"
    errors = [e["error"]["message"] for e in events[:-1] if "error" in e]
    assert errors, f"a failed stream carried no error event: {resp.text[-500:]}"
    return errors[-1]


def routed_mid_transfer(router_url: str, prefill, decode, ids: list[int], stream: bool, timeout: float,
                        on_fail=None) -> tuple[Call, int]:
    """Send a request through the router and wait until it is mid-transfer; the call and its room
    (the one room mid-transfer that was not before)."""
    before = {r["room"] for r in debug_rows(prefill)}
    call = Call(post_generate, router_url, ids, 8, stream=stream, timeout=timeout, **GREEDY)

    def new_room_mid():
        p = {r["room"] for r in debug_rows(prefill) if r["state"] == "TRANSFERRING"} - before
        d = {r["room"] for r in debug_rows(decode) if r["state"] == "AWAITING_KV"}
        return p & d

    (room,) = wait_for("the routed request mid-transfer", new_room_mid, 30, on_fail=on_fail)
    return call, room


def restart_on_same_port(cluster: Cluster, old: ServerProcess) -> ServerProcess:
    """A new process with ``old``'s options on ``old``'s port (a new incarnation), in ``old``'s
    place in ``cluster`` (so ``cluster.stop()`` stops it)."""
    new = ServerProcess(*old.args, startup_timeout=old.startup_timeout)
    new.role, new.bootstrap_port = old.role, old.bootstrap_port
    procs = cluster.decode if old in cluster.decode else cluster.prefill
    procs[procs.index(old)] = new
    new._spawn(old.port)
    new.wait_ready()
    return new


# -- (c) kill -9 of the prefill worker mid-transfer ----------------------------------------------------


@pytest.fixture(scope="module")
def lost_prefills():
    """Decode ``D`` and the two prefills it loses, one start of ``D`` for both tests: ``Ps``
    (stalled writes) behind a router with ``D``, for (c), and ``Pw`` (its engine loop wedges),
    driven by hand, for the wedged loop. Each test kills its own prefill."""
    c = Cluster(2, 1, "nixl", worker_args=DEADLINES, prefill_args=[STALL, ["--inject-faults", "wedge_loop"]],
                router=False)
    with c:
        Ps = c.prefill[0]
        c.router = RouterProcess([(Ps.url, Ps.bootstrap_port)], [c.decode[0].url], *SHOW_FAILURES).start()
        yield c  # c.stop() stops the router too


def released_steps(proc, room: int) -> Optional[dict]:
    """When ``room``'s pages were quarantined and then released on ``proc`` (wall clock, from its
    timeline), once both happened; None before."""
    resp = requests.get(f"{proc.url}/debug/rooms/{room}", timeout=10)
    steps = {s["state"]: s["time"] for s in resp.json()["steps"]} if resp.status_code == 200 else {}
    return steps if {"quarantined", "released"} <= steps.keys() else None


def test_prefill_killed_mid_transfer(lost_prefills):
    """Prefill ``P`` (stalled writes) and decode ``D`` behind a router. Three rooms are driven to
    mid-transfer: ``R`` (plain) and ``S`` (streamed) through the router, ``X`` by hand (both legs,
    like the router). Then ``kill -9 P``.

    - ``R``'s client gets a 502 at once (the prefill leg broke; the router aborts the decode leg).
      ``D`` ends ``R`` as aborted but keeps its pages quarantined: a write of the dead prefill
      could still land, until ``P`` is declared lost (silent ``PEER_SILENCE_S``) and its transfer
      connection torn down.
    - ``S``'s stream was committed when ``P`` accepted it; ``D`` fails the room with ``peer_lost``
      within the heartbeat bound and the stream ends with that error and ``[DONE]``.
    - ``X``'s decode leg, which nobody aborts, ends ``FAILED(peer_lost)`` within the heartbeat
      bound, and its client gets a 502 naming ``peer_lost``.
    - Afterwards ``D``: every page free, none quarantined, gauges 0, no live room.
    """
    started = time.monotonic()
    c = lost_prefills
    P, D = c.prefill[0], c.decode[0]
    before, log_from = metrics(D), len(D.stderr())  # D lives on for the wedged-loop test
    timeout = KV_WAIT_S + PREALLOC_S + 30
    R, r_room = routed_mid_transfer(c.url, P, D, prompt(100, 1), False, timeout, c.output)
    S, s_room = routed_mid_transfer(c.url, P, D, prompt(80, 12), True, timeout, c.output)
    x_room = new_room()
    Xp, Xd = direct_pair(P, D, prompt(60, 2), 8, x_room, timeout)
    wait_mid_transfer(P, D, {x_room}, on_fail=c.output)

    killed = kill9(P)

    resp, ended = R.outcome(timeout)
    assert isinstance(resp, requests.Response), f"the router's client got {resp!r}"
    assert resp.status_code == 502, resp.text
    assert ended - killed <= SLACK_S, f"the router's client waited {ended - killed:.1f}s after the kill"

    # streamed: the router committed to the stream once prefill accepted; the decode worker,
    # which nobody aborts, fails the room when P is declared lost, and says so in the stream
    sresp, sended = S.outcome(timeout)
    assert isinstance(sresp, requests.Response) and sresp.status_code == 200, sresp
    assert "peer_lost" in stream_error(sresp), sresp.text
    assert sended - killed <= PEER_SILENCE_S + SLACK_S, \
        f"the streamed client waited {sended - killed:.1f}s after the kill (bound {PEER_SILENCE_S}s)"

    dresp, dended = Xd.outcome(timeout)
    assert isinstance(dresp, requests.Response) and dresp.status_code == 502, dresp
    assert "peer_lost" in error_message(dresp), dresp.text
    assert dended - killed <= PEER_SILENCE_S + SLACK_S, \
        f"decode failed the room {dended - killed:.1f}s after the kill (bound {PEER_SILENCE_S}s)"
    presp, _ = Xp.outcome(timeout)
    assert isinstance(presp, requests.ConnectionError), f"the dead prefill answered {presp!r}"

    samples = assert_clean(D)
    assert counted(samples, "decode", "failed", "peer_lost") > counted(before, "decode", "failed", "peer_lost"), \
        "peer_lost not in splitserve_requests_total"
    x_end, r_end, s_end = ending_of(D, x_room), ending_of(D, r_room), ending_of(D, s_room)
    for end in (x_end, s_end):
        assert (end.outcome, end.reason, end.last_state) == ("FAILED", "peer_lost", "AWAITING_KV"), end
    assert r_end.last_state == "AWAITING_KV" and (r_end.outcome, r_end.reason) in (
        ("ABORTED", "client_abort"), ("FAILED", "peer_lost")), r_end
    lost = re.search(r"^(\S+ \S+) WARNING \S+: peer \S+ lost", D.stderr()[log_from:], re.M)
    assert lost, "D never logged the peer lost"
    quarantined_for = None
    if r_end.reason == "client_abort":  # the usual order: the router's abort came first
        # D kept R's pages quarantined until P was declared lost: R's timeline says so (a sampled
        # gauge can miss a window this short on a busy machine; the timeline cannot)
        steps = wait_for("R's pages released", lambda: released_steps(D, r_room), 30)
        lost_at = datetime.datetime.strptime(lost[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        assert steps["released"] >= lost_at - 0.05, \
            f"an aborted room's pages were freed {lost_at - steps['released']:.2f}s before P was declared lost"
        quarantined_for = steps["released"] - steps["quarantined"]
    print(f"\n(c) prefill killed mid-transfer: {time.monotonic() - started:.1f}s; "
          f"R ended {r_end.outcome}({r_end.reason}), its pages quarantined for {quarantined_for or 0:.2f}s, "
          f"X's decode leg answered {dended - killed:.2f}s after the kill")


# -- (b) kill -9 of the decode worker mid-transfer, then a new one on the same port -------------------


def test_decode_killed_mid_transfer_then_restarted():
    """Prefill ``Ps`` (stalled writes), prefill ``Pok`` (no faults) and decode ``D``; router ``R1``
    in front of ``Ps`` + ``D``. Rooms ``R`` (plain) and ``S`` (streamed) through ``R1`` and ``X``
    (by hand) are driven to mid-transfer, then ``kill -9 D``.

    - ``R1``'s clients get an error at once (their decode leg broke): a 502 for ``R``, an error
      event and ``[DONE]`` for ``S``; ``R1`` aborts their prefill legs.
    - ``X``'s prefill leg, which nobody aborts, ends ``FAILED(peer_lost)`` within the heartbeat
      bound, and ``Ps`` frees the room's pages (the stalled writes are torn down with the peer).
    - A new decode worker ``D2`` on ``D``'s port (a new incarnation): through router ``R2``
      (``Pok`` + the decode port), which served a request with ``D`` before the kill, the same
      request succeeds again with the same answer; a request through ``R1`` reaches mid-transfer again
      (``Ps`` takes the new incarnation) and ends with a clear error when its transfer deadline
      passes.
    - Every live worker: pages back, gauges 0, no live room.
    """
    started = time.monotonic()
    # a peer lost after 3 s of silence (not 1 s: the restarted pair must stay up through a whole
    # transfer deadline, also on two busy cores), and that deadline well past it
    silence_s, floor_s = HEARTBEAT_S * 15, 10.0
    args = DEADLINES + ["--heartbeat-misses", "15", "--transfer-floor-s", str(floor_s), "--kv-wait-s", "14"]
    c = Cluster(2, 1, "nixl", worker_args=args, prefill_args=[STALL, []], router=False)
    routers: list[RouterProcess] = []
    try:
        c.start()
        Ps, Pok = c.prefill
        D = c.decode[0]
        r1 = RouterProcess([(Ps.url, Ps.bootstrap_port)], [D.url], "--health-interval-s", "0.5", *SHOW_FAILURES)
        r2 = RouterProcess([(Pok.url, Pok.bootstrap_port)], [D.url], "--health-interval-s", "0.5", *SHOW_FAILURES)
        routers += [r1, r2]
        start_routers(r1, r2)  # side by side
        ok = post_generate(r2.url, prompt(50, 5), 8, timeout=60, **GREEDY)  # Pok knows D's first incarnation
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 8, ok.text
        timeout = KV_WAIT_S + PREALLOC_S + 30
        R, r_room = routed_mid_transfer(r1.url, Ps, D, prompt(100, 3), False, timeout, c.output)
        S, s_room = routed_mid_transfer(r1.url, Ps, D, prompt(80, 13), True, timeout, c.output)
        x_room = new_room()
        Xp, Xd = direct_pair(Ps, D, prompt(60, 4), 8, x_room, timeout)
        wait_mid_transfer(Ps, D, {x_room}, on_fail=c.output)

        killed = kill9(D)
        resp, ended = R.outcome(timeout)
        assert isinstance(resp, requests.Response) and resp.status_code == 502, resp
        assert ended - killed <= SLACK_S, f"the router's client waited {ended - killed:.1f}s after the kill"
        sresp, sended = S.outcome(timeout)
        assert isinstance(sresp, requests.Response) and sresp.status_code == 200, sresp
        assert "decode worker" in stream_error(sresp), sresp.text
        assert sended - killed <= SLACK_S, f"the streamed client waited {sended - killed:.1f}s after the kill"
        dresp, _ = Xd.outcome(timeout)
        assert isinstance(dresp, requests.ConnectionError), f"the dead decode answered {dresp!r}"
        presp, pended = Xp.outcome(timeout)
        assert isinstance(presp, requests.Response) and presp.status_code == 502, presp
        assert "peer_lost" in error_message(presp), presp.text
        assert pended - killed <= silence_s + SLACK_S, \
            f"prefill failed the room {pended - killed:.1f}s after the kill (bound {silence_s}s)"
        samples = assert_clean(Ps)
        assert counted(samples, "prefill", "failed", "peer_lost") >= 1, "peer_lost not in splitserve_requests_total"
        x_end, r_end, s_end = ending_of(Ps, x_room), ending_of(Ps, r_room), ending_of(Ps, s_room)
        assert (x_end.outcome, x_end.reason, x_end.last_state) == ("FAILED", "peer_lost", "TRANSFERRING"), x_end
        for end in (r_end, s_end):
            assert end.last_state == "TRANSFERRING" and (end.outcome, end.reason) in (
                ("ABORTED", "client_abort"), ("FAILED", "peer_lost")), end

        D2 = restart_on_same_port(c, D)
        for r in routers:
            wait_for("the routers see D2", lambda: requests.get(r.url + "/health", timeout=2).status_code == 200, 15)
        again_ok = post_generate(r2.url, prompt(50, 5), 8, timeout=60, **GREEDY)
        assert again_ok.status_code == 200 and again_ok.json()["output_ids"] == ok.json()["output_ids"], again_ok.text

        # the stalled prefill takes the new incarnation too; its transfer deadline ends the request
        again = Call(post_generate, r1.url, prompt(40, 6), 8, timeout=timeout, **GREEDY)
        wait_mid_transfer(Ps, D2, on_fail=c.output)
        aresp, aended = again.outcome(timeout)
        assert isinstance(aresp, requests.Response) and aresp.status_code == 504, (aresp, getattr(aresp, "text", ""))
        assert "transfer_timeout" in error_message(aresp), aresp.text
        assert aended - again.started <= floor_s + 2 * SLACK_S, aended - again.started
        for w in (Ps, Pok, D2):
            assert_clean(w)
    finally:
        stop_routers(*routers)
        c.stop()
    print(f"\n(b) decode killed mid-transfer and restarted: {time.monotonic() - started:.1f}s; "
          f"R and S ended {r_end.outcome}({r_end.reason}) / {s_end.outcome}({s_end.reason}) on prefill, "
          f"X's prefill leg answered "
          f"{pended - killed:.2f}s after the kill")


# -- a wedged engine loop behind a live control thread ----------------------------------------------

def test_wedged_prefill_engine_loop_is_declared_lost(lost_prefills):
    """Prefill ``P``'s engine loop wedges (``--inject-faults wedge_loop``: it blocks for good once it
    holds a room) while its control thread lives on and could keep answering heartbeats. Those
    stop once the loop has not iterated for ``--loop-stall-s``, so decode ``D`` declares ``P``
    lost: the room fails with ``peer_lost`` within ``LOOP_STALL_S + PEER_SILENCE_S`` (+ slack),
    ``D`` fences the session and frees every page, instead of waiting out ``--kv-wait-s`` or, for
    quarantined pages, forever."""
    c = lost_prefills
    P, D = c.prefill[1], c.decode[0]
    fenced = metric(metrics(D), "splitserve_receive_links_fenced")  # before: D may have fenced Ps
    room = new_room()
    _, Xd = direct_pair(P, D, prompt(60, 3), 8, room, 60)
    wait_for("X awaiting KV on D", lambda: any(r["room"] == room and r["state"] == "AWAITING_KV"
                                              for r in debug_rows(D)), 20, on_fail=c.output)
    wedged = time.monotonic()  # at the latest: P wedged when the request reached its loop
    resp, ended = Xd.outcome(60)
    assert isinstance(resp, requests.Response) and resp.status_code == 502, f"{resp!r}"
    assert "peer_lost" in error_message(resp), resp.text
    bound = LOOP_STALL_S + PEER_SILENCE_S + SLACK_S
    assert ended - wedged <= bound, f"D failed the room {ended - wedged:.1f}s after the wedge (bound {bound}s)"
    samples = assert_clean(D)
    assert metric(samples, "splitserve_receive_links_fenced") > fenced, samples
    assert "heartbeats withheld" in P.stderr(), P.output_tail(3000)
    kill9(P)  # a wedged loop never finishes its requests, so a graceful stop would wait out the drain
    print(f"\nwedged prefill loop: D failed the room {ended - wedged:.1f}s after P wedged (bound {bound:g}s)")


# -- (d) control messages dropped, delayed and duplicated ----------------------------------------------

CONTROL_FAULTS = "control_drop=0.2,control_delay=0.2,control_delay_s=0.3,control_duplicate=0.2"
LIFECYCLE_REASONS = ("bootstrap_timeout", "transfer_timeout", "peer_failed", "peer_lost", "overloaded",
                     "stalled", "transfer_error", "request_timeout")


def test_control_messages_dropped_delayed_duplicated():
    """Both workers drop, delay (0.3 s) and duplicate 20% of their outgoing control messages
    (registrations, aborts, failures, settle promises, heartbeats); a peer is lost only after 10
    missed heartbeats (2 s), so that drops alone rarely take a live peer down. 30 requests (10
    prompts, 3 times each, greedy) through the router, all at once:

    - each ends within its bound (a dropped registration is re-sent every second, within
      prefill's BOOTSTRAPPING deadline; a lost failure message: decode's PREALLOC + AWAITING_KV)
      with a success or a clear error that names the lifecycle reason;
    - nearly all succeed (every message that may be lost is sent again), and the answers to one
      prompt are all the same (no KV garbled by a write into the wrong pages);
    - afterwards every page is back on both workers (a dropped abort is re-sent while decode
      keeps its pages quarantined).
    """
    started = time.monotonic()
    misses = 10
    args = DEADLINES + ["--heartbeat-misses", str(misses)]
    bound = max(BOOTSTRAP_S, PREALLOC_S + KV_WAIT_S) + SLACK_S
    prompts = [prompt(random.Random(i).randint(20, 200), 100 + i) for i in range(10)]
    with Cluster(1, 1, "nixl", worker_args=args,
                 prefill_args=["--inject-faults", CONTROL_FAULTS + ",seed=1"],
                 decode_args=["--inject-faults", CONTROL_FAULTS + ",seed=2"]) as c:
        def one(i: int):
            t0 = time.monotonic()
            try:
                resp = post_generate(c.url, prompts[i % 10], 16, timeout=bound + 30, **GREEDY)
            except requests.RequestException as exc:
                return i, exc, time.monotonic() - t0
            return i, resp, time.monotonic() - t0

        with ThreadPoolExecutor(30) as pool:
            results = list(pool.map(one, range(30)))
        answers: dict[int, set] = {}
        failures = Counter()
        for i, resp, seconds in results:
            assert isinstance(resp, requests.Response), f"request {i}: {resp!r}"
            assert seconds <= bound, f"request {i} took {seconds:.1f}s (bound {bound:g}s): {resp.text[:300]}"
            if resp.status_code == 200:
                ids = resp.json()["output_ids"]
                assert len(ids) == 16 or resp.json()["meta_info"]["finish_reason"]["type"] == "stop", resp.text
                answers.setdefault(i % 10, set()).add(tuple(ids))
            else:
                message = error_message(resp)
                reason = next((r for r in LIFECYCLE_REASONS if r in message), None)
                assert resp.status_code >= 500 and reason, f"request {i}: unclear error {resp.status_code} {message}"
                failures[reason] += 1
        successes = 30 - sum(failures.values())
        # a lost message costs a delay (everything lost is sent again), hardly ever a request
        assert successes >= 27, f"only {successes}/30 succeeded; failures {dict(failures)}\n{c.output()}"
        for k, seen in answers.items():
            assert len(seen) == 1, f"prompt {k} got {len(seen)} different greedy answers: {seen}"
        for w in c.workers:
            assert_clean(w, timeout=30)
        notices = {w.role: Counter(re.findall(r"notice (\w+)", w.stderr())) for w in c.workers}
    print(f"\n(d) control faults: {time.monotonic() - started:.1f}s; {successes}/30 succeeded, failures "
          f"{dict(failures)}, slowest {max(s for _, _, s in results):.1f}s; notices {notices}")


# -- (a) clients hanging up under load -----------------------------------------------------------------

N_CLIENTS = 200
# The router's bound on a request, which only a hang reaches: on two shared cores under other runs the
# whole load has taken 28 s, and a busier machine takes several times that; a bound it could reach
# would fail a request that was only slow.
ROUTER_TIMEOUT_S = 300.0


@dataclass
class Client:
    """One streaming client of (a): what it planned and what happened."""

    i: int
    ids: list[int]
    max_new_tokens: int
    plan: str  # complete | hang_up_at (after ``delay`` s) | hang_up_after (``after`` events)
    delay: float = 0.0
    after: int = 0
    stage: str = "before_headers"  # how far it got: before_headers, before_first_event, mid_stream, done
    status: Optional[int] = None
    raw: bytes = b""
    seconds: float = 0.0
    error: Optional[str] = None
    hung_up: bool = False

    @property
    def events(self) -> list:
        return sse_events(self.raw.decode("utf-8", errors="replace"))


async def run_client(session, url: str, cl: Client) -> None:
    import aiohttp

    body = {"input_ids": cl.ids, "sampling_params": {"max_new_tokens": cl.max_new_tokens, **GREEDY}, "stream": True}
    t0 = time.monotonic()

    async def talk() -> None:
        resp = await session.post(url + "/generate", json=body)
        try:
            cl.status, cl.stage = resp.status, "before_first_event"
            async for line in resp.content:
                cl.raw += line
                if line.startswith(b"data: [DONE]"):
                    cl.stage = "done"
                elif line.startswith(b"data: "):
                    cl.stage = "mid_stream"
                    if cl.plan == "hang_up_after" and len(cl.events) >= cl.after:
                        cl.hung_up = True
                        return
        finally:
            resp.close()  # the connection, not just the response: a hang-up

    task = asyncio.ensure_future(talk())
    try:
        if cl.plan == "hang_up_at":
            await asyncio.wait({task}, timeout=cl.delay)
            if not task.done():
                cl.hung_up = True
                task.cancel()
        await asyncio.wait_for(asyncio.shield(task), ROUTER_TIMEOUT_S + SLACK_S)
    except asyncio.CancelledError:
        pass
    except asyncio.TimeoutError:
        task.cancel()
        cl.error = "no answer: the client hangs"
    except aiohttp.ClientError as exc:
        cl.error = f"{type(exc).__name__}: {exc}"
    cl.seconds = time.monotonic() - t0


def check_stream(cl: Client) -> None:
    """A finished ``/generate`` stream: JSON chunks, each the answer so far (cumulative ids), the
    last with its finish reason and all the tokens, then ``[DONE]``; no error event."""
    events = cl.events
    assert cl.status == 200 and events and events[-1] == "[DONE]", (cl.status, cl.raw[-500:])
    chunks = events[:-1]
    assert chunks and not any("error" in e for e in chunks), cl.raw[-500:]
    prev: list = []
    for chunk in chunks:
        ids = chunk["output_ids"]
        assert ids[:len(prev)] == prev, f"client {cl.i}: output_ids not cumulative"
        prev = ids
    last = chunks[-1]
    reason = last["meta_info"]["finish_reason"]["type"]
    assert reason in ("length", "stop"), last
    assert len(prev) == cl.max_new_tokens or reason == "stop", (len(prev), last)
    assert last["meta_info"]["completion_tokens"] == len(prev), last


def test_client_disconnects_under_load():
    """200 streaming ``/generate`` requests at once through the router (prompts of 20-200 tokens,
    16-32 new tokens, greedy), over a 1 + 1 nixl pair. Two thirds read their stream to the end; a
    sixth hang up at a random moment (within 2 s of sending: before the headers, before the first
    event, or mid-stream, whichever it turns out to be), a sixth after a random number of events.

    - Every client ends within the router's ``--request-timeout-s`` (never a hang); every client
      that read to the end got a well-formed stream (:func:`check_stream`), hung up or not.
    - Hang-ups happened in each stage: before the first byte of the answer and mid-stream.
    - Afterwards both workers: gauges 0, pages back, nothing quarantined, no live room; and each
      request ended exactly once on each worker that saw it (its log lines, counted by last state
      and reason in the printed summary).
    """
    import aiohttp

    started = time.monotonic()
    rng = random.Random(2024)
    clients = []
    for i in range(N_CLIENTS):
        plan = "complete" if i % 3 else rng.choice(["hang_up_at", "hang_up_after"])
        new = rng.randint(16, 32)
        clients.append(Client(i, prompt(rng.randint(20, 200), 1000 + i), new, plan,
                              delay=rng.choice([rng.uniform(0.0, 0.1), rng.uniform(0.1, 2.0)]),
                              after=rng.randint(1, new - 1)))
    with Cluster(1, 1, "nixl", router_args=["--request-timeout-s", str(ROUTER_TIMEOUT_S)]) as c:
        t_load = time.monotonic()

        async def main():
            connector = aiohttp.TCPConnector(limit=0, force_close=True)
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as s:
                await asyncio.gather(*(run_client(s, c.url, cl) for cl in clients))

        asyncio.run(main())
        load_s = time.monotonic() - t_load
        for cl in clients:
            assert cl.error is None, f"client {cl.i} ({cl.plan}): {cl.error}"
            if cl.stage == "done":
                check_stream(cl)
            else:
                assert cl.hung_up, f"client {cl.i} ({cl.plan}) stopped at {cl.stage} without hanging up"
        stages = Counter(cl.stage for cl in clients if cl.hung_up)
        assert stages["before_headers"] + stages["before_first_event"] >= 10, stages
        assert stages["mid_stream"] >= 10, stages
        assert sum(cl.stage == "done" for cl in clients if cl.plan == "complete") == sum(
            cl.plan == "complete" for cl in clients)
        for w in c.workers:
            assert_clean(w, timeout=30)
        ends = {w.role: Counter(f"{e.outcome}({e.reason}) in {e.last_state}" for e in endings(w)) for w in c.workers}
        for w in c.workers:
            rooms = Counter(e.room for e in endings(w))
            assert not [r for r, n in rooms.items() if n > 1], f"{w.role}: rooms ended twice"
        router_outcomes = Counter(re.findall(r"room \d+ generate: (\w+) \(", c.router.output()))
    print(f"\n(a) {N_CLIENTS} streams, a third hanging up: {time.monotonic() - started:.1f}s "
          f"({load_s:.1f}s of load); clients: {sum(cl.stage == 'done' for cl in clients)} done, hung up "
          f"{dict(stages)}; slowest client {max(cl.seconds for cl in clients):.1f}s; "
          f"router {dict(router_outcomes)}; prefill {dict(ends['prefill'])}; decode {dict(ends['decode'])}")


# -- (e) prefill and decode in network namespaces of their own, the link cut mid-transfer --------------


class Partitioned:
    """Workers in two network namespaces joined by a veth link (``net``), KV over NIXL with UCX's
    TCP transport. ``servers``: (name, side ``"a"`` or ``"b"``, role, extra options, ``UCX_TLS``).
    The root namespace cannot reach any of them: the test drives them from threads inside their
    namespaces (``netns.run_in``), with the bootstrap fields the router would add."""

    def __init__(self, tag: str, servers, deadlines=DEADLINES):
        import netns

        self.net = netns.NetnsPair(tag)
        self.servers = []
        for name, side, role, extra, ucx_tls in servers:
            ns, host = (self.net.a, self.net.addr_a) if side == "a" else (self.net.b, self.net.addr_b)
            args = ["--role", role, "--transfer-backend", "nixl", *deadlines, *extra]
            bootstrap = None
            if role == "prefill":
                bootstrap = free_port()
                args += ["--bootstrap-port", str(bootstrap)]
            server = netns.NetnsServer(ns, host, *args, env={"UCX_TLS": ucx_tls})
            server.role, server.bootstrap_port, server.name = role, bootstrap, name
            setattr(self, name, server)
            self.servers.append(server)

    def start(self) -> "Partitioned":
        try:
            self.net.open()
            for server in self.servers:
                server._spawn(free_port())
            for server in self.servers:
                server.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        try:
            for server in self.servers:
                if server.proc is not None and server.proc.poll() is None:
                    server.send_signal(signal.SIGTERM)
            for server in self.servers:
                server.stop(timeout=15)
        finally:
            self.net.close()

    def output(self) -> str:
        return "\n".join(s.output_tail(3000) for s in self.servers)


@pytest.fixture(scope="module")
def partitioned():
    import netns

    why = netns.unavailable()
    if why:
        pytest.skip(why)
    # namespace a: prefill Ps (stalled writes), Pok and Pheal (no faults; Pheal for the healing test
    # alone, so that neither test depends on the peers the other lost); namespace b: decode D
    setup = Partitioned("e", [("Ps", "a", "prefill", STALL, "tcp"), ("Pok", "a", "prefill", [], "tcp"),
                              ("Pheal", "a", "prefill", [], "tcp"), ("D", "b", "decode", [], "tcp")]).start()
    try:
        yield setup
    finally:
        setup.stop()


def test_link_cut_mid_transfer(partitioned):
    """Room ``X`` on ``Ps`` + ``D`` is driven to mid-transfer, then the link is cut (both veth
    ends down: no reset, packets just vanish).

    - Both sides fail ``X`` with ``peer_lost`` within the heartbeat bound (``PEER_SILENCE_S`` +
      slack), and each leg's client gets a 502 naming it.
    - While the link is still down, both free everything: ``Ps`` its source pages (the stalled
      writes are torn down with the peer), ``D`` its pages (released once the peer is lost and
      its receiving link closed: the fence).
    - The link comes back; a new request on ``Pok`` + ``D`` (a pair that had nothing in flight
      during the cut) succeeds; every worker ends clean.
    """
    s = partitioned
    started = time.monotonic()
    timeout = KV_WAIT_S + PREALLOC_S + 30
    x_room = new_room()
    Xp, Xd = direct_pair(s.Ps, s.D, prompt(100, 7), 8, x_room, timeout)
    wait_mid_transfer(s.Ps, s.D, {x_room}, on_fail=s.output)
    s.net.cut()
    cut = time.monotonic()
    answered = {}
    try:
        for leg, who in ((Xp, "prefill"), (Xd, "decode")):
            resp, ended = leg.outcome(timeout)
            answered[who] = ended - cut
            assert isinstance(resp, requests.Response) and resp.status_code == 502, f"{who} leg: {resp!r}"
            assert "peer_lost" in error_message(resp), resp.text
            assert ended - cut <= PEER_SILENCE_S + SLACK_S, \
                f"{who} failed the room {ended - cut:.1f}s after the cut (bound {PEER_SILENCE_S}s)"
        samples = {}
        for server in (s.Ps, s.D):
            samples[server.name] = got = assert_clean(server)
            assert counted(got, server.role, "failed", "peer_lost") >= 1, f"{server.name}: peer_lost not counted"
            assert metric(got, "splitserve_peers", role=server.role, state="lost") >= 1, f"{server.name}: {got}"
        # D freed X's pages only after fencing Ps: its receiving link is closed (rule 6)
        assert metric(samples["D"], "splitserve_receive_links_fenced") >= 1, samples["D"]
        assert re.search(r"receiving link \S+ for \S+ closed: its writes are fenced", s.D.stderr()), \
            s.D.output_tail(3000)
    finally:
        s.net.restore()
    p_end, d_end = ending_of(s.Ps, x_room), ending_of(s.D, x_room)
    assert (p_end.outcome, p_end.reason, p_end.last_state) == ("FAILED", "peer_lost", "TRANSFERRING"), p_end
    assert (d_end.outcome, d_end.reason, d_end.last_state) == ("FAILED", "peer_lost", "AWAITING_KV"), d_end

    Np, Nd = direct_pair(s.Pok, s.D, prompt(50, 8), 8, new_room(), 60)
    presp, _ = Np.outcome(90)
    dresp, _ = Nd.outcome(90)
    assert isinstance(dresp, requests.Response) and dresp.status_code == 200, f"{dresp!r} {getattr(dresp, 'text', '')}"
    assert len(dresp.json()["output_ids"]) == 8, dresp.text
    assert isinstance(presp, requests.Response) and presp.status_code == 200, presp
    for server in s.servers:
        assert_clean(server)
    print(f"\n(e) link cut mid-transfer: {time.monotonic() - started:.1f}s; both sides failed the room "
          f"(peer_lost), their clients answered {answered['prefill']:.2f}s / {answered['decode']:.2f}s after the cut")


def test_same_pair_serves_again_after_the_partition_heals(partitioned):
    """``Pheal`` + ``D`` serve a request. Then ``D`` gets a request for ``Pheal`` whose prefill leg
    never comes (``Pheal`` holds the registration, ``D`` waits in ``AWAITING_KV``), and the link is
    cut: both declare the other lost, ``D`` fails the room with ``peer_lost`` within the heartbeat
    bound. As soon as the link is back, a new request on the same pair must succeed, as it would
    after any transient network fault: ``D`` opens a new session with ``Pheal`` (new control
    socket, fresh info, new receiving link) while the lost session stays lost on both sides."""
    s = partitioned
    ok_p, ok_d = direct_pair(s.Pheal, s.D, prompt(40, 9), 8, new_room(), 60)
    assert ok_d.outcome(90)[0].status_code == 200 and ok_p.outcome(90)[0].status_code == 200

    y_room = new_room()
    extra = {"bootstrap_host": s.Pheal.host, "bootstrap_port": s.Pheal.bootstrap_port, "bootstrap_room": y_room}
    Y = Call(s.D.post_generate, s.D.url, prompt(40, 10), 8, timeout=60, extra=extra, **GREEDY)
    wait_for("Y awaiting KV on D", lambda: any(r["room"] == y_room and r["state"] == "AWAITING_KV"
                                               for r in debug_rows(s.D)), 20)

    def pheal_holds_the_registration() -> bool:
        samples = s.Pheal.call(metrics, s.Pheal)
        return metric(samples, "splitserve_lifecycle_entries", role="prefill", kind="pending_registrations") >= 1

    wait_for("Pheal holds Y's registration (so it depends on D)", pheal_holds_the_registration, 10)
    s.net.cut()
    cut = time.monotonic()
    try:
        resp, ended = Y.outcome(60)
        assert isinstance(resp, requests.Response) and resp.status_code == 502, resp
        assert "peer_lost" in error_message(resp), resp.text
        assert ended - cut <= PEER_SILENCE_S + SLACK_S, f"decode failed the room {ended - cut:.1f}s after the cut"
        wait_for("Pheal declares D lost", lambda: re.search(r"peer \S+ lost", s.Pheal.stderr()),
                 PEER_SILENCE_S + SLACK_S)
    finally:
        s.net.restore()
    Np, Nd = direct_pair(s.Pheal, s.D, prompt(50, 11), 8, new_room(), 60)
    dresp, _ = Nd.outcome(90)
    presp, _ = Np.outcome(90)
    for server in s.servers:
        assert_clean(server)
    assert isinstance(dresp, requests.Response), dresp
    prefill_said = f"{getattr(presp, 'status_code', presp)} {getattr(presp, 'text', '')[:300]}"
    assert dresp.status_code == 200, f"decode: {dresp.status_code} {error_message(dresp)}; prefill: {prefill_said}"
    assert len(dresp.json()["output_ids"]) == 8, dresp.text


LATE_DEADLINES = [  # long enough that only the cut ends the transfer; peers lost after 3 s
    "--heartbeat-interval-s", "0.2", "--heartbeat-misses", "15", "--transfer-floor-s", "40", "--kv-wait-s", "60",
    "--prealloc-s", "20", "--bootstrap-s", "30", "--queue-s", "30", "--pending-registration-s", "30",
    "--prefill-stall-s", "30", "--decode-stall-s", "30", "--write-drain-s", "3", "--quarantine-resend-s", "0.5",
    "--tombstone-s", "120",
]


@pytest.mark.long  # 35 s and timing-dependent set-up: `make check-long`; test_receive_links.py shows the fence every day
def test_no_late_write_lands_after_the_partition_heals():
    """A real transfer cut in the middle, not a stalled one: prefill ``P`` in namespace ``a``; decode
    ``D`` and a second prefill ``PL`` in namespace ``b`` (``PL`` reaches ``D`` without the link, over
    UCX shared memory). The link from ``a`` is shaped to 8 Mbit/s, so that the 8 MB of KV of a
    4,000-token prompt take seconds to cross.

    - ``A`` (4,000 tokens) on ``P`` + ``D``: 1 s into its transfer the link is cut; both sides
      fail ``A`` with ``peer_lost`` and free its pages (``D`` once it has closed ``P``'s receiving
      link: the fence, ``transfer/links.py``).
    - ``C`` (another 4,000-token prompt, 600 new tokens, greedy) on ``PL`` + ``D`` gets the pages
      ``A`` had (the allocator hands out the lowest run). While ``C`` decodes, the link comes back.
    - ``C``'s answer must be what the same request gives afterwards on a quiet pair: nothing of
      ``A`` may land in ``C``'s pages.
    """
    import netns

    why = netns.shaping_unavailable()
    if why:
        pytest.skip(why)
    started = time.monotonic()
    s = Partitioned("w", [("P", "a", "prefill", [], "tcp"), ("PL", "b", "prefill", [], "tcp,sm,self"),
                          ("D", "b", "decode", [], "tcp,sm,self")], deadlines=LATE_DEADLINES).start()
    try:
        warm_p, warm_d = direct_pair(s.P, s.D, prompt(40, 20), 4, new_room(), 60)
        assert warm_d.outcome(90)[0].status_code == 200 and warm_p.outcome(90)[0].status_code == 200

        s.net.throttle("8mbit")
        a_room = new_room()
        Ap, Ad = direct_pair(s.P, s.D, prompt(4000, 21), 8, a_room, 120)
        wait_mid_transfer(s.P, s.D, {a_room}, timeout=60, on_fail=s.output)
        time.sleep(1.0)
        assert {r["state"] for r in debug_rows(s.P) if r["room"] == a_room} == {"TRANSFERRING"}, "A's transfer ended"
        s.net.cut()
        cut = time.monotonic()
        for leg, who in ((Ap, "prefill"), (Ad, "decode")):
            resp, ended = leg.outcome(120)
            assert isinstance(resp, requests.Response) and resp.status_code == 502, f"{who} leg: {resp!r}"
            assert "peer_lost" in error_message(resp), resp.text
            assert ended - cut <= 3.0 + SLACK_S, f"{who} failed A {ended - cut:.1f}s after the cut"
        s.net.unthrottle()
        assert_clean(s.D)

        c_ids = prompt(4000, 22)
        Cp, Cd = direct_pair(s.PL, s.D, c_ids, 600, new_room(), 180)
        wait_for("C decoding", lambda: any(r["state"] == "DECODING" for r in debug_rows(s.D)), 60)
        s.net.restore()
        during, _ = Cd.outcome(240)
        assert isinstance(during, requests.Response) and during.status_code == 200, during
        assert Cp.outcome(60)[0].status_code == 200

        Rp, Rd = direct_pair(s.PL, s.D, c_ids, 600, new_room(), 180)
        ref, _ = Rd.outcome(240)
        assert isinstance(ref, requests.Response) and ref.status_code == 200, ref
        assert Rp.outcome(60)[0].status_code == 200
        for server in s.servers:
            assert_clean(server)
        got, want = during.json()["output_ids"], ref.json()["output_ids"]
        if got != want:  # without the fence (decode not closing P's link) this is what happens
            at = next(i for i, (x, y) in enumerate(zip(got, want)) if x != y)
            raise AssertionError(f"C's answer while the link came back differs from the same request's afterwards "
                                 f"from token {at} of {len(want)}: bytes of A's write landed in C's pages")
    finally:
        s.stop()
        print(f"\n(e) late write after a partition: {time.monotonic() - started:.1f}s")


def test_two_decodes_on_two_hosts_with_the_same_address_are_two_peers():
    """Two decode workers on two hosts, both started with ``--host 0.0.0.0 --port N`` (namespaces
    ``a`` and ``b``), advertise the same address. They are two peers all the same: a peer's identity
    is its incarnation, never an address. Requests through both, in flight at the same time, all
    succeed on one prefill."""
    import netns

    why = netns.unavailable()
    if why:
        pytest.skip(why)
    port = free_port()
    deadlines = DEADLINES + ["--transfer-backend", "nixl"]
    with netns.NetnsPair(tag="id", subnet="10.78.0") as net:
        P = netns.NetnsServer(net.a, net.addr_a, "--role", "prefill", "--bootstrap-port", str(free_port()),
                              *deadlines, env={"UCX_TLS": "tcp"})
        P.bootstrap_port = int(P.args[P.args.index("--bootstrap-port") + 1])
        decodes = [netns.NetnsServer(ns, "0.0.0.0", "--role", "decode", *deadlines, env={"UCX_TLS": "tcp"})
                   for ns in (net.a, net.b)]
        servers = [P, *decodes]
        try:
            P._spawn(free_port())
            for d in decodes:
                d._spawn(port)
            for s in servers:
                s.wait_ready()
            P.host = net.addr_a  # what the decodes dial (bootstrap_host)
            calls = []
            for i in range(6):
                calls.append(direct_pair(P, decodes[i % 2], prompt(30 + i, 500 + i), 4, new_room(), 60))
                time.sleep(0.2)
            for i, (pc, dc) in enumerate(calls):
                for who, call in (("prefill", pc), ("decode", dc)):
                    resp, _ = call.outcome(60)
                    assert getattr(resp, "status_code", None) == 200, \
                        f"request {i} ({who} leg, decode {i % 2}): {resp!r} {getattr(resp, 'text', '')[:300]}"
            for s in servers:
                assert_clean(s)
            assert not re.search(r"peer \S+ lost", P.stderr()), P.output_tail(3000)
        finally:
            for s in servers:
                s.stop(timeout=15)
