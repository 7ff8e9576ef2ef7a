"""``splitserve launch`` keeps its workers alive: a worker that exits or is killed is started again
after a growing delay, in the role its role file names, until its restart budget is used up;
SIGTERM while a restart waits stops everything and starts nothing.

The policy and the role file are checked alone (the time passed in); the supervisor with plain
``python -c`` children that stand in for workers (each life appended to a file, so the test counts
lives, never times them); and, under ``make check-long``, real workers of the tiny model behind the
router: a SIGKILLed decode comes back on its port under a new incarnation and serves again, and a
prefill switched to decode and killed at once comes back a decode.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace

import pytest
import requests

from conftest import CLUSTER_SECRET, REPO, free_port
from helpers.supervisor_runs import SupervisorRun, started_runs, wait_all_gone
from splitserve.launch import ChildSpec, LaunchConfig, RestartPolicy, build_specs
from splitserve.launch.restart import Restarts, role_to_restart
from splitserve.server.role_file import MAX_BYTES, read_role, write_role

SCRIPT = """
import json, sys
from splitserve.launch import ChildSpec, RestartPolicy, Supervisor
specs = [ChildSpec(**{**s, "argv": tuple(s["argv"])}) for s in json.loads(sys.argv[1])]
policy = RestartPolicy(**json.loads(sys.argv[2]))
sys.exit(Supervisor(specs, ready_timeout_s=float(sys.argv[3]), stop_timeout_s=20.0, restart=policy).run())
"""

FAST = RestartPolicy(budget=5, window_s=600.0, first_delay_s=0.01, max_delay_s=0.05)


# -- the policy, alone ---------------------------------------------------------------------------------


def test_the_delay_doubles_up_to_its_cap_and_the_budget_counts_one_window():
    restarts = Restarts(RestartPolicy(budget=3, window_s=100.0, first_delay_s=0.5, max_delay_s=1.5))
    assert [restarts.after_exit("w", t) for t in (0.0, 1.0, 2.0)] == [(1, 0.5), (2, 1.0), (3, 1.5)]
    assert restarts.after_exit("w", 3.0) is None and restarts.in_window("w") == 3  # used up: give up
    assert restarts.after_exit("other", 3.0) == (1, 0.5)  # each worker its own budget
    assert restarts.after_exit("w", 100.5) == (3, 1.5)  # the first restart left the window
    assert restarts.after_exit("w", 250.0) == (1, 0.5)  # a quiet window: the delay starts over
    assert Restarts(RestartPolicy(budget=0)).after_exit("w", 0.0) is None
    assert RestartPolicy(first_delay_s=1.0, max_delay_s=1e9).delay_s(10_000) == 1e9  # no overflow on the way


@pytest.mark.parametrize("policy, flag", [
    (RestartPolicy(budget=-1), "--restart-budget"),
    (RestartPolicy(window_s=float("nan")), "--restart-window-s"),
    (RestartPolicy(first_delay_s=-1.0), "--restart-delay-s"),
    (RestartPolicy(max_delay_s=float("inf")), "--restart-max-delay-s"),
])
def test_a_policy_out_of_range_is_refused_naming_its_option(policy, flag):
    with pytest.raises(ValueError, match=re.escape(flag)):
        policy.check()


def test_launch_refuses_a_bad_restart_option_with_exit_2():
    out = subprocess.run([sys.executable, "-m", "splitserve.cli", "launch", "--restart-budget", "-2"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--restart-budget" in out.stderr, out.stderr


# -- the role file ---------------------------------------------------------------------------------------


def test_the_role_file_is_written_whole(tmp_path):
    path = tmp_path / "w.role"
    write_role(str(path), "decode")
    write_role(str(path), "prefill")
    assert path.read_text() == "prefill\n" and os.listdir(tmp_path) == ["w.role"]  # no temporary file left
    with pytest.raises(OSError):
        write_role(str(tmp_path / "missing" / "w.role"), "decode")


def test_a_role_file_is_read_as_untrusted_input(tmp_path):
    good = tmp_path / "good"
    good.write_text("  decode\n")
    assert read_role(str(good)) == ("decode", "")
    cases = {"missing": None, "garbage": b"\x00\xffprefill", "colocated": b"colocated\n",
             "long": b"prefill" + b" " * MAX_BYTES, "empty": b""}
    for name, data in cases.items():
        if data is not None:
            (tmp_path / name).write_bytes(data)
    os.mkfifo(tmp_path / "fifo")  # opened blocking, it would hang the reader until a writer came
    (tmp_path / "link").symlink_to(good)
    (tmp_path / "folder").mkdir()
    for name in [*cases, "fifo", "link", "folder"]:
        role, why = read_role(str(tmp_path / name))
        assert role is None and why, (name, why)
    assert "more than" in read_role(str(tmp_path / "long"))[1]


def test_a_restart_takes_the_role_of_the_file_or_else_the_one_it_was_launched_in(tmp_path):
    argv = ("py", "-m", "splitserve.cli", "serve", "--role", "decode", "--port", "1")
    warnings: list[str] = []
    (tmp_path / "r").write_text("prefill\n")
    assert role_to_restart(argv, str(tmp_path / "r"), warnings.append) == (
        argv[:5] + ("prefill",) + argv[6:], "prefill")
    (tmp_path / "r").write_text("router\n")
    assert role_to_restart(argv, str(tmp_path / "r"), warnings.append) == (argv, "decode")
    assert len(warnings) == 1 and "'router'" in warnings[0] and "as a decode worker" in warnings[0], warnings
    assert role_to_restart(argv, None, warnings.append) == (argv, "decode") and len(warnings) == 1


class FakeRole:
    deadlines = None
    rooms = ()

    def holds_nothing(self) -> bool:
        return True


class FakeEngine:
    """What a role switch touches of the engine; the role replaced at once."""

    ready, draining = True, False

    def __init__(self):
        self.role = FakeRole()

    def begin_drain(self) -> None:
        self.draining = True

    def end_drain(self) -> None:
        self.draining = False

    def replace_role(self, role, goodbye) -> int:
        self.role = role
        return 0


@pytest.mark.parametrize("writable", [True, False])
def test_a_switch_writes_the_new_role_before_it_is_answered(tmp_path, caplog, writable):
    """The file says the new role once ``switch`` returns (what ``POST /role`` answers after); a
    file that cannot be written is logged and the switch stands."""
    from splitserve.config import ServerConfig
    from splitserve.metrics import Registry
    from splitserve.server.role_switch import switch
    from splitserve.server.state import WorkerState

    path = tmp_path / ("w.role" if writable else "gone/w.role")
    config = ServerConfig(role="decode", discovery_grace_s=0.0, drain_timeout_s=5.0, role_file=str(path),
                          allowed_prefill="127.0.0.1:1")
    state = WorkerState(FakeEngine(), config, Registry(), incarnation="i-old")
    with caplog.at_level(logging.ERROR, logger="splitserve.server.role_file"):
        asyncio.run(switch(state, replace(config, role="prefill"), make_role=lambda *_: FakeRole()))
    assert state.config.role == "prefill" and state.incarnation != "i-old"
    if writable:
        assert path.read_text() == "prefill\n" and not caplog.records
    else:
        assert any("cannot write --role-file" in r.getMessage() for r in caplog.records), caplog.records


def test_a_role_file_that_cannot_be_written_at_start_is_logged_and_the_worker_serves_on(tmp_path, caplog):
    """A directory (or a missing folder) where the role file goes: the worker logs it and serves
    in its role, rather than exiting into a restart that would fail the same way."""
    from splitserve.server.role_file import keep_role

    (tmp_path / "w.role").mkdir()
    with caplog.at_level(logging.ERROR, logger="splitserve.server.role_file"):
        assert keep_role(str(tmp_path / "w.role"), "decode", "start") is False
        assert keep_role(str(tmp_path / "gone" / "w.role"), "decode", "start") is False
    assert sum("start: cannot write --role-file" in r.getMessage() for r in caplog.records) == 2
    assert keep_role(str(tmp_path / "x.role"), "prefill", "start") and (tmp_path / "x.role").read_text() == "prefill\n"
    assert not list(tmp_path.glob(".w.role.*"))  # no temporary file left beside it


# -- the supervisor, with stand-ins for workers ------------------------------------------------------------

STAND_IN = """
import os, signal, sys, time
args = sys.argv[1:]
role, lives, plan = args[args.index("--role") + 1], args[args.index("--lives") + 1], args[args.index("--plan") + 1]
role_file = args[args.index("--role-file") + 1] if "--role-file" in args else None
with open(lives, "a") as f:
    f.write(role + "\\n")
life = len(open(lives).read().split())
print(f"life {life} as {role}", flush=True)
step = plan.split(",")[life - 1] if life <= len(plan.split(",")) else "live"
if step.startswith("write:"):  # a role switch, then a kill at once
    open(role_file, "w").write(step[6:] + "\\n")
    os.kill(os.getpid(), signal.SIGKILL)
if step.startswith("garbage"):
    open(role_file, "wb").write(b"\\x00\\xff junk")
    sys.exit(3)
if step == "exit":
    sys.exit(3)
time.sleep(300)
"""


def stand_in(name: str, tmp_path, plan: str, role: str = "decode") -> ChildSpec:
    """A worker's stand-in that lives its lives as ``plan`` says (comma-separated, one step a life:
    ``write:ROLE`` writes ROLE to its role file and SIGKILLs itself, ``garbage`` writes junk there and
    exits 3, ``exit`` exits 3, ``live`` sleeps); each life appends its role to ``lives(name)``."""
    role_file = str(tmp_path / f"{name}.role")
    return ChildSpec(name, (sys.executable, "-c", STAND_IN, "--role", role, "--role-file", role_file, "--lives",
                            str(tmp_path / f"{name}.lives"), "--plan", plan), restart=True, role_file=role_file)


def lives(tmp_path, name: str) -> list[str]:
    path = tmp_path / f"{name}.lives"
    return path.read_text().split() if path.exists() else []


class Run(SupervisorRun):
    """``SCRIPT`` in its own process (it installs signal handlers, and the test signals it)."""

    def __init__(self, specs: list[ChildSpec], policy: RestartPolicy, ready_timeout_s: float = 30.0):
        super().__init__(SCRIPT, [json.dumps([asdict(s) for s in specs]), json.dumps(asdict(policy)),
                                  str(ready_timeout_s)], "launch-restart-")


@pytest.fixture
def run():
    yield from started_runs(Run)


SLEEPER = ChildSpec("router", (sys.executable, "-c", "import time; time.sleep(300)"))


def test_a_worker_killed_or_exiting_comes_back_in_the_role_it_last_wrote(run, tmp_path):
    """Life 1 writes ``prefill`` (a switch) and is SIGKILLed at once: life 2 is a prefill. Life 2
    writes junk and exits 3: life 3 is a decode again (the launch role), with a warning. Each
    restart says which, why, the attempt and the delay in one line."""
    r = run([SLEEPER, stand_in("decode-0", tmp_path, "write:prefill,garbage")], FAST)
    wait_until("a third life", lambda: len(lives(tmp_path, "decode-0")) == 3, 60)
    assert lives(tmp_path, "decode-0") == ["decode", "prefill", "decode"]
    out = r.out()
    assert re.search(r"decode-0 \(pid \d+\) was killed by signal SIGKILL: restarting it as a prefill worker in "
                     r"0\.01 s \(restart 1, at most 5 in 600 s\)", out), out
    assert re.search(r"warning: role file \S+decode-0\.role: it holds .*; restarting it as a decode worker", out), out
    assert re.search(r"decode-0 \(pid \d+\) exited with code 3: restarting it as a decode worker in 0\.02 s "
                     r"\(restart 2,", out), out
    r.proc.send_signal(signal.SIGTERM)
    assert r.wait(60) == 0, r.out()
    assert lives(tmp_path, "decode-0") == ["decode", "prefill", "decode"]  # nothing started during the stop
    wait_all_gone(r.pids(), 10.0)


@pytest.mark.parametrize("budget", [2, 0])
def test_a_worker_that_used_up_its_budget_stops_everything_naming_it(run, tmp_path, budget):
    """Budget 2: three lives, then launch gives up, names it and exits 1. Budget 0: restarts are
    off, its first exit stops everything."""
    r = run([SLEEPER, stand_in("decode-0", tmp_path, "exit,exit,exit,exit")], replace(FAST, budget=budget))
    assert r.wait(60) == 1, r.out()
    assert lives(tmp_path, "decode-0") == ["decode"] * (budget + 1)
    out = r.out()
    if budget:
        assert re.search(r"decode-0 \(pid \d+\) exited with code 3; it was restarted 2 times in the last 600 s, the "
                         r"most --restart-budget allows: giving up", out), out
    else:
        assert "restarting" not in out and re.search(r"decode-0 \(pid \d+\) exited with code 3; its last lines", out)
    assert "stopping the other processes" in out
    wait_all_gone(r.pids(), 10.0)


def test_sigterm_while_a_restart_waits_stops_everything_and_starts_nothing(run, tmp_path):
    r = run([SLEEPER, stand_in("decode-0", tmp_path, "exit")], replace(FAST, first_delay_s=600.0, max_delay_s=600.0))
    r.wait_for_line(r"decode-0 \(pid \d+\) exited with code 3: restarting it as a decode worker in 600 s", 60)
    r.proc.send_signal(signal.SIGTERM)
    assert r.wait(60) == 0, r.out()
    assert "received SIGTERM: stopping every process (a restart of decode-0 is not done)" in r.out(), r.out()
    assert lives(tmp_path, "decode-0") == ["decode"]
    wait_all_gone(r.pids(), 10.0)


def test_a_child_not_marked_for_restart_still_stops_everything(run, tmp_path):
    """The router (or etcd) is not restarted: its exit ends the run, as before."""
    dies = ChildSpec("router", (sys.executable, "-c", "import sys; sys.exit(4)"))
    r = run([dies, stand_in("decode-0", tmp_path, "live")], FAST)
    assert r.wait(60) == 1, r.out()
    assert re.search(r"router \(pid \d+\) exited with code 4; its last lines", r.out()), r.out()
    wait_all_gone(r.pids(), 10.0)


# -- real workers --------------------------------------------------------------------------------------------


def worker_health(spec: ChildSpec) -> dict:
    try:
        r = requests.get(spec.url + "/health", timeout=5)
        return r.json() if r.status_code == 200 else {}
    except (requests.RequestException, ValueError):
        return {}


def wait_until(what: str, check, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"never: {what}")


@pytest.mark.long
def test_real_workers_come_back_on_their_ports_and_in_their_last_role(run, tmp_path):
    """1 prefill + 1 decode of the tiny model behind the router, as launch builds them. The decode
    SIGKILLed comes back on its port under a new incarnation, and the router serves through it
    again (it is the only decode). The prefill switched to decode (``POST /role``) and SIGKILLed as
    soon as the switch is answered comes back a decode."""
    specs = build_specs(LaunchConfig(port=free_port(), split_cpus=False, router_args="--health-interval-s 0.5"),
                        secret_file=CLUSTER_SECRET, role_dir=str(tmp_path))
    prefill, decode, router = specs
    r = run(specs, replace(FAST, first_delay_s=0.1), ready_timeout_s=240)
    r.wait_for_line("processes are up", 300)
    ask = {"prompt": "Hello", "max_tokens": 4}
    assert requests.post(router.url + "/v1/completions", json=ask, timeout=120).status_code == 200
    before = worker_health(decode)["incarnation"]
    os.kill(int(re.search(r"^  decode-0\s+pid (\d+)", r.out(), re.M)[1]), signal.SIGKILL)
    r.wait_for_line(r"decode-0 \(pid \d+\) was killed by signal SIGKILL: restarting it as a decode worker", 60)
    r.wait_for_line(r"decode-0 started again: pid \d+", 60)
    after = wait_until("decode-0 answers again", lambda: worker_health(decode).get("incarnation"))
    assert after != before

    def router_took_it_back() -> bool:
        workers = requests.get(router.url + "/workers", timeout=10).json()["workers"]
        return any(w["url"] == decode.url and w["state"] == "healthy" and w["incarnation"] == after for w in workers)

    wait_until("the router takes decode-0 back", router_took_it_back)
    answers = [requests.post(router.url + "/v1/completions", json=ask, timeout=120) for _ in range(3)]
    assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]

    operator = {"Authorization": f"Bearer {prefill.env['SPLITSERVE_ADMIN_API_KEY']}"}
    switched = requests.post(prefill.url + "/role", json={"role": "decode", "epoch": worker_health(prefill)["epoch"]},
                             headers=operator, timeout=120)
    assert switched.status_code == 200 and switched.json()["switched"], switched.text
    os.kill(int(re.search(r"^  prefill-0\s+pid (\d+)", r.out(), re.M)[1]), signal.SIGKILL)
    r.wait_for_line(r"prefill-0 \(pid \d+\) was killed by signal SIGKILL: restarting it as a decode worker", 60)
    back = wait_until("prefill-0 answers again", lambda: worker_health(prefill).get("role"))
    assert back == "decode", worker_health(prefill)
    r.proc.send_signal(signal.SIGTERM)
    assert r.wait(120) == 0, r.out()
    wait_all_gone(r.pids(), 10.0)
