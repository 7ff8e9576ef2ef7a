"""The operator's view against one real deployment: metrics (``docs/metrics.md``), request ids and
timelines, ``splitserve top`` in a real terminal (tmux), and a real Prometheus with the rules and
the dashboard of ``deploy/``.

One stack for the module: prefill ``P1`` and decode ``D`` behind router ``R`` serve the traffic;
prefill ``P2`` (``--inject-faults stall_writes``, transfer deadline :data:`STALL_FLOOR_S`) and the
same ``D`` behind router ``R2`` take the requests whose transfer stalls: such a request is late
(past half its deadline) after half of it, and fails ``transfer_timeout`` at its end. Prometheus
(Debian's package; ``.ci/run`` installs it, and tmux) scrapes all five processes every second
with ``deploy/alerts.yml``. Under ``CI=true`` a missing ``prometheus`` or ``tmux`` fails its test
instead of skipping it.

The stack is keyed as an operator would key it (``docs/security.md``): the routers and the workers
share the router's key, the operators' key (this test's reads of ``/debug``, ``/workers``, and
``splitserve top``) and a scraper's key, which Prometheus sends (``deploy/prometheus.yml``'s
``credentials_file``); the clients' routes stay open (no client key).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import requests
import yaml
import zmq
from prometheus_client.parser import text_string_to_metric_families

from cluster import Cluster, RouterProcess, free_port, metrics, start_routers, stop_routers
from conftest import REPO, log_dir
from splitserve.auth import bearer
from helpers.calls import Call
from helpers.waiting import wait_for

STALL_FLOOR_S = 8.0  # P2's transfer deadline: a stalled request is late after 4 s, fails at 8 s
DEPLOY = REPO / "deploy"
IN_CI = os.environ.get("CI") == "true"
KEYS = {"worker": "the-routers-key-for-its-workers", "admin": "the-operators-key", "metrics": "the-scrapers-key"}
ADMIN = bearer(KEYS["admin"])  # what this test's own reads of /debug, /workers and /metrics send


def key_files() -> dict[str, str]:
    """Each of ``KEYS`` in a file of its own (mode 0600), by name."""
    folder = log_dir("keys-")
    paths = {}
    for name, key in KEYS.items():
        path = folder / name
        path.write_text(key + "\n")
        path.chmod(0o600)
        paths[name] = str(path)
    return paths


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        message = f"{tool} is not installed (apt-get install {tool}; .ci/run does)"
        pytest.fail(message) if IN_CI else pytest.skip(message)
    return path


class Prometheus:
    """Debian's ``prometheus`` scraping the stack every second with ``deploy/alerts.yml``; the
    scrape configuration is ``deploy/prometheus.yml`` with the stack's addresses and 1 s intervals."""

    def __init__(self, jobs: dict[str, list[str]], metrics_key_file: str):
        self.dir = log_dir("prometheus-")
        config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        config["rule_files"] = [str(DEPLOY / f) for f in config["rule_files"]]
        assert {job["job_name"] for job in config["scrape_configs"]} == set(jobs)
        for job in config["scrape_configs"]:
            job["static_configs"] = [{"targets": [u.removeprefix("http://") for u in jobs[job["job_name"]]]}]
            assert set(job["authorization"]) == {"credentials_file"}, job  # the scraper's key, from its file
            job["authorization"]["credentials_file"] = metrics_key_file
        self.config = self.dir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(self.dir / "out.log", "wb")
        self.proc = subprocess.Popen(
            [shutil.which("prometheus"), f"--config.file={self.config}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL)
        wait_for("prometheus ready", lambda: requests.get(self.url + "/-/ready", timeout=2).status_code == 200, 30,
                 0.2, on_fail=self.output)

    def output(self) -> str:
        return (self.dir / "out.log").read_text(errors="replace")[-3000:]

    def query_range(self, expr: str, start: float) -> list:
        r = requests.get(self.url + "/api/v1/query_range", timeout=10,
                         params={"query": expr, "start": start, "end": time.time(), "step": "1s"})
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
        return body["data"]["result"]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class Stack:
    def __init__(self):
        self.started = time.time()
        self.keys = key_files()
        keyed = [arg for name in KEYS for arg in (f"--{name}-api-key-file", self.keys[name])]
        # an open control plane, so that bad_frames reach the parser and are counted as dropped
        stalled = ["--inject-faults", "stall_writes", "--transfer-floor-s", str(STALL_FLOOR_S)]
        self.cluster = Cluster(prefill=2, decode=1, router=False, worker_args=[*keyed, "--insecure-control-plane"],
                               prefill_args=[[], stalled]).start()
        self.P1, self.P2 = self.cluster.prefill
        self.D = self.cluster.decode[0]
        self.R = RouterProcess([(self.P1.url, self.P1.bootstrap_port)], [self.D.url], "--health-interval-s", "0.5",
                               *keyed)
        self.R2 = RouterProcess([(self.P2.url, self.P2.bootstrap_port)], [self.D.url], "--health-interval-s", "0.5",
                                *keyed)
        self.prometheus = None
        self.stalls: list[Call] = []

    def start(self) -> "Stack":
        start_routers(self.R, self.R2)  # side by side
        if shutil.which("prometheus"):
            self.prometheus = Prometheus({"splitserve-router": [self.R.url, self.R2.url],
                                          "splitserve-prefill": [self.P1.url, self.P2.url],
                                          "splitserve-decode": [self.D.url]}, self.keys["metrics"])
        return self

    @property
    def processes(self) -> list:
        return [self.R, self.R2, *self.cluster.workers]

    def stall(self, rid: str) -> Call:
        """A streaming request through ``R2``: its transfer stalls on ``P2``."""
        call = Call(requests.post, self.R2.url + "/v1/completions", headers={"X-Request-Id": rid}, timeout=60,
                    json={"prompt": "stall", "max_tokens": 4, "stream": True})
        self.stalls.append(call)
        return call

    def wait_late(self, rid: str, timeout: float = STALL_FLOOR_S + 10) -> dict:
        def late():
            rows = requests.get(self.P2.url + "/debug/requests", timeout=5, headers=ADMIN).json()
            return next((r for r in rows if r["rid"] == rid and r["late"]), None)
        return wait_for(f"{rid} late on P2", late, timeout, 0.1)

    def stop(self) -> None:
        if self.prometheus is not None:
            self.prometheus.stop()
        stop_routers(self.R, self.R2)
        self.cluster.stop()


def serve_traffic(url: str) -> None:
    """Every endpoint, streaming and not, through the router (all must succeed)."""
    for i in range(2):
        r = requests.post(url + "/v1/completions", json={"prompt": "hello there", "max_tokens": 6, "stream": True},
                          timeout=60)
        assert r.status_code == 200 and "[DONE]" in r.text, r.text
    for stream in (True, False):
        r = requests.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": stream})
        assert r.status_code == 200, r.text
        r = requests.post(url + "/generate", json={"input_ids": list(range(20, 60)), "stream": stream,
                                                   "sampling_params": {"max_new_tokens": 6}}, timeout=60)
        assert r.status_code == 200, r.text


def bad_frames(port: int) -> None:
    """Frames whose identity envelope is not ours, at a prefill's bootstrap port: dropped, counted."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, b"x#y#\xc2\xb2")
        sock.connect(f"tcp://127.0.0.1:{port}")
        for _ in range(3):
            sock.send(b"\x00garbage")
        time.sleep(0.3)
    finally:
        ctx.destroy(linger=0)  # closes the socket too, also when a send failed


@pytest.fixture(scope="module")
def stack():
    s = Stack()
    try:
        s.start()
        serve_traffic(s.R.url)
        bad_frames(s.P1.bootstrap_port)
        yield s
    finally:
        s.stop()


# -- metrics ---------------------------------------------------------------------------------------


def metric_table() -> dict[str, tuple[str, set]]:
    """``docs/metrics.md``'s table: name -> (type, label names)."""
    rows = {}
    for line in (REPO / "docs" / "metrics.md").read_text().splitlines():
        m = re.match(r"\| `(splitserve_\w+)` \| (\w+) \|([^|]*)\|", line)
        if m:
            rows[m.group(1)] = (m.group(2), {x.strip() for x in m.group(3).split(",") if x.strip()})
    return rows


def scrape(stack) -> dict[str, tuple[str, set, int]]:
    """Every process's ``/metrics``: name (a counter with its ``_total``) -> (type, label names, samples)."""
    out: dict[str, tuple[str, set, int]] = {}
    for proc in stack.processes:
        text = requests.get(proc.url + "/metrics", timeout=10, headers=bearer(KEYS["metrics"])).text
        for fam in text_string_to_metric_families(text):
            name = fam.name + "_total" if fam.type == "counter" else fam.name
            labels = {k for s in fam.samples for k in s.labels if k != "le"}
            typ, seen, n = out.get(name, (fam.type, set(), 0))
            out[name] = (typ, seen | labels, n + len(fam.samples))
    return out


def silent_peers(worker) -> set[str]:
    """The peers of ``splitserve_peer_silence_seconds`` on ``worker`` now."""
    return {dict(labels)["peer"] for name, labels in metrics(worker, KEYS["admin"])
            if name == "splitserve_peer_silence_seconds"}


def union(a: dict, b: dict) -> dict:
    return {k: (a.get(k, b.get(k))[0], a.get(k, (0, set(), 0))[1] | b.get(k, (0, set(), 0))[1],
                a.get(k, (0, set(), 0))[2] + b.get(k, (0, set(), 0))[2]) for k in {*a, *b}}


def test_every_metric_in_the_table_is_emitted(stack):
    """``docs/metrics.md`` against real scrapes of every process, during a stalled transfer (peers,
    their silence, a late request) and after it failed (failed transfers): every metric of the
    table has samples, its type and its labels; every metric emitted is in the table. A peer's
    series leave with the last room that depends on it."""
    call = stack.stall("table-stall")
    stack.wait_late("table-stall")
    during = scrape(stack)
    live = requests.get(stack.P2.url + "/debug/requests/table-stall", timeout=5, headers=ADMIN).json()  # a live request's timeline
    assert live["live"] and [s["state"] for s in live["steps"]][-1] == "TRANSFERRING", live
    assert live["steps"][-1]["duration_s"] >= STALL_FLOOR_S / 2, live  # in TRANSFERRING until now
    # per-peer series are there while a room depends on the peer: P2 and D see each other now
    peers = silent_peers(stack.D), silent_peers(stack.P2)
    assert [len(p) for p in peers] == [1, 1], peers
    late = [n for n in (requests.get(stack.P2.url + "/metrics", timeout=5, headers=ADMIN).text.splitlines())
            if n.startswith('splitserve_requests_late{role="prefill",state="TRANSFERRING"}')]
    assert late and float(late[0].split()[-1]) >= 1, late
    resp, _ = call.outcome(STALL_FLOOR_S + 20)
    assert '"code":"peer_failed"' in resp.text, resp.text  # the client reads words; the prefill's timeline why
    ended = requests.get(stack.P2.url + "/debug/requests/table-stall", timeout=5, headers=ADMIN).json()
    assert ended["ending"].startswith("FAILED(transfer_timeout)"), ended
    seen = union(during, wait_for("the failed transfer counted on both sides", lambda: (
        lambda s: s if s.get("splitserve_kv_transfer_failures_total", (0, 0, 0))[2] >= 2 else None)(scrape(stack)), 10))
    # ... and gone with the room: no series is left behind for a peer nothing depends on
    wait_for("the peer series gone with the failed room",
             lambda: not silent_peers(stack.D) | silent_peers(stack.P2), 10)
    table = metric_table()
    assert len(table) > 40, "the table was not read"
    missing = sorted(n for n in table if n not in seen or seen[n][2] == 0)
    assert not missing, f"in docs/metrics.md but never emitted: {missing}"
    untabled = sorted(n for n in seen if n not in table)
    assert not untabled, f"emitted but not in docs/metrics.md: {untabled}"
    wrong = {n: (table[n], seen[n][:2]) for n in table if (seen[n][0], seen[n][1]) != table[n]}
    assert not wrong, f"type or labels differ from docs/metrics.md: {wrong}"


# -- request ids and timelines ------------------------------------------------------------------------


def test_one_request_id_on_both_legs_and_the_joined_timelines(stack):
    R = stack.R
    r = requests.post(R.url + "/v1/chat/completions", headers={"X-Request-Id": "ops-chat-1"}, timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True})
    assert r.status_code == 200 and r.headers["X-Request-Id"] == "ops-chat-1"
    drawn = requests.post(R.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    assert drawn.status_code == 200 and re.fullmatch(r"[0-9a-f]{32}", drawn.headers["X-Request-Id"])
    assert drawn.json()["id"] == "cmpl-" + drawn.headers["X-Request-Id"]  # the decode worker used it too
    gen = requests.post(R.url + "/generate", json={"input_ids": [5, 6, 7], "rid": "ops-gen-1",
                                                   "sampling_params": {"max_new_tokens": 3}}, timeout=60)
    assert gen.status_code == 200 and gen.headers["X-Request-Id"] == "ops-gen-1"
    bad = requests.post(R.url + "/v1/completions", headers={"X-Request-Id": "has space"}, timeout=10,
                        json={"prompt": "x", "max_tokens": 2})
    assert bad.status_code == 400 and "X-Request-Id" in bad.json()["error"]["message"]

    for rid in ("ops-chat-1", "ops-gen-1"):
        joined = requests.get(f"{R.url}/debug/requests/{rid}", timeout=10, headers=ADMIN).json()
        assert joined["router"]["outcome"] == "finished" and joined["router"]["prefill"] == stack.P1.url
        by_role = {w["role"]: w["timeline"] for w in joined["workers"]}
        assert [s["state"] for s in by_role["prefill"]["steps"]][:5] == [
            "BOOTSTRAPPING", "QUEUED", "PREFILLING", "TRANSFERRING", "FINISHED(transferred)"], by_role["prefill"]
        assert [s["state"] for s in by_role["decode"]["steps"]][:4] == [
            "PREALLOC", "AWAITING_KV", "DECODING", "FINISHED(length)"], by_role["decode"]
        assert by_role["decode"]["steps"][2]["event"].startswith("KVDone from"), by_role["decode"]
        assert by_role["prefill"]["room"] == by_role["decode"]["room"] == joined["router"]["room"]
        times = [s["time"] for s in joined["steps"]]
        assert times == sorted(times) and len(times) == sum(len(t["steps"]) for t in by_role.values())
        room = joined["router"]["room"]
        assert requests.get(f"{stack.D.url}/debug/rooms/{room}", timeout=5, headers=ADMIN).json()["rid"] == rid
    assert requests.get(R.url + "/debug/requests/never-seen", timeout=10, headers=ADMIN).status_code == 404
    assert requests.get(stack.D.url + "/debug/requests/never-seen", timeout=10, headers=ADMIN).status_code == 404
    # every process logs the same id, and each worker's end-of-request line carries the timeline
    wait_for("the end lines", lambda: all("ops-gen-1" in w.stderr() for w in (stack.P1, stack.D)), 5)
    for w, last in ((stack.P1, "FINISHED(transferred)"), (stack.D, "FINISHED(length)")):
        line = next(x for x in w.stderr().splitlines() if "ops-gen-1" in x and "room=" in x)
        assert re.search(r"timeline: .*QUEUED|timeline: PREALLOC", line) and last in line, line
    assert "rid=ops-gen-1" in R.output()

    workers = requests.get(R.url + "/workers", timeout=5, headers=ADMIN).json()
    assert {(w["role"], w["url"], w["healthy"]) for w in workers["workers"]} == {
        ("prefill", stack.P1.url, True), ("decode", stack.D.url, True)}


# -- splitserve top in a terminal ------------------------------------------------------------------------


def test_top_in_tmux_shows_the_stalled_request_late(stack):
    # a tmux server of our own (its own socket, no configuration file): nobody else's sessions or sizes
    tmux = [need("tmux"), "-L", f"splitserve-test-{os.getpid()}", "-f", "/dev/null"]
    session = "top"
    cmd = (f"cd {REPO} && env -u COLUMNS -u LINES PYTHONPATH={REPO} {sys.executable} -m splitserve.cli top "
           f"--router {stack.R.url} --admin-api-key-file {stack.keys['admin']} "
           f"--router {stack.R2.url} --interval 0.3")
    subprocess.run([*tmux, "new-session", "-d", "-s", session, "-x", "230", "-y", "50", cmd], check=True)
    try:
        stack.stall("top-stall")

        def screen(colors: bool = False) -> str:
            args = [*tmux, "capture-pane", "-p", "-t", session] + (["-e"] if colors else [])
            return subprocess.run(args, capture_output=True, text=True, check=True).stdout

        text = wait_for("top shows the stalled request late", lambda: (
            lambda t: t if re.search(r"top-stall\s.*TRANSFERRING LATE", t) else None)(screen()), STALL_FLOOR_S + 15,
            0.2, on_fail=screen)
        for w in (stack.P1, stack.P2, stack.D):
            assert w.url in text, text
        assert "oldest live requests" in text and "prefill" in text and "decode" in text, text
        row = next(x for x in text.splitlines() if "top-stall" in x and "LATE" in x)
        assert row.startswith("│ " + stack.P2.url) or stack.P2.url in row, row
        rows = requests.get(stack.P2.url + "/debug/requests", timeout=5, headers=ADMIN).json()
        assert any(r["rid"] == "top-stall" and r["state"] == "TRANSFERRING" and r["late"] for r in rows), rows
        colored = next(x for x in screen(colors=True).splitlines() if "top-stall" in x and "LATE" in x)
        assert re.search(r"\x1b\[[0-9;]*31m", colored), repr(colored)  # late rows are red
        assert re.search(r"TRANSFERRING 1", text), text  # P2's queue by state
        assert re.search(r"1 live, 0 lost.*\n.*silent \d+\.\ds", text), text  # P2 and D: the peer, its silence
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


# -- Prometheus, the alert rules and the dashboard ----------------------------------------------------------


def test_prometheus_runs_the_rules_and_every_dashboard_panel_with_data(stack):
    need("prometheus")
    promtool = need("promtool")
    prom = stack.prometheus
    assert prom is not None, "prometheus was not started"
    check = subprocess.run([promtool, "check", "rules", str(DEPLOY / "alerts.yml")], capture_output=True, text=True)
    assert check.returncode == 0 and "SUCCESS" in check.stdout + check.stderr, check.stdout + check.stderr
    rules = yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"][0]["rules"]
    names = {r["alert"] for r in rules}
    assert {"SplitserveRequestLate", "SplitservePeerLost", "SplitservePagesQuarantinedTooLong", "SplitserveKVUsageHigh",
            "SplitserveWorkerFailureRateHigh", "SplitserveWorkerOutOfRotation"} <= names

    # the late-request alert fired for a stalled transfer (one of the earlier tests', or one of ours)
    firing = 'ALERTS{alertname="SplitserveRequestLate",alertstate="firing",role="prefill",state="TRANSFERRING"}'
    if not prom.query_range(firing, stack.started):
        stack.stall("prometheus-stall")
        wait_for("the late alert firing", lambda: prom.query_range(firing, stack.started), STALL_FLOOR_S + 20, 0.5,
                 on_fail=prom.output)
    r = requests.get(prom.url + "/api/v1/rules", timeout=10).json()
    health = {rule["name"]: rule.get("health") for g in r["data"]["groups"] for rule in g["rules"]}
    assert set(health) == names and all(h == "ok" for h in health.values()), health

    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    assert len(dashboard["panels"]) >= 15
    empty = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            result = prom.query_range(target["expr"], stack.started)
            values = [float(v) for series in result for _, v in series["values"]]
            if not any(math.isfinite(v) for v in values):
                empty.append((panel["title"], target["expr"]))
    assert not empty, f"panels without data: {empty}"


def test_router_token_times_read_sse_bytes_cut_anywhere():
    """The router's TTFT/ITL come from the events with generated tokens it passes on: the chat
    stream's role-only opening chunk, a usage chunk, an error and [DONE] are not tokens."""
    from splitserve.router.metrics import TokenTimes

    stream = (b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n'
              b'data: {"choices": [{"delta": {"content": "Hel"}}]}\n\n'
              b'data: {"choices": [{"delta": {"content": "lo"}}]}\n\n'
              b'data: {"choices": [], "usage": {"completion_tokens": 2}}\n\ndata: [DONE]\n\n')
    for cut in range(1, len(stream)):
        times = TokenTimes(started=10.0)
        times.feed(stream[:cut], now=10.5)
        times.feed(stream[cut:], now=10.75)
        first_in_head = b'"Hel"}}]}\n' in stream[:cut]
        both_in_head = b'"lo"}}]}\n' in stream[:cut]
        assert times.ttft == (0.5 if first_in_head else 0.75)
        assert times.gaps == ([0.0] if both_in_head or not first_in_head else [0.25])
    gen = TokenTimes(started=0.0)
    gen.feed(b'data: {"text": "a", "output_ids": [5]}\n\ndata: {"error": {"message": "x"}}\n\n', now=1.0)
    assert gen.ttft == 1.0 and gen.gaps == []


def test_the_routers_quick_look_at_our_own_events_agrees_with_parsing_them():
    """Most events skip ``json.loads`` (``_FIRST_CHOICE``: the chunks our workers write); every
    chunk the protocol builds is classified as parsing it would, empty and escaped texts, logprobs
    and tool-call deltas included."""
    from splitserve.router import metrics as router_metrics
    from splitserve.server import openai_protocol as proto

    def parsed(data: bytes) -> bool:
        event = json.loads(data)
        choice = (event.get("choices") or [{}])[0]
        delta = choice.get("delta")
        return bool(delta.get("content")) if isinstance(delta, dict) else bool(choice.get("text"))

    chunks = []
    for text in ("", "a", '"', "\\", "\n", "é", '"choices":[{"index":0,"text":""'):
        for lp in (None, {"tokens": ["x"], "token_logprobs": [-1.0], "top_logprobs": [{"text": -0.5}]}):
            chunks.append(proto.completion_chunk("r1", 'a "model"', 1, text, None, lp, index=2))
        for delta in ({"content": text}, {"role": "assistant", "content": text}):
            chunks.append(proto.chat_chunk("r1", "m", 1, delta, None, {"content": [{"token": text}]}))
    chunks += [proto.chat_chunk("r1", "m", 1, delta, "stop") for delta in ({}, {"content": None},
                                                                          {"tool_calls": [{"index": 0}]})]
    quick = 0
    for chunk in chunks:
        data = json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode()
        assert router_metrics._carries_tokens(data) == parsed(data), data
        quick += router_metrics._FIRST_CHOICE.search(data) is not None
    assert quick >= len(chunks) - 2, quick  # all but {"content": null} and a tool call's delta


def test_a_batch_histogram_exposes_what_prometheus_clients_histogram_does():
    """The ITL histograms take a request's gaps at once (``BatchHistogram``); a scrape reads the
    same samples as ``prometheus_client``'s histogram fed the same values one by one, values on a
    bucket's bound included (a bucket holds values up to and with its bound)."""
    from splitserve.metrics import Registry

    values = [0.0005, 0.001, 0.0011, 0.01, 0.05, 0.05, 0.7, 1.0, 3.0, 12.0] * 3
    one, batch = Registry(), Registry()
    h = one.histogram("t_seconds", "gaps", ["role", "endpoint"], buckets=(0.001, 0.01, 0.05, 1.0, 5.0))
    b = batch.batch_histogram("t_seconds", "gaps", ["role", "endpoint"], buckets=(0.001, 0.01, 0.05, 1.0, 5.0))
    for v in values:
        h.labels(role="decode", endpoint="chat").observe(v)
    b.observe_many(values[:7], "decode", "chat")
    b.observe_many(values[7:], "decode", "chat")
    b.observe_many([], "decode", "chat")
    assert batch.exposition() == one.exposition()
    with pytest.raises(ValueError):
        b.observe_many([1.0], "decode")


def test_timeline_book_keeps_live_ones_and_a_bounded_number_of_ended_ones():
    from splitserve.timeline import TimelineBook

    book = TimelineBook("prefill", clock=lambda: 100.0, capacity=3)
    live = book.start("live", 7, "BOOTSTRAPPING", 0.0)
    for i in range(5):
        tl = book.start(f"r{i}", 10 + i, "QUEUED", float(i))
        tl.enter("PREFILLING", i + 0.25, "RoomReady")
        tl.enter("PREFILLING", i + 0.3, "again")  # the state it is in already: not a step
        tl.end("FINISHED(transferred)", i + 0.5, "KVSent")
        book.ended(tl)
    assert [book.get(f"r{i}") for i in range(2)] == [None, None] and book.get_room(10) is None  # the oldest go
    assert [book.get(f"r{i}").rid for i in range(2, 5)] == ["r2", "r3", "r4"] and book.get_room(14).rid == "r4"
    assert book.get("live") is live and book.get_room(7) is live  # live ones are never forgotten
    assert book.short("r4") == "QUEUED 0.250s > PREFILLING 0.250s > FINISHED(transferred) total 0.500s"
    d = book.get("r4").to_dict(now=50.0, wall=book.wall)
    assert [(s["state"], s["at_s"], s["duration_s"], s["event"]) for s in d["steps"]] == [
        ("QUEUED", 0.0, 0.25, "arrived"), ("PREFILLING", 0.25, 0.25, "RoomReady"),
        ("FINISHED(transferred)", 0.5, 0.0, "KVSent")]
    assert not d["live"] and live.to_dict(now=3.0, wall=book.wall)["steps"][0]["duration_s"] == 3.0
    again = book.start("r2", 20, "QUEUED", 6.0)  # a new request with an old id: the old one's eviction keeps it
    for i in range(3):
        tl = book.start(f"s{i}", 30 + i, "QUEUED", 7.0)
        tl.end("FAILED(x)", 7.5, "deadline")
        book.ended(tl)
    assert book.get("r2") is again and book.get_room(12) is None and book.get("r4") is None
