"""``splitserve launch``: prefill workers, decode workers and a router on this host, supervised.

:func:`build_specs` turns a :class:`LaunchConfig` into one :class:`ChildSpec` per process, each
``sys.executable -m splitserve.cli ...``: workers on free loopback ports, each with a bootstrap port
too (a decode worker binds its own once switched to prefill, ``POST /role``) and every bootstrap port
on each one's ``--allowed-prefill``, all picked in one place (:func:`launch_ports`); the router on
``--port`` pointed at all of them. :class:`Supervisor` runs
any list of specs (tests hand it plain ``python -c`` children):

Ports: launch picks free ports and the children bind them a moment later; another process can take
one meanwhile, and may answer ``/health`` like a worker (a stray worker of another run). So every
worker gets an id of this run (``--worker-id NAME.RUN``), launch waits for each worker's ``/health``
to answer with its id, and the router is given the ids (``--prefill URL PORT id=ID``) and takes no
other process on those ports for them. A worker whose port was taken cannot bind it and exits, and
launch then stops with its last lines.

CPUs: by default every worker gets its own physical cores (``--cpus``, a core's SMT siblings
together) out of the CPUs launch may run on, an equal share each, and one torch thread per core
(``--threads``), so that a prefill and a decode worker never spin threads on the same core
(:func:`worker_cpus`; ``--prefill-cpus`` and ``--decode-cpus`` choose the split,
``--no-split-cpus`` lets every worker use every CPU). With fewer cores than workers they share,
and launch warns. The router only moves bytes: it runs on every CPU.

1. start every child, each in its own session (process group), its stdout and stderr merged into
   a pipe that a thread per child echoes with a ``[name]`` prefix and keeps the last lines of;
2. wait until every child with a ``health_url`` answers 200 there (at most ``ready_timeout_s``; on
   timeout it names the children that are not healthy, with their last lines, and fails);
3. print where each child listens and a curl example, then watch: a child that exits is reported
   (name, pid, exit code or signal, last lines of its output), the others are stopped, and
   ``run`` returns 1; SIGINT or SIGTERM stops every child and ``run`` returns 0.

Stopping: SIGTERM to each child's process group, then SIGKILL to the groups still alive after
``stop_timeout_s`` (a second Ctrl-C or SIGTERM skips the wait). Workers drain on SIGTERM. A child
marked ``stop_last`` (the etcd of ``--discovery local``) gets its SIGTERM once the others exited.

No orphans, also when launch itself is killed with SIGKILL: on Linux every child is started with
``prctl(PR_SET_PDEATHSIG, SIGTERM)`` (through ctypes, in the child between fork and exec), so the
kernel sends it SIGTERM when launch dies; a child whose parent died before the prctl took effect
exits at once. The death signal is tied to the thread that started the child, which is launch's
main thread, alive until launch exits. Elsewhere only the process groups are used (an orderly exit
of launch still stops everything; a SIGKILL of launch may leave children).
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import secrets
import shutil
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Optional, Sequence, TextIO

from splitserve.auth import ADMIN_API_KEY_ENV, API_KEY_ENV, METRICS_API_KEY_ENV, WORKER_API_KEY_ENV, load_key
from splitserve.cpus import allowed_cpus, check_cpus, cpu_cores, format_cpu_list, split_between_workers
from splitserve.hosts import host_port
from splitserve.transfer_backends import check_served

TAIL_LINES = 30
POLL_S = 0.2
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class LaunchConfig:
    model: str = "tiny"
    """What every worker serves: smollm2 (the demo model), tiny (random, for tests), a .gguf file, or a
    Hugging Face checkpoint folder (as `serve --model`)."""
    num_prefill: int = 1
    """Prefill workers to start."""
    num_decode: int = 1
    """Decode workers to start."""
    host: str = "127.0.0.1"
    """Address the router listens on (workers listen on 127.0.0.1)."""
    port: int = 8000
    """Port of the router, the one endpoint clients use."""
    chat_template: Optional[str] = None
    """A Jinja chat template file every worker uses instead of the model's own (as `serve
    --chat-template`; e.g. one that renders tools)."""
    transfer_backend: Optional[str] = None
    """KV transfer backend of the workers: nixl or tcp; unset, each worker uses its own default."""
    policy: str = "round_robin"
    """The router's policy: round_robin, random, least_load or cache_aware."""
    worker_args: str = ""
    """More options for every worker, as one string after "=" (e.g. --worker-args="--no-prefix-cache
    --max-total-tokens 16384"); `splitserve serve --help` lists them."""
    router_args: str = ""
    """More options for the router, as one string after "=" (e.g. --router-args="--cache-threshold
    0.5"); `splitserve router --help` lists them."""
    ready_timeout_s: float = 300.0
    """How long every process may take to become healthy before launch gives up."""
    stop_timeout_s: float = 40.0
    """On Ctrl-C or SIGTERM, how long children may take to exit after SIGTERM before SIGKILL."""
    split_cpus: bool = True
    """Give each worker its own physical cores out of the CPUs launch may run on (an equal share
    each, one torch thread per core), so workers do not oversubscribe cores; --no-split-cpus: every
    worker uses every CPU."""
    prefill_cpus: Optional[str] = None
    """CPUs of the prefill workers, e.g. 0-5, split evenly between them; unset: their equal share
    (or, with --decode-cpus, the CPUs it leaves)."""
    decode_cpus: Optional[str] = None
    """CPUs of the decode workers, e.g. 6-7, split evenly between them; unset: their equal share
    (or, with --prefill-cpus, the CPUs it leaves)."""
    api_key: Optional[str] = field(default=None, repr=False)
    """Clients of the router must send `Authorization: Bearer KEY`; also from --api-key-file or
    $SPLITSERVE_API_KEY (`ps` shows a command line: prefer those). The workers then take only the
    router's key, drawn at random and known to the router and them. Keys reach the children through
    their environment, never their command lines."""
    api_key_file: Optional[str] = None
    """A file whose first line is the clients' API key (chmod 600)."""
    admin_api_key: Optional[str] = field(default=None, repr=False)
    """The operators' key of the router and every worker (/flush_cache, /workers, /debug/*,
    /metrics; `splitserve top` needs it); also from --admin-api-key-file or $SPLITSERVE_ADMIN_API_KEY.
    Unset while a client key is set: launch draws one and writes it to a file (mode 0600) it names."""
    admin_api_key_file: Optional[str] = None
    """A file whose first line is the operators' key."""
    cluster_secret_file: Optional[str] = None
    """The workers' --cluster-secret-file (their control plane authenticated and encrypted);
    unset: launch draws a fresh secret into a private temporary file for this run."""
    discovery: Optional[str] = None
    """etcd://HOST:PORT/PREFIX: the workers register in that etcd and the router finds them there
    (it gets no static list), so workers on other hosts registered there join too; local: launch
    starts an etcd on free loopback ports with a temporary data dir (etcd must be on PATH:
    Debian's etcd-server) and uses it. Unkeyed, launch's decode workers still dial only launch's
    prefills (--allowed-prefill); with --api-key they take whatever address the router names."""


@dataclass(frozen=True)
class ChildSpec:
    name: str
    """Short unique name used in every message (``prefill-0``, ``router``)."""
    argv: tuple[str, ...]
    url: Optional[str] = None
    """Where it serves, for the summary."""
    health_url: Optional[str] = None
    """GET answering 200 means ready; None: ready once started."""
    note: str = ""
    """Extra words for the summary (``bootstrap port 8998``)."""
    env: Optional[Mapping[str, str]] = None
    """Extra environment variables (on top of launch's own)."""
    stop_last: bool = False
    """Stopped only once every other child has exited (or the stop bound passed): the etcd that
    the workers revoke their leases in as they stop."""
    worker_id: Optional[str] = None
    """The id its ``/health`` must answer with to count as ready (a worker): another process that
    answers 200 on its port is not it."""


def free_ports(n: int, avoid: Sequence[int] = ()) -> list[int]:
    """``n`` distinct free TCP ports on loopback (held together while picked, so no duplicates;
    another process can still take one before the child binds it)."""
    held, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            held.append(s)
            port = s.getsockname()[1]
            if port not in avoid:
                ports.append(port)
    finally:
        for s in held:
            s.close()
    return ports


CoresOf = Callable[[Sequence[int]], list[tuple[int, ...]]]


def worker_cpus(config: LaunchConfig, allowed: Sequence[int], cores_of: CoresOf = cpu_cores
                ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]], list[str]]:
    """The CPU set of each prefill and each decode worker out of ``allowed`` (``cores_of``: how
    CPUs group into physical cores), and warnings (workers sharing cores). ValueError for a CPU
    list that is malformed, outside ``allowed``, or leaves the other role no CPU."""
    allowed = tuple(sorted(allowed))
    chosen = {role: None if text is None else check_cpus(text, allowed, f"--{role}-cpus")
              for role, text in (("prefill", config.prefill_cpus), ("decode", config.decode_cpus))}
    counts = {"prefill": config.num_prefill, "decode": config.num_decode}
    warnings: list[str] = []
    if chosen["prefill"] is None and chosen["decode"] is None:
        sets, note = split_between_workers(allowed, config.num_prefill + config.num_decode, cores_of)
        warnings += [note] if note else []
        return sets[:config.num_prefill], sets[config.num_prefill:], warnings
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        if chosen[role] is None:
            chosen[role] = tuple(c for c in allowed if c not in chosen[other])
            if not chosen[role]:
                raise ValueError(f"--{other}-cpus {getattr(config, other + '_cpus')} leaves no CPU for the {role} "
                                 f"workers: set --{role}-cpus too")
    shared = sorted(set(chosen["prefill"]) & set(chosen["decode"]))
    if shared:
        warnings.append(f"--prefill-cpus and --decode-cpus overlap: CPUs {format_cpu_list(shared)} are shared")
    result = []
    for role in ("prefill", "decode"):
        sets, note = split_between_workers(chosen[role], counts[role], cores_of)
        warnings += [f"{role}: {note}"] if note else []
        result.append(sets)
    return result[0], result[1], warnings


def _warn(text: str) -> None:
    print(f"splitserve launch: warning: {text}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class LaunchPorts:
    """Every port of one launch, picked in one place (:func:`launch_ports`) and only there: a
    worker started again takes its own ports again. Every worker has a bootstrap port from the
    start, a decode worker too: switched to prefill (``POST /role``) it binds that one, which every
    worker's ``--allowed-prefill`` already names."""

    prefill: tuple[tuple[int, int], ...]
    """(HTTP port, bootstrap port) of each prefill worker."""
    decode: tuple[tuple[int, int], ...]
    """(HTTP port, bootstrap port) of each decode worker."""
    etcd: Optional[tuple[int, int]] = None
    """The client and peer ports of the etcd ``--discovery local`` starts."""

    def bootstraps(self) -> tuple[int, ...]:
        """Every worker's bootstrap port, prefills first."""
        return tuple(b for _, b in self.prefill + self.decode)


def launch_ports(config: LaunchConfig, pick: Callable[..., list[int]] = free_ports) -> LaunchPorts:
    """Free loopback ports for every process of ``config`` but the router (on ``config.port``)."""
    workers = config.num_prefill + config.num_decode
    local_etcd = config.discovery == "local"
    ports = iter(pick(2 * workers + 2 * local_etcd, avoid=(config.port,)))
    prefill = tuple((next(ports), next(ports)) for _ in range(config.num_prefill))
    decode = tuple((next(ports), next(ports)) for _ in range(config.num_decode))
    return LaunchPorts(prefill, decode, (next(ports), next(ports)) if local_etcd else None)


def build_specs(config: LaunchConfig, python: str = sys.executable, allowed: Optional[Sequence[int]] = None,
                warn: Callable[[str], None] = _warn, cores_of: CoresOf = cpu_cores,
                environ: Optional[Mapping[str, str]] = None, secret_file: Optional[str] = None,
                etcd_data: Optional[str] = None, run: Optional[str] = None,
                ports: Optional[LaunchPorts] = None) -> list[ChildSpec]:
    """The workers, then the router, as ``python -m splitserve.cli`` command lines. ``allowed``:
    the CPUs to split between the workers (default: launch's own), ``cores_of`` how they group
    into physical cores (default: the kernel's topology); ``warn`` gets the warnings; ``environ``:
    where ``$SPLITSERVE_API_KEY`` is read (default: ours); ``secret_file``: the workers'
    ``--cluster-secret-file`` (default ``config.cluster_secret_file``; none without either);
    ``etcd_data``: the data dir of the etcd ``--discovery local`` starts (default a new temporary one);
    ``run``: what the workers' ids end in (default drawn at random: ids of this run only);
    ``ports``: every process's ports (default :func:`launch_ports`)."""
    if config.num_prefill < 1 or config.num_decode < 1:
        raise ValueError("launch needs at least one prefill and one decode worker")
    if config.transfer_backend is not None:
        check_served(config.transfer_backend)
    if config.split_cpus:
        *cpus, warnings = worker_cpus(config, allowed_cpus() if allowed is None else allowed, cores_of)
        for text in warnings:
            warn(text)
    elif config.prefill_cpus is not None or config.decode_cpus is not None:
        raise ValueError("--prefill-cpus and --decode-cpus choose how CPUs are split: not with --no-split-cpus")
    else:
        cpus = (None, None)
    worker_env, router_env = _keys_env(config, environ)
    if config.discovery == "local" and shutil.which("etcd") is None:
        raise ValueError("--discovery local starts an etcd, and etcd is not on PATH (apt-get install etcd-server)")
    if config.discovery is not None and config.discovery != "local":
        from splitserve.discovery.etcd import parse_target

        parse_target(config.discovery)
    ports = ports or launch_ports(config)
    specs, discovery = [], config.discovery
    if ports.etcd is not None:
        etcd = _etcd_spec(ports.etcd, etcd_data)
        discovery = etcd.note.removeprefix("discovery: ")
        specs.append(etcd)
    cli = (python, "-m", "splitserve.cli")
    # every worker dials only these, whoever names one (keyed, only the router may name any), and
    # every worker may become a prefill: all bootstrap ports, the decodes' too (--worker-args may add more)
    extra = ("--allowed-prefill", ",".join(host_port("127.0.0.1", b) for b in ports.bootstraps()))
    secret = secret_file or config.cluster_secret_file
    extra += _worker_args(config, secret, discovery)
    workers, router_args = _worker_specs(config, cli, extra, ports, cpus, cores_of, worker_env, run)
    specs += workers
    if discovery:  # the router finds every worker in etcd, these and any registered elsewhere
        router_args = ["--discovery", discovery]
    if secret:  # the router uses only records sealed with it and asks every worker to prove it holds it
        router_args = [*router_args, "--cluster-secret-file", secret]
    router_url = _router_url(config)
    specs.append(ChildSpec(
        "router", cli + ("router", "--host", config.host, "--port", str(config.port), "--policy", config.policy,
                         *router_args, *shlex.split(config.router_args)),
        url=router_url, health_url=router_url + "/health", note="the endpoint for clients", env=router_env))
    return specs


def _keys_env(config: LaunchConfig, environ: Optional[Mapping[str, str]]) -> tuple[dict, dict]:
    """The workers' and the router's environment of keys (keys never go on a command line)."""
    client_key = load_key(config.api_key, config.api_key_file, API_KEY_ENV, environ=environ)
    admin_key = load_key(config.admin_api_key, config.admin_api_key_file, ADMIN_API_KEY_ENV, "--admin-api-key",
                         environ)
    keyed = bool(client_key or admin_key)  # then every process is keyed: docs/security.md
    worker_key = secrets.token_urlsafe(32) if keyed else None  # the router's, known to it and its workers only
    admin_key = admin_key or (secrets.token_urlsafe(32) if keyed else None)
    if admin_key is not None and admin_key == client_key:
        raise ValueError("--api-key and --admin-api-key are the same key: give each its own")
    # an empty variable is no key: nothing stray is inherited
    worker_env = {API_KEY_ENV: "", WORKER_API_KEY_ENV: worker_key or "", ADMIN_API_KEY_ENV: admin_key or "",
                  METRICS_API_KEY_ENV: ""}
    return worker_env, {**worker_env, API_KEY_ENV: client_key or ""}


def _etcd_spec(ports: tuple[int, int], etcd_data: Optional[str]) -> ChildSpec:
    """The etcd of ``--discovery local`` on loopback ``ports`` (client, peer); its note names the
    discovery URL the workers and the router are given."""
    client, peer = (f"http://{host_port('127.0.0.1', p)}" for p in ports)
    discovery = f"etcd://{client.removeprefix('http://')}/splitserve"
    return ChildSpec("etcd", ("etcd", "--name", "launch", "--data-dir", etcd_data or tempfile.mkdtemp(
        prefix="splitserve-etcd-"), "--listen-client-urls", client, "--advertise-client-urls", client,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"launch={peer}"),
        url=client, health_url=client + "/health", note=f"discovery: {discovery}", stop_last=True)


def _worker_args(config: LaunchConfig, secret_file: Optional[str], discovery: Optional[str]) -> tuple[str, ...]:
    """The options every worker gets."""
    extra = ("--transfer-backend", config.transfer_backend) if config.transfer_backend else ()
    extra += ("--chat-template", os.path.abspath(config.chat_template)) if config.chat_template else ()
    extra += tuple(shlex.split(config.worker_args))  # the worker refuses what it does not know, at start
    if any(a == "--worker-id" or a.startswith("--worker-id=") for a in extra):
        raise ValueError("--worker-args: launch gives each worker its own --worker-id")
    if any(a == "--bootstrap-port" or a.startswith("--bootstrap-port=") for a in extra):
        raise ValueError("--worker-args: launch gives each worker its own --bootstrap-port")
    extra += ("--cluster-secret-file", secret_file) if secret_file else ()  # the path, never the secret
    return extra + (("--discovery", discovery) if discovery else ())


def _worker_specs(config: LaunchConfig, cli: tuple, extra: tuple, ports: LaunchPorts, cpus: tuple, cores_of: CoresOf,
                  env: dict, run: Optional[str]) -> tuple[list[ChildSpec], list[str]]:
    """Each worker's spec (prefills first), and the router's options naming them."""
    run = run or secrets.token_hex(4)
    specs, router_args = [], []
    for role, pairs, sets in (("prefill", ports.prefill, cpus[0]), ("decode", ports.decode, cpus[1])):
        for i, (port, bootstrap) in enumerate(pairs):
            url, name = f"http://{host_port('127.0.0.1', port)}", f"{role}-{i}"
            placed, where = _placement(sets, i, cores_of)
            note = f"bootstrap port {bootstrap}" + (" if it becomes a prefill" if role == "decode" else "")
            specs.append(ChildSpec(
                name, cli + ("serve", "--role", role, "--model", config.model, "--host", "127.0.0.1", "--port",
                             str(port), "--bootstrap-port", str(bootstrap), "--worker-id", f"{name}.{run}")
                + extra + placed, url=url, health_url=url + "/health", note=note + where, env=env,
                worker_id=f"{name}.{run}"))
            router_args += [f"--{role}", url] + ([str(bootstrap)] if role == "prefill" else []) + [f"id={name}.{run}"]
    return specs, router_args


def _router_url(config: LaunchConfig) -> str:
    host = "127.0.0.1" if config.host in ("0.0.0.0", "", "::", "[::]") else config.host
    return f"http://{host_port(host, config.port)}"


def _placement(sets: Optional[list[tuple[int, ...]]], i: int, cores_of: CoresOf) -> tuple[tuple[str, ...], str]:
    """The ``--cpus``/``--threads`` arguments of a role's worker ``i`` (one thread per physical
    core) and words for the summary."""
    if sets is None:
        return (), ""
    cpus = format_cpu_list(sets[i])
    threads = len(cores_of(sets[i]))
    return ("--cpus", cpus, "--threads", str(threads)), f"; CPUs {cpus}, {threads} thread{'s' * (threads > 1)}"


class Child:
    """One running child: its process, and the thread that echoes and keeps its output."""

    def __init__(self, spec: ChildSpec, proc: subprocess.Popen, echo: Optional[TextIO], echo_lock: threading.Lock):
        self.spec = spec
        self.proc = proc
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._echo, self._echo_lock = echo, echo_lock
        self.reader = threading.Thread(target=self._read, name=f"output-{spec.name}", daemon=True)

    def _read(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.tail.append(line)
            if self._echo is not None:
                with self._echo_lock:
                    self._echo.write(f"[{self.spec.name}] {line}\n")
                    self._echo.flush()
        self.proc.stdout.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def how_it_ended(self) -> str:
        rc = self.proc.returncode
        if rc is not None and rc < 0:
            try:
                return f"was killed by signal {signal.Signals(-rc).name}"
            except ValueError:
                return f"was killed by signal {-rc}"
        return f"exited with code {rc}"

    def last_lines(self) -> str:
        if self.reader.is_alive():
            self.reader.join(timeout=1.0)  # the last lines may still be in the pipe
        lines = list(self.tail)
        return "\n".join("    " + line for line in lines) if lines else "    (no output)"

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # its own session: the group id is its pid
        except (ProcessLookupError, PermissionError):
            pass


def _die_with_parent(parent_pid: int):
    """A ``preexec_fn`` (Linux): SIGTERM this child when launch dies; exit if it already has."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


class Supervisor:
    """Runs, watches and stops a list of children; :meth:`run` returns launch's exit code."""

    def __init__(self, specs: Sequence[ChildSpec], ready_timeout_s: float = 300.0, stop_timeout_s: float = 40.0,
                 out: TextIO = sys.stdout, echo: Optional[TextIO] = sys.stderr, title: str = "splitserve launch",
                 notes: Sequence[str] = ()):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"child names must be unique: {names}")
        self.specs = list(specs)
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.out, self.echo = out, echo
        self.title = title
        self.notes = list(notes)  # more lines for the summary
        self.children: list[Child] = []
        self._signals: list[int] = []
        self._echo_lock = threading.Lock()

    def say(self, text: str) -> None:
        with self._echo_lock:
            self.out.write(text + "\n")
            self.out.flush()

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = self._start_all()
            if code is None:
                code = self._wait_ready()
            if code is None:
                self._print_summary()
                code = self._watch()
            return code
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame) -> None:
        self._signals.append(signum)

    def _start_all(self) -> Optional[int]:
        """Start every child (None), or say which could not be started (1)."""
        preexec = _die_with_parent(os.getpid())
        try:
            for spec in self.specs:
                env = dict(os.environ, PYTHONUNBUFFERED="1", **dict(spec.env or {}))
                proc = subprocess.Popen(list(spec.argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                        preexec_fn=preexec)
                self.children.append(Child(spec, proc, self.echo, self._echo_lock))
        except (OSError, subprocess.SubprocessError) as exc:
            self.say(f"{self.title}: cannot start {spec.name} ({' '.join(spec.argv)}): {exc}")
            return 1
        finally:  # the output threads start once no more forks are to come (preexec_fn and threads)
            for c in self.children:
                c.reader.start()
        return None

    def _wait_ready(self) -> Optional[int]:
        """None once every child is healthy, else the exit code to return."""
        deadline = time.monotonic() + self.ready_timeout_s
        waiting = [c for c in self.children if c.spec.health_url]
        why: dict[str, str] = {}  # child name -> why its last check did not count
        while waiting:
            if self._signals:
                self.say(f"{self.title}: {self._signal_name()} before every process was up: stopping")
                return 0
            code = self._check_deaths()
            if code is not None:
                return code
            why = {c.spec.name: _not_ready(c.spec.health_url, c.spec.worker_id) for c in waiting}
            waiting = [c for c in waiting if why[c.spec.name] is not None]
            if waiting and time.monotonic() > deadline:
                for c in waiting:
                    self.say(f"{self.title}: {c.spec.name} (pid {c.proc.pid}) is not healthy after "
                             f"{self.ready_timeout_s:g} s ({c.spec.health_url}: {why[c.spec.name]}); its last "
                             f"lines:\n{c.last_lines()}")
                names = ", ".join(c.spec.name for c in waiting)
                self.say(f"{self.title}: gave up waiting for {names}; stopping everything")
                return 1
            if waiting:
                time.sleep(POLL_S)
        return None

    def _watch(self) -> int:
        while True:
            if self._signals:
                self.say(f"{self.title}: {self._signal_name()}: stopping every process")
                return 0
            code = self._check_deaths()
            if code is not None:
                return code
            time.sleep(POLL_S)

    def _check_deaths(self) -> Optional[int]:
        for c in self.children:
            if not c.alive():
                self.say(f"{self.title}: {c.spec.name} (pid {c.proc.pid}) {c.how_it_ended()}; its last lines:\n"
                         f"{c.last_lines()}\n{self.title}: stopping the other processes")
                return 1
        return None

    def _signal_name(self) -> str:
        return f"received {signal.Signals(self._signals[-1]).name}"

    def _print_summary(self) -> None:
        width = max(len(c.spec.name) for c in self.children)
        lines = [f"{self.title}: all {len(self.children)} processes are up"]
        for c in self.children:
            where = f"  {c.spec.url}" if c.spec.url else ""
            note = f"  ({c.spec.note})" if c.spec.note else ""
            lines.append(f"  {c.spec.name:<{width}}  pid {c.proc.pid}{where}{note}")
        router = next((c for c in self.children if c.spec.name == "router" and c.spec.url), None)
        if router is not None:
            url = router.spec.url
            key = " -H 'Authorization: Bearer <your API key>'" if (router.spec.env or {}).get(API_KEY_ENV) else ""
            lines.append(f"splitserve ready: {url}  try: curl {url}/v1/completions{key} -H 'Content-Type: "
                         f"application/json' -d '{{\"prompt\": \"Hello, my name is\", \"max_tokens\": 16}}'")
        lines += self.notes
        lines.append("Ctrl-C stops every process.")
        self.say("\n".join(lines))

    def _stop_all(self) -> None:
        seen = len(self._signals)
        deadline = time.monotonic() + self.stop_timeout_s
        for last in (False, True):  # the stop_last children once the others are gone
            group = [c for c in self.children if c.spec.stop_last == last]
            for c in group:
                if c.alive():
                    c.signal_group(signal.SIGTERM)
            while any(c.alive() for c in group) and time.monotonic() < deadline:
                if len(self._signals) > seen:
                    self.say(f"{self.title}: {self._signal_name()} again: killing now")
                    deadline = 0.0
                    break
                time.sleep(0.05)
        for c in self.children:
            if c.alive():
                self.say(f"{self.title}: {c.spec.name} (pid {c.proc.pid}) still running after SIGTERM: SIGKILL")
            c.signal_group(signal.SIGKILL)  # also takes down anything it started in its group
        for c in self.children:
            try:
                c.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.say(f"{self.title}: {c.spec.name} (pid {c.proc.pid}) did not exit after SIGKILL")
            if c.reader.is_alive():
                c.reader.join(timeout=1.0)


def _not_ready(url: str, worker_id: Optional[str] = None) -> Optional[str]:
    """None when ``url`` answers 200 (and, given ``worker_id``, as that worker), else why not."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
    try:
        with opener.open(url, timeout=1.0) as resp:
            if resp.status != 200:
                return f"answered {resp.status}"
            if worker_id is None:
                return None
            body = resp.read(65536)
    except urllib.error.HTTPError as exc:
        return f"answered {exc.code}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return f"no answer ({exc})"
    try:
        seen = json.loads(body).get("id")
    except (ValueError, AttributeError):
        seen = None
    return None if seen == worker_id else f"another process answers there, as {str(seen)[:130]!r}, not {worker_id!r}"


def run_launch(config: LaunchConfig) -> int:
    """What ``splitserve launch`` runs: the exit code (0 after Ctrl-C/SIGTERM, 1 if a process
    died or never became healthy, 2 for a bad configuration). The workers share a cluster secret:
    ``--cluster-secret-file``, or one drawn for this run into a private temporary file."""
    with tempfile.TemporaryDirectory(prefix="splitserve-launch-") as folder:  # mode 700, removed at the end
        secret_file = config.cluster_secret_file
        if secret_file is None:
            from splitserve.secret_file import write_secret_file

            secret_file = write_secret_file(os.path.join(folder, "cluster-secret"))
        notes = []
        try:
            if load_key(config.admin_api_key, config.admin_api_key_file, ADMIN_API_KEY_ENV, "--admin-api-key") is None \
                    and load_key(config.api_key, config.api_key_file, API_KEY_ENV) is not None:
                admin_file = _private_file(folder, "admin-api-key", secrets.token_urlsafe(32))
                config = replace(config, admin_api_key_file=admin_file)
                notes.append(f"the operators' key (admin) is in {admin_file} while launch runs: "
                             f"splitserve top --router {_router_url(config)} --admin-api-key-file {admin_file}")
            specs = build_specs(config, secret_file=secret_file, etcd_data=os.path.join(folder, "etcd"))
        except ValueError as exc:
            print(f"splitserve launch: {exc}", file=sys.stderr, flush=True)
            return 2
        return Supervisor(specs, config.ready_timeout_s, config.stop_timeout_s, notes=notes).run()


def _private_file(folder: str, name: str, text: str) -> str:
    """``text`` in a new file ``name`` of ``folder`` that only we can read (mode 0600)."""
    path = os.path.join(folder, name)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(text + "\n")
    return path
