"""``splitserve launch``: the supervisor with plain ``python -c`` children (death, SIGTERM, SIGKILL
after the grace period, readiness timeout, no orphans after a kill -9 of launch), the CPUs each
worker is given, and one run end to end through the real router and workers (which also checks
the CPUs and threads the launched workers really run with).

Every launch runs as its own process (it installs signal handlers, and the test signals it); the
specs reach it as JSON through ``LAUNCH_SCRIPT``, and the pids come back from its summary lines.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace

import pytest
import requests

from conftest import CLUSTER_SECRET, REPO, free_port
from helpers.supervisor_runs import SupervisorRun, running, started_runs, wait_all_gone
from splitserve.cpus import format_cpu_list, parse_cpu_list
from splitserve.launch import ChildSpec, LaunchConfig, build_specs

LAUNCH_SCRIPT = """
import json, sys
from splitserve.launch import ChildSpec, Supervisor
specs = [ChildSpec(**{**s, "argv": tuple(s["argv"])}) for s in json.loads(sys.argv[1])]
sys.exit(Supervisor(specs, ready_timeout_s=float(sys.argv[2]), stop_timeout_s=float(sys.argv[3])).run())
"""


def py(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


SLEEPER = py("import time; time.sleep(120)")


class Launch(SupervisorRun):
    def __init__(self, specs: list[ChildSpec], ready_timeout_s: float = 30.0, stop_timeout_s: float = 5.0):
        super().__init__(LAUNCH_SCRIPT, [json.dumps([asdict(s) for s in specs]), str(ready_timeout_s),
                                         str(stop_timeout_s)], "launch-")

    def pids(self) -> dict[str, int]:
        """Child name -> pid, from the summary."""
        return {m[1]: int(m[2]) for m in re.finditer(r"^  (\S+)\s+pid (\d+)", self.out(), re.M)}


@pytest.fixture
def launch():
    yield from started_runs(Launch)


@pytest.mark.parametrize("how", ["exit", "signal"])
def test_child_death_stops_the_rest_and_names_the_child(how, launch):
    dies = ("import sys, time; time.sleep(0.5); print('boom: the disk is on fire', file=sys.stderr); sys.exit(3)"
            if how == "exit" else "import os, signal, time; time.sleep(0.5); os.kill(os.getpid(), signal.SIGKILL)")
    run = launch([ChildSpec("sleeper", SLEEPER), ChildSpec("doomed", py(dies))])
    assert run.wait(15) == 1
    out = run.out()
    pid = run.pids()["doomed"]
    if how == "exit":
        assert f"doomed (pid {pid}) exited with code 3" in out
        assert "boom: the disk is on fire" in out  # its last lines
        assert "[doomed] boom: the disk is on fire" in run.err()  # children's output, echoed with a prefix
    else:
        assert f"doomed (pid {pid}) was killed by signal SIGKILL" in out
    wait_all_gone(run.pids().values())


def test_sigterm_stops_every_child_and_exits_0(launch):
    port = free_port()
    stubborn = py("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "print('ignoring SIGTERM', flush=True); time.sleep(120)")
    run = launch([ChildSpec("sleeper", SLEEPER), ChildSpec("stubborn", stubborn),
                  ChildSpec("web", (sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)),
                            url=f"http://127.0.0.1:{port}", health_url=f"http://127.0.0.1:{port}/")],
                 stop_timeout_s=1.0)
    run.wait_for_output("processes are up", 20)
    run.wait_for_output("[stubborn] ignoring SIGTERM", 10)
    pids = run.pids()
    assert set(pids) == {"sleeper", "stubborn", "web"}
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(15) == 0
    assert "received SIGTERM" in run.out()
    assert "stubborn" in run.out() and "SIGKILL" in run.out()  # after the grace period
    wait_all_gone(pids.values())


def test_a_stop_last_child_is_stopped_after_the_others_exited(launch, tmp_path):
    """The etcd of ``--discovery local`` must outlive the workers that revoke their leases in it."""
    gone = tmp_path / "worker-gone"
    worker = py(f"import signal, sys, time\ndef bye(*_):\n time.sleep(0.5); open({str(gone)!r}, 'w').close(); "
                f"sys.exit(0)\nsignal.signal(signal.SIGTERM, bye)\nprint('up', flush=True)\ntime.sleep(120)")
    last = py(f"import os, signal, sys, time\ndef bye(*_):\n print('worker gone first:', os.path.exists("
              f"{str(gone)!r}), flush=True); sys.exit(0)\nsignal.signal(signal.SIGTERM, bye)\ntime.sleep(120)")
    run = launch([ChildSpec("etcd", last, stop_last=True), ChildSpec("worker", worker)], stop_timeout_s=20.0)
    run.wait_for_output("[worker] up", 20)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(30) == 0
    assert "worker gone first: True" in run.out() + run.err(), run.out() + run.err()


def test_a_child_that_never_gets_healthy_is_named(launch):
    port = free_port()  # nothing listens there
    run = launch([ChildSpec("sleeper", SLEEPER),
                  ChildSpec("laggard", SLEEPER, health_url=f"http://127.0.0.1:{port}/health")], ready_timeout_s=1.0)
    assert run.wait(15) == 1
    assert "laggard" in run.out() and "not healthy" in run.out()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_kill_9_of_launch_takes_the_children_down(launch):
    run = launch([ChildSpec("a", SLEEPER), ChildSpec("b", SLEEPER)])
    run.wait_for_output("processes are up", 20)
    pids = run.pids()
    assert len(pids) == 2 and all(running(p) for p in pids.values())
    run.kill()
    wait_all_gone(pids.values())


def test_build_specs_command_lines():
    specs = build_specs(LaunchConfig(model="/m", num_prefill=2, num_decode=1, port=8123, transfer_backend="tcp",
                                     split_cpus=False), python="py")
    assert [s.name for s in specs] == ["prefill-0", "prefill-1", "decode-0", "router"]
    p0 = specs[0].argv
    assert p0[:8] == ("py", "-m", "splitserve.cli", "serve", "--role", "prefill", "--model", "/m")
    assert p0[-2:] == ("--transfer-backend", "tcp") and "--bootstrap-port" in p0
    assert specs[2].argv[4:6] == ("--role", "decode")
    bootstraps = [s.argv[s.argv.index("--bootstrap-port") + 1] for s in specs[:3]]  # a decode's too
    for s in specs[:3]:  # each dials only the workers launch started, any of which may become a prefill
        assert s.argv[s.argv.index("--allowed-prefill") + 1] == ",".join(f"127.0.0.1:{b}" for b in bootstraps)
    router = specs[3].argv
    assert router[3:5] == ("router", "--host") and "8123" in router
    prefill_args = [router[i + 1:i + 3] for i, a in enumerate(router) if a == "--prefill"]
    assert prefill_args == [(s.url, s.argv[s.argv.index("--bootstrap-port") + 1]) for s in specs[:2]]
    assert [router[i + 1] for i, a in enumerate(router) if a == "--decode"] == [specs[2].url]
    ids = [s.argv[s.argv.index("--worker-id") + 1] for s in specs[:3]]  # ids of this run, the router pinned to them
    assert ids == [s.worker_id for s in specs[:3]] and len(set(ids)) == 3 and ids[0].startswith("prefill-0.")
    assert [router[i + 3] for i, a in enumerate(router) if a == "--prefill"] == [f"id={i}" for i in ids[:2]]
    assert [router[i + 2] for i, a in enumerate(router) if a == "--decode"] == [f"id={ids[2]}"]
    with pytest.raises(ValueError, match="own --worker-id"):
        build_specs(LaunchConfig(split_cpus=False, worker_args="--worker-id mine"), python="py")
    ports = [s.url.rsplit(":", 1)[1] for s in specs[:3]] + bootstraps
    assert len(set(ports)) == 6 and "8123" not in ports
    with pytest.raises(ValueError, match="transfer-backend"):
        build_specs(LaunchConfig(transfer_backend="carrier-pigeon"))


def test_every_worker_launch_starts_has_a_bootstrap_port_that_every_worker_allows():
    """A decode worker switched to prefill (``POST /role``) binds the bootstrap port launch gave it
    at the start, and the other workers take it as a prefill: every worker has its own, and every
    ``--allowed-prefill`` names them all. The ports come from one place: given again, a worker's
    command line names the same ones (a worker started again takes its own ports)."""
    from splitserve.launch import launch_ports

    config = LaunchConfig(num_prefill=1, num_decode=2, split_cpus=False)
    ports = launch_ports(config)
    specs = build_specs(config, python="py", ports=ports, run="r")
    workers = specs[:3]
    assert [s.argv[s.argv.index("--bootstrap-port") + 1] for s in workers] == [str(b) for b in ports.bootstraps()]
    assert [s.url for s in workers] == [f"http://127.0.0.1:{h}" for h, _ in ports.prefill + ports.decode]
    everyone = ",".join(f"127.0.0.1:{b}" for b in ports.bootstraps())
    assert all(s.argv[s.argv.index("--allowed-prefill") + 1] == everyone for s in workers)
    assert len({p for pair in ports.prefill + ports.decode for p in pair}) == 6
    assert [s.argv for s in build_specs(config, python="py", ports=ports, run="r")[:3]] == [s.argv for s in workers]
    with pytest.raises(ValueError, match="own --bootstrap-port"):
        build_specs(replace(config, worker_args="--bootstrap-port=9"), python="py")


class Stray:
    """Another process's HTTP server on a port launch picked, answering ``/health`` 200 as the
    worker ``ident`` (a stray worker of another run)."""

    def __init__(self, port: int, ident: str):
        import http.server

        self.ident = ident
        stray = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = json.dumps({"status": "ok", "id": stray.ident, "incarnation": "stray1"}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_process_that_took_a_picked_port_is_never_taken_for_the_worker(launch):
    """The port race: build_specs picks free ports, and the children bind them later. Here another
    process takes prefill-0's port meanwhile and answers /health 200 as a worker would by default
    (``prefill@127.0.0.1:PORT``). Neither launch's readiness wait nor the router (as launch starts
    it) takes it for prefill-0; once prefill-0 itself answers, the router takes it, as itself."""
    import aiohttp

    from splitserve.cli import build_parser, router_config_from
    from splitserve.router.workers import HealthChecker, WorkerSet

    specs = build_specs(LaunchConfig(port=free_port(), split_cpus=False), python=sys.executable)
    prefill = specs[0]
    port = int(prefill.url.rsplit(":", 1)[1])
    stray = Stray(port, f"prefill@127.0.0.1:{port}")
    try:
        run = launch([replace(prefill, argv=SLEEPER)], ready_timeout_s=1.0)  # ours never answers
        assert run.wait(15) == 1, run.out()
        assert "prefill-0" in run.out() and "not healthy" in run.out() and "another process answers" in run.out()
        assert "processes are up" not in run.out()

        config = router_config_from(build_parser().parse_args(specs[-1].argv[3:]))
        workers = WorkerSet.from_config(config)
        worker = workers.prefill[0]
        assert worker.url == prefill.url and worker.id == prefill.worker_id

        async def check() -> None:
            async with aiohttp.ClientSession() as session:
                await HealthChecker(workers, session, 1.0, 1).check(worker)

        asyncio.run(check())
        assert not worker.healthy and "another process answers" in worker.last_error, worker.last_error
        stray.ident = prefill.worker_id  # now prefill-0 itself answers there
        asyncio.run(check())
        assert worker.healthy and worker.incarnation == "stray1" and worker.restarts == 0, worker.last_error
    finally:
        stray.close()


def test_the_tests_own_server_process_is_not_fooled_by_a_process_on_its_port():
    """The same race in the tests' helper: a worker whose port another process took cannot bind it
    and exits; ``ServerProcess.wait_ready`` must say so, never take the other's 200 for it (the
    worker's own ready line on its stdout is what says it is up)."""
    from conftest import ServerProcess

    port = free_port()
    stray = Stray(port, "colocated@127.0.0.1:1")
    try:
        proc = ServerProcess()
        proc._spawn(port)
        try:
            with pytest.raises(RuntimeError, match="cannot listen"):
                proc.wait_ready(60)
        finally:
            proc.stop(timeout=5)
    finally:
        stray.close()


@pytest.mark.parametrize("argv, want", [
    (["--prefill", "http://p:1", "--decode", "http://d:2"], [("http://p:1", 8998, None), ("http://d:2", None, None)]),
    (["--prefill", "http://p:1/", "7", "id=p.x", "--decode", "http://d:2", "id=d-0"],
     [("http://p:1", 7, "p.x"), ("http://d:2", None, "d-0")]),
    (["--prefill", "http://p:1", "id=p", "--decode", "http://d:2"], [("http://p:1", 8998, "p"), ("http://d:2", None, None)]),
    (["--prefill", "http://p:1", "7", "8", "--decode", "http://d:2"], "at most one bootstrap port"),
    (["--prefill", "http://p:1", "x", "--decode", "http://d:2"], "is not a number"),
    (["--prefill", "http://p:1", "--decode", "http://d:2", "7"], "--decode takes a URL and an optional id=ID"),
    (["--prefill", "http://p:1", "id=", "--decode", "http://d:2"], "a worker id is"),
    (["--prefill", "http://p:1\t", "--decode", "http://d:2"], "printable ASCII"),
    (["--prefill", "http://p:1", "--decode", "http://d:2/v1"], "is not http"),
    (["--prefill", "p:1", "--decode", "http://d:2"], "is not http"),
])
def test_router_workers_on_the_command_line_may_name_their_ids(argv, want):
    from splitserve.cli import build_parser, router_config_from

    args = build_parser().parse_args(["router", *argv])
    if isinstance(want, str):
        with pytest.raises(SystemExit, match=want):
            router_config_from(args)
        return
    config = router_config_from(args)
    assert [(a.url, a.bootstrap_port, a.id) for a in config.prefill + config.decode] == want


def test_build_specs_with_discovery_registers_the_workers_and_the_router_watches(monkeypatch):
    """``--discovery URL``: every worker registers there and the router gets no static list;
    ``--discovery local``: an etcd of launch's own comes first, on free ports, and is that URL."""
    given = build_specs(LaunchConfig(discovery="etcd://10.0.0.2:2379/p", split_cpus=False), python="py")
    for spec in given[:-1]:
        assert spec.argv[spec.argv.index("--discovery") + 1] == "etcd://10.0.0.2:2379/p"
    router = given[-1].argv
    assert router[router.index("--discovery") + 1] == "etcd://10.0.0.2:2379/p"
    assert "--prefill" not in router and "--decode" not in router
    with pytest.raises(ValueError, match="scheme must be one of etcd://"):  # the store a scheme names
        build_specs(LaunchConfig(discovery="http://10.0.0.2:2379"), python="py")
    with pytest.raises(ValueError, match="etcd://HOST:PORT/PREFIX"):  # and that store reads the rest
        build_specs(LaunchConfig(discovery="etcd://10.0.0.2"), python="py")
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/etcd")
    local = build_specs(LaunchConfig(discovery="local", split_cpus=False), python="py", etcd_data="/tmp/d")
    assert [s.name for s in local] == ["etcd", "prefill-0", "decode-0", "router"] and local[0].stop_last
    etcd = local[0]
    url = f"etcd://{etcd.url.removeprefix('http://')}/splitserve"
    assert etcd.argv[0] == "etcd" and "/tmp/d" in etcd.argv and etcd.health_url == etcd.url + "/health"
    assert all(s.argv[s.argv.index("--discovery") + 1] == url for s in local[1:])
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(ValueError, match="not on PATH"):
        build_specs(LaunchConfig(discovery="local", split_cpus=False), python="py")


def test_build_specs_hands_keys_over_in_the_environment_never_the_command_line(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("the-clients-key\n")
    for config, environ in ((LaunchConfig(split_cpus=False, api_key="the-clients-key"), {}),
                            (LaunchConfig(split_cpus=False, api_key_file=str(key_file)), {}),
                            (LaunchConfig(split_cpus=False), {"SPLITSERVE_API_KEY": "the-clients-key"})):
        specs = build_specs(config, python="py", environ=environ)
        *workers, router = specs
        worker_key, admin_key = router.env["SPLITSERVE_WORKER_API_KEY"], router.env["SPLITSERVE_ADMIN_API_KEY"]
        assert router.env["SPLITSERVE_API_KEY"] == "the-clients-key" and len(worker_key) >= 32
        assert len(admin_key) >= 32 and admin_key != worker_key
        for w in workers:  # the router's key and the operators', never the clients'
            assert w.env["SPLITSERVE_WORKER_API_KEY"] == worker_key and w.env["SPLITSERVE_ADMIN_API_KEY"] == admin_key
            assert not w.env["SPLITSERVE_API_KEY"]
        for spec in specs:
            assert not any(k in " ".join(spec.argv) for k in ("the-clients-key", worker_key, admin_key, "api-key"))
    own = build_specs(LaunchConfig(split_cpus=False, api_key="the-clients-key"), python="py",
                      environ={"SPLITSERVE_ADMIN_API_KEY": "the-operators-key"})
    assert all(s.env["SPLITSERVE_ADMIN_API_KEY"] == "the-operators-key" for s in own)
    secured = build_specs(LaunchConfig(split_cpus=False), python="py", environ={}, secret_file="/run/s")
    assert all(s.argv[s.argv.index("--cluster-secret-file") + 1] == "/run/s" for s in secured)  # the router too
    stray = {"SPLITSERVE_WORKER_API_KEY": "stray", "SPLITSERVE_METRICS_API_KEY": "stray2"}
    *workers, router = build_specs(LaunchConfig(split_cpus=False), python="py", environ=stray)
    worker_key = router.env["SPLITSERVE_WORKER_API_KEY"]  # unkeyed: the workers take fields from the router only
    assert len(worker_key) >= 32 and worker_key != "stray"
    for w in workers:
        assert w.env["SPLITSERVE_WORKER_API_KEY"] == worker_key and len(w.env["SPLITSERVE_ADMIN_API_KEY"]) >= 32
        assert not w.env["SPLITSERVE_API_KEY"] and not w.env["SPLITSERVE_METRICS_API_KEY"]
    assert not router.env["SPLITSERVE_API_KEY"] and not router.env["SPLITSERVE_ADMIN_API_KEY"]  # its routes open
    assert not router.env["SPLITSERVE_METRICS_API_KEY"]


def test_build_specs_passes_more_options_on():
    specs = build_specs(LaunchConfig(split_cpus=False, worker_args="--no-prefix-cache --max-total-tokens 4096",
                                     router_args="--cache-threshold 0.5", policy="cache_aware"), python="py")
    for worker in specs[:2]:
        assert worker.argv[-3:] == ("--no-prefix-cache", "--max-total-tokens", "4096")
    assert specs[2].argv[-2:] == ("--cache-threshold", "0.5") and "cache_aware" in specs[2].argv


def one_cpu_per_core(cpus):
    return [(c,) for c in sorted(cpus)]


def _placement(spec: ChildSpec) -> tuple[str, str] | None:
    argv = spec.argv
    if "--cpus" not in argv:
        assert "--threads" not in argv
        return None
    return argv[argv.index("--cpus") + 1], argv[argv.index("--threads") + 1]


@pytest.mark.parametrize("config, allowed, want, warning", [
    (LaunchConfig(), (0, 1), [("0", "1"), ("1", "1"), None], None),
    (LaunchConfig(num_prefill=2), tuple(range(8)), [("0-2", "3"), ("3-5", "3"), ("6-7", "2"), None], None),
    (LaunchConfig(), (0,), [("0", "1"), ("0", "1"), None], "1 CPU (0) for 2 workers: workers share CPUs"),
    (LaunchConfig(num_prefill=2, num_decode=2), (0, 1, 2), [("0", "1"), ("1", "1"), ("2", "1"), ("0", "1"), None],
     "3 CPUs (0-2) for 4 workers"),
    (LaunchConfig(prefill_cpus="0-5"), tuple(range(8)), [("0-5", "6"), ("6-7", "2"), None], None),
    (LaunchConfig(num_decode=2, decode_cpus="4,6"), tuple(range(8)), [("0-3,5,7", "6"), ("4", "1"), ("6", "1"), None],
     None),
    (LaunchConfig(prefill_cpus="0-1", decode_cpus="1-2"), (0, 1, 2), [("0-1", "2"), ("1-2", "2"), None],
     "overlap: CPUs 1 are shared"),
    (LaunchConfig(split_cpus=False), (0, 1), [None, None, None], None),
])
def test_build_specs_gives_each_worker_its_cpus(config, allowed, want, warning):
    """Each worker's --cpus and --threads, on a host without SMT (one CPU per core)."""
    warnings: list[str] = []
    specs = build_specs(config, python="py", allowed=allowed, warn=warnings.append, cores_of=one_cpu_per_core)
    assert [_placement(s) for s in specs] == want  # the router (last) shares every CPU
    if warning:
        assert len(warnings) == 1 and warning in warnings[0], warnings
    else:
        assert warnings == []
    assert specs[-1].name == "router"


def test_build_specs_never_splits_a_core_between_workers():
    """A 4-core host whose CPU i and i+4 are one core's SMT siblings: each worker gets whole cores
    and one thread per core."""
    def smt_pairs(cpus):
        return sorted({tuple(sorted({c % 4, c % 4 + 4} & set(cpus))) for c in cpus})

    specs = build_specs(LaunchConfig(), python="py", allowed=range(8), cores_of=smt_pairs)
    assert [_placement(s) for s in specs] == [("0-1,4-5", "2"), ("2-3,6-7", "2"), None]


@pytest.mark.parametrize("config, words", [
    (LaunchConfig(prefill_cpus="0-9"), "--prefill-cpus 0-9: CPUs 2-9 are not available to this process"),
    (LaunchConfig(decode_cpus="zero"), "--decode-cpus 'zero': 'zero' is not a CPU number"),
    (LaunchConfig(prefill_cpus="0-1"), "--prefill-cpus 0-1 leaves no CPU for the decode workers"),
    (LaunchConfig(split_cpus=False, decode_cpus="1"), "not with --no-split-cpus"),
])
def test_build_specs_refuses_bad_cpu_choices(config, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        build_specs(config, python="py", allowed=(0, 1))


def test_launch_refuses_bad_cpus_with_exit_2():
    out = subprocess.run([sys.executable, "-m", "splitserve.cli", "launch", "--prefill-cpus", "0,99999"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "splitserve launch: --prefill-cpus 0,99999: CPU 99999 is not available" \
        in out.stderr, out.stderr


def _cpus_allowed(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        return re.search(r"^Cpus_allowed_list:\s*(\S+)", f.read(), re.M)[1]


def _disaggregated_roles_exist() -> bool:
    from splitserve.cli import build_parser

    args, _ = build_parser().parse_known_args(["serve"])
    return hasattr(args, "bootstrap_port")


def test_launch_end_to_end(launch):
    """The real router and workers under the supervisor; a request through the router; each
    worker runs on the CPUs and with the torch threads launch gave it (seen by the kernel and in
    its ``/get_server_info``), disjoint when there are CPUs enough, the router on every CPU;
    SIGTERM stops everything. Until ``serve --role prefill|decode`` exist, colocated workers
    stand in (same command lines, ``--role colocated``, no bootstrap port)."""
    specs = build_specs(LaunchConfig(port=free_port(), ready_timeout_s=120), secret_file=CLUSTER_SECRET)
    if not _disaggregated_roles_exist():
        stand_ins = []
        for s in specs:
            argv = list(s.argv)
            if "serve" in argv:
                argv[argv.index("--role") + 1] = "colocated"
                if "--bootstrap-port" in argv:
                    del argv[argv.index("--bootstrap-port"):argv.index("--bootstrap-port") + 2]
            stand_ins.append(replace(s, argv=tuple(argv)))
        specs = stand_ins
    run = launch(specs, ready_timeout_s=120, stop_timeout_s=20)
    run.wait_for_output("processes are up", 150)
    router_url = specs[-1].url
    assert f"splitserve ready: {router_url}" in run.out()
    r = requests.post(router_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    pids = run.pids()
    assert set(pids) == {"prefill-0", "decode-0", "router"}
    allowed = format_cpu_list(sorted(os.sched_getaffinity(0)))
    placed = {}
    for spec in specs[:2]:
        cpus, threads = _placement(spec)
        assert _cpus_allowed(pids[spec.name]) == cpus
        operator = {"Authorization": f"Bearer {spec.env['SPLITSERVE_ADMIN_API_KEY']}"}  # workers are always keyed
        info = requests.get(spec.url + "/get_server_info", headers=operator, timeout=10).json()
        assert (info["cpus"], info["threads"]) == (cpus, int(threads)), spec.name
        placed[spec.name] = set(parse_cpu_list(cpus))
    if len(os.sched_getaffinity(0)) >= 2:
        assert not placed["prefill-0"] & placed["decode-0"]
        assert placed["prefill-0"] | placed["decode-0"] == set(os.sched_getaffinity(0))
    assert _cpus_allowed(pids["router"]) == allowed
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(30) == 0, run.out()
    wait_all_gone(pids.values())


@pytest.mark.long
def test_a_decode_switched_to_prefill_under_launch_is_taken_by_the_other_decodes(launch):
    """Under ``launch`` (one prefill, two decodes, unkeyed: the decodes take only the addresses on
    their ``--allowed-prefill``), ``decode-1`` switched to prefill binds the bootstrap port launch
    gave it, the router puts it in rotation, and every split request succeeds: those it prefills
    too (none refused ``bootstrap_not_allowed``)."""
    specs = build_specs(LaunchConfig(num_prefill=1, num_decode=2, port=free_port(), ready_timeout_s=150,
                                     router_args="--pd-threshold-tokens 0 --health-interval-s 0.5"),
                        secret_file=CLUSTER_SECRET)
    run = launch(specs, ready_timeout_s=150, stop_timeout_s=20)
    run.wait_for_output("processes are up", 180)
    router, switched = specs[-1].url, next(s for s in specs if s.name == "decode-1")
    epoch = requests.get(switched.url + "/health", timeout=10).json()["epoch"]
    r = requests.post(switched.url + "/role", json={"role": "prefill", "epoch": epoch}, timeout=120,
                      headers={"Authorization": f"Bearer {switched.env['SPLITSERVE_ADMIN_API_KEY']}"})
    assert r.status_code == 200 and r.json()["switched"], r.text

    def prefills_in_rotation() -> int:
        workers = requests.get(router + "/workers", timeout=10).json()["workers"]
        return sum(w["role"] == "prefill" and w["state"] == "healthy" for w in workers)

    deadline = time.monotonic() + 60
    while prefills_in_rotation() < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert prefills_in_rotation() == 2, requests.get(router + "/workers", timeout=10).text
    answers = [requests.post(router + "/v1/completions", json={"prompt": f"Hello {i}", "max_tokens": 4},
                             timeout=60) for i in range(10)]
    assert [a.status_code for a in answers] == [200] * 10, [a.text for a in answers if a.status_code != 200]
    served = requests.get(switched.url + "/metrics", timeout=10,
                          headers={"Authorization": f"Bearer {switched.env['SPLITSERVE_ADMIN_API_KEY']}"}).text
    assert re.search(r'^splitserve_requests_total\{[^}]*role="prefill"[^}]*\} [1-9]', served, re.M), served[-3000:]
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(60) == 0, run.out()
