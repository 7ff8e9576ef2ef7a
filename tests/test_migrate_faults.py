"""A decode worker lost mid-answer, cut at a token rather than at a time: every client still gets
the answer a colocated worker gives.

Real processes (tiny model, the compiled kernels): a colocated reference ``C``, and 1 prefill + 2
decode workers behind a router with ``--max-migrations 2``; decode ``A`` runs with
``--inject-faults kill_after_tokens=N`` (it SIGKILLs itself once it has streamed N tokens of one
choice of some request) or, under ``make check-long``, ``pause_after_tokens=N`` (it SIGSTOPs
itself: alive and silent, until SIGCONT). Decode ``B`` is healthy.

The trigger ``T`` is sent first (round robin gives it ``A``), the rest once its first event has
come, so ``T`` is ahead of every request ``A`` holds and is the one cut at exactly N tokens
(sequences in one decode batch gain one token per step each): greedy, with a stop string whose
first character ``T``'s Nth token makes and holds back, so the stop string straddles the cut.
The rest (streamed and whole, greedy and seeded, a multi-byte prompt, ``n`` = 2, a
``json_schema``) are on ``A`` or ``B`` as round robin gives them and are cut wherever ``A`` is
when ``T`` ends it (or not at all). Every answer is compared with ``C``'s: a stream's events
(text, logprobs, finish reasons, usage; all but ``id`` and ``created``), a whole answer's
choices and usage.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest
import requests

from cluster import Cluster, pages_back_to_total, sse_events
from conftest import ServerProcess
from helpers.waiting import wait_for

N = 6  # the fault's token count
WORKER = ["--page-size", "16", "--max-total-tokens", "4096"]
PROMPT = "Once upon a time, in a land far away, there lived"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
OTHERS = {  # name: (path, body); "stream" in the body or not
    "stream-seeded": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.9, "seed": 11,
                                          "logprobs": 2, "stream": True}),
    "stream-multibyte": ("/v1/completions", {"prompt": "日本語の文章と中文的句子", "max_tokens": 24, "temperature": 1.0,
                                             "seed": 12, "stream": True}),
    "stream-n2": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 20, "temperature": 1.0, "seed": 9, "n": 2,
                                      "stream": True}),
    "stream-json": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "A person as JSON"}], "max_tokens": 40, "temperature": 1.0,
        "seed": 2, "stream": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}),
    "whole-greedy": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 40, "temperature": 0}),
    "whole-seeded": ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 40,
                                              "temperature": 0.8, "seed": 5}),
}
USAGE = {"stream_options": {"include_usage": True}}


def start(fault: str, *router_args: str) -> tuple[ServerProcess, Cluster]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPLITSERVE_KERNELS", "1")
        colocated = ServerProcess(*WORKER).spawn()
        cluster = Cluster(1, 2, worker_args=WORKER, decode_args=[["--inject-faults", fault], []],
                          router_args=["--max-migrations", "2", "--pd-threshold-tokens", "0", *router_args])
        try:
            cluster.start()
            cluster.wait_in_rotation()  # T's decode is round robin's first pick: A
            colocated.wait_ready()
        except BaseException:
            colocated.stop()
            cluster.stop()
            raise
    return colocated, cluster


def send(url: str, path: str, body: dict, rid: str, first: threading.Event = None):
    """A stream's events, or a whole answer's JSON; ``first`` set once a stream's first event came."""
    body = {"model": "tiny", **body, **(USAGE if body.get("stream") else {})}
    with requests.post(url + path, json=body, headers={"X-Request-Id": rid}, stream=True, timeout=300) as resp:
        assert resp.status_code == 200, resp.text
        if not body.get("stream"):
            return resp.json()
        raw = b""
        for chunk in resp.iter_content(chunk_size=None):
            raw += chunk
            if first is not None and b"\n\n" in raw:
                first.set()
    assert not any(line.startswith(b":") for line in raw.split(b"\n")), raw
    return sse_events(raw.decode())


def the_answer(got):
    """What must equal the reference: every event but its id and created; a whole answer's
    choices and usage."""
    if isinstance(got, dict):
        return got["choices"], got["usage"]
    return [{k: v for k, v in e.items() if k not in ("id", "created")} if isinstance(e, dict) else e for e in got]


def trigger_body(colocated: ServerProcess) -> dict:
    """T: greedy, with a stop string made of the last character of the text T's client has once
    the event with its Nth id came, and the next two: its first character is held back at the cut."""
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True}
    r = requests.post(colocated.url + "/v1/completions", json={**body, "stream_ids": True}, timeout=120)
    seen, shown, cut = 0, "", None
    for ids, data in blocks(r.text):
        if isinstance(data, dict) and data.get("choices"):
            seen += ids
            shown += data["choices"][0]["text"]
            cut = len(shown) if cut is None and seen >= N else cut
    assert cut is not None and cut >= 2 and cut + 2 <= len(shown), f"T's answer {shown!r} does not fit the test"
    stop = shown[cut - 1:cut + 2]
    assert shown.index(stop) == cut - 1, f"{stop!r} occurs before the cut in {shown!r}"
    return {**body, "stop": [stop]}


def blocks(text: str) -> list:
    """Each SSE event as (how many ids its ``: ids`` lines name, its data parsed)."""
    out = []
    for block in filter(None, text.split("\n\n")):
        lines = block.split("\n")
        ids = sum(len(line.split()) - 3 for line in lines if line.startswith(": ids "))
        data = [line[6:] for line in lines if line.startswith("data: ")]
        out.append((ids, json.loads(data[0]) if data and data[0] != "[DONE]" else None))
    return out


def run_all(colocated: ServerProcess, cluster: Cluster, before_the_rest=lambda: None) -> dict:
    """Send T, then (after ``before_the_rest()``) the rest, through the router; compare every
    answer with C's."""
    cases = {"trigger": ("/v1/completions", trigger_body(colocated)), **OTHERS}
    reference = {name: the_answer(send(colocated.url, path, body, f"ref-{name}")) for name, (path, body) in cases.items()}
    got, first = {}, threading.Event()

    def one(name, path, body):
        try:
            got[name] = send(cluster.url, path, body, name, first if name == "trigger" else None)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            got[name] = exc
            first.set()

    threads = [threading.Thread(target=one, args=("trigger", *cases["trigger"]), daemon=True)]
    threads[0].start()
    assert first.wait(120), "T's first event never came"
    decode = attempts(cluster, "trigger")[0]["decode"]  # the first leg's: A may have cut it already
    assert decode == cluster.decode[0].url, f"round robin gave T {decode}, not the faulty decode"
    before_the_rest()
    for name, (path, body) in OTHERS.items():
        threads.append(threading.Thread(target=one, args=(name, path, body), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join(300)
    for name in cases:
        assert not isinstance(got.get(name), BaseException), (name, got.get(name), cluster.output())
        assert the_answer(got[name]) == reference[name], name
    return got


def migrations(cluster: Cluster) -> dict:
    return {dict(labels)["reason"]: v for (name, labels), v in cluster.router.metrics().items()
            if name == "splitserve_router_migrations_total" and v}


def attempts(cluster: Cluster, rid: str) -> list:
    return requests.get(f"{cluster.url}/debug/requests/{rid}", timeout=10).json()["router"]["attempts"]


def test_a_decode_killed_after_n_tokens_loses_no_answer():
    """``A`` SIGKILLs itself once T streamed N tokens: T is continued on ``B`` (its second attempt
    decode alone), every client has ``C``'s answer, and ``B`` and the prefill end with every page
    free."""
    colocated, cluster = start(f"kill_after_tokens={N}")
    try:
        run_all(colocated, cluster)
        assert cluster.decode[0].proc.wait(30) == -signal.SIGKILL
        assert migrations(cluster).get("broken", 0) >= 1
        legs = attempts(cluster, "trigger")
        assert len(legs) == 2 and legs[1]["prefill"] is None, legs
        for worker in (cluster.decode[1], *cluster.prefill):
            pages_back_to_total(worker)
    finally:
        cluster.stop()
        colocated.stop()


@pytest.mark.long
def test_a_decode_stopped_after_n_tokens_loses_no_answer():
    """``A`` SIGSTOPs itself once T streamed N tokens: the router's silence bound
    (``--stream-stall-s`` 10, above decode's 5 s keep-alive, so a live but busy decode never trips
    it) continues the streams, and a whole answer is sent again once ``A`` fails its health checks;
    every client has ``C``'s answer. The rest are sent once the router has taken ``A`` out of
    rotation: a leg sent to a stopped worker before that gets no headers, and the router answers
    504 after ``--worker-header-timeout-s`` rather than placing it elsewhere. After SIGCONT ``A``
    aborts the legs the router gave up and ends with every page free."""
    colocated, cluster = start(f"pause_after_tokens={N}", "--stream-stall-s", "10", "--health-interval-s", "0.5")
    a = cluster.decode[0]
    try:
        run_all(colocated, cluster, lambda: wait_for(
            "the router takes the stopped decode out of rotation",
            lambda: cluster.router.metric("splitserve_router_worker_healthy", role="decode", url=a.url) == 0, 120))
        assert migrations(cluster).get("stalled", 0) >= 1
        os.kill(a.pid, signal.SIGCONT)
        for worker in (*cluster.decode, *cluster.prefill):
            pages_back_to_total(worker, timeout=60)
    finally:
        if a.proc is not None and a.proc.poll() is None:
            os.kill(a.pid, signal.SIGCONT)
        cluster.stop()
        colocated.stop()


def test_the_token_fault_is_off_unless_asked_and_strikes_once():
    """``--inject-faults``: no token fault unless named; ``kill_after_tokens=N`` and
    ``pause_after_tokens=N`` strike once, at the first count of N or more, with SIGKILL or
    SIGSTOP; a count that is not a positive integer, or both faults, are refused."""
    from splitserve.disagg.faults import TokenFault
    from splitserve.disagg.worker import parse_faults

    assert parse_faults("").tokens is None and parse_faults("wedge_loop").tokens is None
    assert (parse_faults("kill_after_tokens=3").tokens.action, parse_faults("pause_after_tokens=2").tokens.after) \
        == ("kill", 2)
    for bad in ("kill_after_tokens=0", "kill_after_tokens=x", "pause_after_tokens",
                "kill_after_tokens=2,pause_after_tokens=2"):
        with pytest.raises(ValueError):
            parse_faults(bad)
    for action, sig in (("kill", signal.SIGKILL), ("pause", signal.SIGSTOP)):
        struck = []
        fault = TokenFault(action, 3, strike=struck.append)
        for count in (1, 2, 4, 5, 3):
            fault.streamed("r", count)
        assert struck == [sig]
