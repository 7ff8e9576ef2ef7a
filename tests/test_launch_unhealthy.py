"""``splitserve launch`` gives up on a worker that runs but is not healthy: one started again that
does not answer 200 on ``/health`` within ``--ready-timeout-s``, or one that was healthy and fails
``--worker-unhealthy-checks`` looks in a row, is named in one line with what ``/health`` last said,
stopped (SIGTERM, then SIGKILL) and counted as an exit under the restart budget. A worker that is
slow now and then, or says it drains, is left alone.

The watch alone (:class:`HealthWatch`, times passed in); the supervisor in this process with a clock
the test moves and a probe that answers as the test says (sleeping children stand in for workers);
and the supervisor in a process of its own with small HTTP servers for workers, which fail as
their plan says (each life appended to a file, so the test counts lives, never times them).
"""

from __future__ import annotations

import http.server
import io
import json
import os
import re
import signal
import sys
import threading
import time
import urllib.parse
from dataclasses import asdict

import pytest

from conftest import free_port
from helpers.supervisor_runs import SupervisorRun, started_runs, wait_all_gone
from splitserve.launch import ChildSpec, HealthPolicy, LaunchConfig, RestartPolicy, Supervisor
from splitserve.launch.health_probe import Answer, probe
from splitserve.launch.health_watch import HealthWatch

OK = Answer()
STALLED = Answer('answered 503 ("stalled")', "stalled")
DRAINING = Answer('answered 503 ("draining")', "draining")
DEAF = Answer("no answer (connection refused)")


# -- the watch, alone -----------------------------------------------------------------------------------


def test_a_healthy_worker_is_wedged_only_after_the_count_of_failed_looks_in_a_row():
    watch = HealthWatch(HealthPolicy(interval_s=10.0, unhealthy_checks=3), start_timeout_s=300.0)
    watch.started("w", 0.0, healthy=True)
    assert not watch.due("w", 9.9) and watch.due("w", 10.0)
    verdicts = [watch.record("w", t, a) for t, a in enumerate([STALLED, STALLED, OK, STALLED, STALLED, DRAINING,
                                                                DRAINING, DEAF])]
    assert verdicts[:7] == [None] * 7  # two, then one success starts over; draining counts for nothing
    assert verdicts[7] == "failed 3 health checks in a row, 4 s from the first to the last " \
                          "(--worker-unhealthy-checks 3, every 10 s)"
    assert watch.due("w", 17.0) and not watch.due("w", 16.9)  # the next look: one interval after the last one asked


def test_a_started_worker_has_the_start_timeout_and_0_checks_never_wedge():
    watch = HealthWatch(HealthPolicy(interval_s=10.0, unhealthy_checks=0), start_timeout_s=300.0)
    watch.started("w", 100.0)
    assert watch.due("w", 100.0)  # looked at from its start
    assert watch.record("w", 399.0, DEAF) is None
    assert watch.record("w", 400.0, DEAF) == "is not healthy 300 s after it was started again (--ready-timeout-s 300)"
    watch.started("w", 500.0)
    assert watch.record("w", 799.0, OK) is None
    assert all(watch.record("w", 800.0 + i, STALLED) is None for i in range(100))  # 0: never wedged
    assert HealthWatch(HealthPolicy(start_timeout_s=5.0), 300.0).start_timeout_s == 5.0


@pytest.mark.parametrize("policy, flag", [
    (HealthPolicy(interval_s=0.0), "--worker-health-interval-s"),
    (HealthPolicy(interval_s=float("nan")), "--worker-health-interval-s"),
    (HealthPolicy(unhealthy_checks=-1), "--worker-unhealthy-checks"),
])
def test_a_health_option_out_of_range_is_refused_naming_it(policy, flag):
    with pytest.raises(ValueError, match=re.escape(flag)):
        policy.check()
    with pytest.raises(ValueError, match=re.escape(flag)):
        LaunchConfig(worker_health_interval_s=policy.interval_s, worker_unhealthy_checks=policy.unhealthy_checks
                     ).health_policy()


class Answers(http.server.BaseHTTPRequestHandler):
    """``/CODE/BODY``: answers CODE with BODY (URL-quoted)."""

    def do_GET(self):
        _, code, body = self.path.split("/", 2)
        data = urllib.parse.unquote(body).encode()
        self.send_response(int(code))
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_the_probe_names_what_a_worker_says_and_reads_it_as_untrusted():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"

    def look(code: int, body, worker_id="w.1") -> Answer:
        text = body if isinstance(body, str) else json.dumps(body)
        return probe(f"{base}/{code}/{urllib.parse.quote(text, safe='')}", worker_id)

    try:
        assert look(200, {"status": "ok", "id": "w.1"}) == Answer(None, "ok")
        assert look(503, {"status": "draining", "id": "w.1"}).draining
        assert look(503, {"status": "stalled"}) == Answer('answered 503 ("stalled")', "stalled")
        for odd in ({"status": "Evil\nline"}, {"status": "x" * 100}, {"status": ["draining"]}, "[1, 2]", "{", "\u00ff"):
            assert look(503, odd) == Answer("answered 503"), odd  # a status only when it is a short plain word
        assert look(200, {"id": "w.2"}).why == "another process answers there, as 'w.2', not 'w.1'"
        assert look(200, "not json", None) == Answer()
        assert look(204, "", None).why == "answered 204"
    finally:
        server.shutdown()
        server.server_close()
    assert probe(f"http://127.0.0.1:{free_port()}/health", "w.1").why.startswith("no answer (")  # nothing listens


# -- the supervisor, in this process, on the test's clock ---------------------------------------------------

SLEEPER = (sys.executable, "-c", "import time; time.sleep(300)")


class Scene:
    """The test's clock (each of the supervisor's sleeps is one second), and its probe: each life
    of each worker (a new pid) answers from its own list in turn, then ``after`` forever; every
    look is kept as (name, life, clock). ``stop_when_done``: SIGTERM to us (the supervisor's
    handler) once every planned answer was given."""

    def __init__(self, plans: dict[str, list[list[Answer]]], after: Answer = OK, stop_when_done: bool = False):
        self.now, self.plans, self.after, self.stop_when_done = 0.0, plans, after, stop_when_done
        self.looks: list[tuple[str, int, float]] = []
        self.pids: dict[str, list[int]] = {}
        self.supervisor = None

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += 1.0
        time.sleep(0.002)  # the looks' threads and the children's exits go on meanwhile

    def probe(self, url: str, worker_id, timeout_s: float) -> Answer:
        name = url.rsplit("/", 1)[1]
        pid = next(c.proc.pid for c in self.supervisor.children if c.spec.name == name)
        lives = self.pids.setdefault(name, [])
        lives += [pid] if pid not in lives else []
        life = lives.index(pid)
        plan = self.plans[name][life] if life < len(self.plans[name]) else []
        n = self.looks_of(name, life)
        self.looks.append((name, life, self.now))
        if self.stop_when_done and self.done():
            self.stop_when_done = False
            os.kill(os.getpid(), signal.SIGTERM)
        return plan[n] if n < len(plan) else self.after

    def done(self) -> bool:
        return all(len(self.pids.get(name, ())) >= len(plans)
                   and all(self.looks_of(name, life) >= len(plan) for life, plan in enumerate(plans))
                   for name, plans in self.plans.items())

    def run(self, policy: RestartPolicy, health: HealthPolicy, ready_timeout_s: float = 60.0) -> tuple[int, str]:
        specs = [ChildSpec("router", SLEEPER)] + [
            ChildSpec(name, SLEEPER, health_url=f"http://fake/{name}", worker_id=name, restart=True)
            for name in self.plans]
        out = io.StringIO()
        self.supervisor = Supervisor(specs, ready_timeout_s, stop_timeout_s=1e6, out=out, echo=None, restart=policy,
                                     clock=self.clock, sleep=self.sleep, health=health, probe=self.probe)
        code = self.supervisor.run()
        return code, out.getvalue()

    def looks_of(self, name: str, life: int) -> int:
        return sum(1 for n, lf, _ in self.looks if (n, lf) == (name, life))


NOW = RestartPolicy(budget=1, window_s=600.0, first_delay_s=0.0, max_delay_s=0.0)


def test_a_wedged_worker_is_restarted_and_one_never_healthy_after_that_uses_up_the_budget():
    """Life 1: healthy at start and twice after, then ``stalled`` for good: stopped at its third
    failed look in a row, and started again (restart 1 of 1). Life 2 never answers: stopped at the
    first look begun 60 s (the ready timeout) after its start; the budget is used up, launch gives
    up naming it and returns 1."""
    scene = Scene({"decode-0": [[OK, OK, OK], []]}, after=STALLED)
    scene.plans["decode-0"][1] = [DEAF] * 1000
    code, out = scene.run(NOW, HealthPolicy(interval_s=5.0, unhealthy_checks=3))
    assert code == 1, out
    assert scene.looks_of("decode-0", 0) == 3 + 3  # 1 while starting, 2 healthy after, then 3 failed
    first, second = scene.pids["decode-0"]
    assert re.search(rf"decode-0 \(pid {first}\) failed 3 health checks in a row, [\d.]+ s from the first to the last "
                     rf"\(--worker-unhealthy-checks 3, every 5 s\); http://fake/decode-0 last said: answered 503 "
                     rf"\(\"stalled\"\): stopping it \(SIGTERM, then SIGKILL after 1e\+06 s\)", out), out
    assert re.search(rf"decode-0 \(pid {first}\) was killed by signal SIGTERM after launch stopped it as unhealthy: "
                     r"restarting it in 0 s \(restart 1, at most 1 in 600 s\)", out), out
    waited = re.search(rf"decode-0 \(pid {second}\) is not healthy ([\d.]+) s after it was started again "
                       r"\(--ready-timeout-s 60\); http://fake/decode-0 last said: no answer \(connection refused\): "
                       r"stopping it", out)
    assert waited and float(waited[1]) >= 60, out
    assert 2 <= scene.looks_of("decode-0", 1) <= 13  # one every 5 s at most, until one begun 60 s after its start
    assert re.search(rf"decode-0 \(pid {second}\) was killed by signal SIGTERM after launch stopped it as unhealthy; "
                     r"it was restarted 1 times in the last 600 s, the most --restart-budget allows: giving up",
                     out), out
    assert "router" not in {n for n, _, _ in scene.looks}  # only the workers are watched
    wait_all_gone([first, second], 10.0)


def test_a_slow_or_draining_worker_and_one_healthy_in_time_are_left_alone():
    """Fewer failed looks in a row than the count, with any number of ``draining`` ones among them,
    never stop a worker; a restarted worker that answers 200 within the ready timeout is healthy
    from then on. Run until every planned look was answered, then SIGTERM: exit 0."""
    slow = [OK] + [STALLED, DEAF, OK] * 5 + [STALLED] + [DRAINING] * 20 + [OK, DEAF, DEAF, OK]
    scene = Scene({"prefill-0": [slow], "decode-0": [[OK, OK], [DEAF] * 6 + [OK] + [STALLED, OK] * 3]},
                  stop_when_done=True)
    scene.plans["decode-0"][0].append(Answer(None, "exit"))  # its third look: the test kills it
    probe_of = scene.probe

    def probe_and_kill(url, worker_id, timeout_s):
        answer = probe_of(url, worker_id, timeout_s)
        if answer.status == "exit":
            os.kill(scene.pids["decode-0"][0], signal.SIGKILL)
        return answer

    scene.probe = probe_and_kill
    code, out = scene.run(RestartPolicy(budget=3, first_delay_s=0.0, max_delay_s=0.0),
                          HealthPolicy(interval_s=5.0, unhealthy_checks=3), ready_timeout_s=1000.0)
    assert code == 0, out
    assert "stopping it" not in out and "unhealthy" not in out, out
    assert len(scene.pids["prefill-0"]) == 1 and len(scene.pids["decode-0"]) == 2, scene.pids
    assert scene.looks_of("prefill-0", 0) >= len(slow) and scene.looks_of("decode-0", 1) >= 7 + 6
    assert re.search(r"decode-0 \(pid \d+\) was killed by signal SIGKILL: restarting it", out), out


# -- the supervisor, in a process of its own, with HTTP servers for workers ---------------------------------

SCRIPT = """
import json, sys
from splitserve.launch import ChildSpec, HealthPolicy, RestartPolicy, Supervisor
specs = [ChildSpec(**{**s, "argv": tuple(s["argv"])}) for s in json.loads(sys.argv[1])]
restart, health = RestartPolicy(**json.loads(sys.argv[2])), HealthPolicy(**json.loads(sys.argv[3]))
sys.exit(Supervisor(specs, ready_timeout_s=120.0, stop_timeout_s=float(sys.argv[4]), restart=restart,
                    health=health).run())
"""

WORKER = """
import http.server, json, signal, sys, time
port, worker_id, lives, plan = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4].split(",")
with open(lives, "a") as f:
    f.write("life\\n")
life = sum(1 for line in open(lives) if line == "life\\n")
step = plan[life - 1] if life <= len(plan) else "ok"
print(f"life {life}: {step}", flush=True)


def on_term(*_):
    with open(lives, "a") as f:
        f.write("term\\n")
    if step != "stubborn":
        sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
if step == "deaf":  # never listens
    while True:
        time.sleep(1)
answered = []


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        answered.append(1)
        ok = step == "ok" or (step == "wedge" and len(answered) <= 2)
        status = "ok" if ok else ("stalled" if step == "wedge" else "loading")
        body = json.dumps({"status": status, "id": worker_id}).encode()
        self.send_response(200 if ok else 503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def fake_worker(name: str, tmp_path, plan: str) -> ChildSpec:
    """A worker's stand-in serving ``/health`` on a port of its own; each life a step of ``plan``
    (comma-separated): ``wedge`` answers 200 twice then 503 ``stalled``; ``deaf`` never listens;
    ``stubborn`` answers 503 ``loading`` and ignores SIGTERM; ``ok``. Each life appends ``life`` to
    its file, and ``term`` when it gets SIGTERM."""
    port = free_port()
    return ChildSpec(name, (sys.executable, "-c", WORKER, str(port), f"{name}.run", str(tmp_path / f"{name}.lives"),
                            plan, "--role", "decode"), url=f"http://127.0.0.1:{port}",
                     health_url=f"http://127.0.0.1:{port}/health", worker_id=f"{name}.run", restart=True)


class Run(SupervisorRun):
    def __init__(self, specs: list[ChildSpec], restart: RestartPolicy, health: HealthPolicy, stop_timeout_s: float):
        super().__init__(SCRIPT, [json.dumps([asdict(s) for s in specs]), json.dumps(asdict(restart)),
                                  json.dumps(asdict(health)), str(stop_timeout_s)], "launch-unhealthy-")


@pytest.fixture
def run():
    yield from started_runs(Run)


def test_real_processes_wedged_deaf_and_stubborn_are_stopped_restarted_and_give_up(run, tmp_path):
    """Life 1 wedges after two 200s: stopped after 3 failed looks (SIGTERM), restarted. Life 2
    never listens: stopped once the start timeout passed, restarted. Life 3 answers 503 ``loading``
    and ignores SIGTERM: SIGKILLed after the stop timeout, and the budget (2) is used up: exit 1."""
    worker = fake_worker("decode-0", tmp_path, "wedge,deaf,stubborn")
    r = run([ChildSpec("router", SLEEPER), worker], RestartPolicy(budget=2, first_delay_s=0.01, max_delay_s=0.01),
            HealthPolicy(interval_s=0.1, unhealthy_checks=3, start_timeout_s=1.0), stop_timeout_s=0.5)
    assert r.wait(120) == 1, r.out() + r.err()
    out = r.out()
    assert (tmp_path / "decode-0.lives").read_text().split() == ["life", "term", "life", "term", "life", "term"], out
    said = re.findall(r"decode-0 \(pid \d+\) (.*); http://127.0.0.1:\d+/health last said: (.*): stopping it", out)
    assert len(said) == 3, out
    assert said[0][0].startswith("failed 3 health checks in a row") and said[0][1] == 'answered 503 ("stalled")', said
    for verdict, _ in said[1:]:
        assert re.fullmatch(r"is not healthy [\d.]+ s after it was started again \(--ready-timeout-s 1\)", verdict), \
            said
    assert said[1][1].startswith("no answer (") and said[2][1] == 'answered 503 ("loading")', said
    assert len(re.findall(r"after launch stopped it as unhealthy: restarting it as a decode worker", out)) == 2, out
    assert re.search(r"decode-0 \(pid \d+\) still running 0.5 s after SIGTERM: SIGKILL", out), out
    assert re.search(r"decode-0 \(pid \d+\) was killed by signal SIGKILL after launch stopped it as unhealthy; it was "
                     r"restarted 2 times in the last 600 s, the most --restart-budget allows: giving up", out), out
    wait_all_gone(r.pids(), 10.0)
