"""``splitserve launch``: prefill workers, decode workers and a router on this host, supervised.

:func:`build_specs` turns a :class:`LaunchConfig` into one :class:`ChildSpec` per process, each
``sys.executable -m splitserve.cli ...``: workers on free loopback ports, each with a bootstrap port
too (a decode worker binds its own once switched to prefill) and every bootstrap port on each
one's ``--allowed-prefill``, all picked in one place (:func:`launch_ports`); the router on
``--port`` pointed at all of them. :class:`Supervisor` (``supervisor.py``) starts, watches and
stops them.

Ports picked free may be taken by another process before a child binds them, so every worker gets
an id of this run (``--worker-id NAME.RUN``) that launch waits to see in its ``/health`` and the
router is told (``--prefill URL PORT id=ID``). CPUs: each worker gets its own physical cores and
one torch thread per core (:func:`worker_cpus`; the README has the flags). Keys: the workers
always take a worker key drawn for this run, so only the router may send the fields that name a
prefill to dial or continue a stream, and an admin key, drawn unless given, written to a file of
this run (mode 0600) that the summary names. Restarts: a worker that exits once everything is up is
started again in the role it last wrote to its role file, on the same ports, under the same id and
keys, as :class:`RestartPolicy` allows (``--restart-budget``); so is one that runs but is not
healthy (:class:`HealthPolicy`).
"""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Optional, Sequence

from splitserve.auth import ADMIN_API_KEY_ENV, API_KEY_ENV, METRICS_API_KEY_ENV, WORKER_API_KEY_ENV, load_key
from splitserve.cpus import allowed_cpus, check_cpus, cpu_cores, format_cpu_list, split_between_workers
from splitserve.hosts import host_port
from splitserve.launch.child import ChildSpec
from splitserve.launch.health_watch import HealthPolicy
from splitserve.launch.restart import RestartPolicy
from splitserve.launch.supervisor import Supervisor
from splitserve.transfer_backends import check_served

__all__ = ["ChildSpec", "HealthPolicy", "LaunchConfig", "LaunchPorts", "RestartPolicy", "Supervisor", "build_specs",
           "launch_ports", "run_launch"]


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
    """How long every process may take to become healthy before launch gives up; a worker started
    again has as long, else it is stopped and counted as an exit (--restart-budget)."""
    stop_timeout_s: float = 40.0
    """On Ctrl-C or SIGTERM, how long children may take to exit after SIGTERM before SIGKILL; also
    how long a worker stopped for not being healthy may take."""
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
    $SPLITSERVE_API_KEY (`ps` shows a command line: prefer those). Unset, the router's routes are
    open. The workers always take the router's key, drawn at random and known to the router and
    them, and the operators' key. Keys reach the children through their environment, never their
    command lines."""
    api_key_file: Optional[str] = None
    """A file whose first line is the clients' API key (chmod 600)."""
    admin_api_key: Optional[str] = field(default=None, repr=False)
    """The operators' key of the router and every worker (/flush_cache, /workers, /debug/*,
    /metrics, POST /role; `splitserve top` needs it); also from --admin-api-key-file or
    $SPLITSERVE_ADMIN_API_KEY. Unset: launch draws one and writes it to a file (mode 0600) it names,
    and the router takes it only while a client key is set."""
    admin_api_key_file: Optional[str] = None
    """A file whose first line is the operators' key."""
    cluster_secret_file: Optional[str] = None
    """The workers' --cluster-secret-file (their control plane authenticated and encrypted);
    unset: launch draws a fresh secret into a private temporary file for this run."""
    discovery: Optional[str] = None
    """etcd://HOST:PORT/PREFIX: the workers register in that etcd and the router finds them there
    (it gets no static list), so workers on other hosts registered there join too; local: launch
    starts an etcd on free loopback ports with a temporary data dir (etcd must be on PATH:
    Debian's etcd-server) and uses it. Launch's decode workers still dial only the bootstrap ports of
    launch's workers (--allowed-prefill; --worker-args may add more)."""
    restart_budget: int = 5
    """A worker that exits or is killed once every process is up (or that launch stops for not being
    healthy: --ready-timeout-s, --worker-unhealthy-checks) is started again (same ports, id and keys;
    the role it last served in), at most this many times in --restart-window-s; one more exit and
    launch gives up, stops everything and exits 1 naming it. 0: never restart (a worker's exit
    stops everything)."""
    restart_window_s: float = 600.0
    """The window --restart-budget counts a worker's restarts in."""
    restart_delay_s: float = 0.5
    """The delay before a worker's first restart in the window; it doubles with each one more."""
    restart_max_delay_s: float = 30.0
    """The longest delay before a restart."""
    worker_health_interval_s: float = 10.0
    """Once every process is up, launch looks at each worker's /health this often (each look may
    take as long, at least 1 s): a worker started again must become healthy within
    --ready-timeout-s, one that was healthy must not fail --worker-unhealthy-checks looks in a row."""
    worker_unhealthy_checks: int = 6
    """A worker that was healthy and then fails this many looks at its /health in a row (503, no
    answer; a worker that says it drains is not counted) is wedged: launch stops it (SIGTERM, then
    SIGKILL after --stop-timeout-s) and counts it as an exit (--restart-budget). 0: never."""

    def restart_policy(self) -> RestartPolicy:
        """The restart options as a :class:`RestartPolicy`; ValueError naming one out of range."""
        policy = RestartPolicy(self.restart_budget, self.restart_window_s, self.restart_delay_s,
                               self.restart_max_delay_s)
        policy.check()
        return policy

    def health_policy(self) -> HealthPolicy:
        """The health watch's options as a :class:`HealthPolicy`; ValueError naming one out of range."""
        policy = HealthPolicy(self.worker_health_interval_s, self.worker_unhealthy_checks)
        policy.check()
        return policy


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
                ports: Optional[LaunchPorts] = None, role_dir: Optional[str] = None) -> list[ChildSpec]:
    """The workers, then the router, as ``python -m splitserve.cli`` command lines. ``allowed``:
    the CPUs to split between the workers (default: launch's own), ``cores_of`` how they group
    into physical cores (default: the kernel's topology); ``warn`` gets the warnings; ``environ``:
    where ``$SPLITSERVE_API_KEY`` is read (default: ours); ``secret_file``: the workers'
    ``--cluster-secret-file`` (default ``config.cluster_secret_file``; none without either);
    ``etcd_data``: the data dir of the etcd ``--discovery local`` starts (default a new temporary one);
    ``run``: what the workers' ids end in (default drawn at random: ids of this run only);
    ``ports``: every process's ports (default :func:`launch_ports`); ``role_dir``: the folder of the
    workers' role files (``serve --role-file``; default none: a worker restarts in its first role)."""
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
        from splitserve.config import DiscoveryConfig
        from splitserve.discovery.backends import check

        check(config.discovery, DiscoveryConfig())  # the store its scheme names reads the URL
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
    workers, router_args = _worker_specs(config, cli, extra, ports, cpus, cores_of, worker_env, run, role_dir)
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
    """The workers' and the router's environment of keys (keys never go on a command line). The
    workers always get the worker key (drawn: the router's, known to it and them only) and an admin
    key (given, or drawn); the router gets the worker key, and the client and admin keys only when
    a client or admin key is given (unkeyed, its own routes stay open)."""
    client_key = load_key(config.api_key, config.api_key_file, API_KEY_ENV, environ=environ)
    given_admin = load_key(config.admin_api_key, config.admin_api_key_file, ADMIN_API_KEY_ENV, "--admin-api-key",
                           environ)
    keyed = bool(client_key or given_admin)  # then the router is keyed too: docs/security.md
    admin_key = given_admin or secrets.token_urlsafe(32)
    if admin_key == client_key:
        raise ValueError("--api-key and --admin-api-key are the same key: give each its own")
    # an empty variable is no key: nothing stray is inherited
    worker_env = {API_KEY_ENV: "", WORKER_API_KEY_ENV: secrets.token_urlsafe(32), ADMIN_API_KEY_ENV: admin_key,
                  METRICS_API_KEY_ENV: ""}
    return worker_env, {**worker_env, API_KEY_ENV: client_key or "", ADMIN_API_KEY_ENV: admin_key if keyed else ""}


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
    for own in ("--worker-id", "--bootstrap-port", "--role-file"):
        if any(a == own or a.startswith(own + "=") for a in extra):
            raise ValueError(f"--worker-args: launch gives each worker its own {own}")
    extra += ("--cluster-secret-file", secret_file) if secret_file else ()  # the path, never the secret
    return extra + (("--discovery", discovery) if discovery else ())


def _worker_specs(config: LaunchConfig, cli: tuple, extra: tuple, ports: LaunchPorts, cpus: tuple, cores_of: CoresOf,
                  env: dict, run: Optional[str], role_dir: Optional[str]) -> tuple[list[ChildSpec], list[str]]:
    """Each worker's spec (prefills first; restarted when it exits, in the role its role file in
    ``role_dir`` names), and the router's options naming them."""
    run = run or secrets.token_hex(4)
    specs, router_args = [], []
    for role, pairs, sets in (("prefill", ports.prefill, cpus[0]), ("decode", ports.decode, cpus[1])):
        for i, (port, bootstrap) in enumerate(pairs):
            url, name = f"http://{host_port('127.0.0.1', port)}", f"{role}-{i}"
            placed, where = _placement(sets, i, cores_of)
            note = f"bootstrap port {bootstrap}" + (" if it becomes a prefill" if role == "decode" else "")
            role_file = os.path.join(role_dir, f"{name}.role") if role_dir else None
            specs.append(ChildSpec(
                name, cli + ("serve", "--role", role, "--model", config.model, "--host", "127.0.0.1", "--port",
                             str(port), "--bootstrap-port", str(bootstrap), "--worker-id", f"{name}.{run}")
                + (("--role-file", role_file) if role_file else ()) + extra + placed, url=url,
                health_url=url + "/health", note=note + where, env=env, worker_id=f"{name}.{run}", restart=True,
                role_file=role_file))
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


def run_launch(config: LaunchConfig) -> int:
    """What ``splitserve launch`` runs: the exit code (0 after Ctrl-C/SIGTERM, 1 if a process
    died or never became healthy, or a worker used up its restarts, 2 for a bad configuration).
    The workers share a cluster secret: ``--cluster-secret-file``, or one drawn for this run into a
    private temporary file, where the workers' role files and the drawn admin key are too."""
    with tempfile.TemporaryDirectory(prefix="splitserve-launch-") as folder:  # mode 700, removed at the end
        secret_file = config.cluster_secret_file
        if secret_file is None:
            from splitserve.secret_file import write_secret_file

            secret_file = write_secret_file(os.path.join(folder, "cluster-secret"))
        notes = []
        try:
            restart, health = config.restart_policy(), config.health_policy()
            specs = build_specs(config, secret_file=secret_file, etcd_data=os.path.join(folder, "etcd"),
                                role_dir=folder)
            if load_key(config.admin_api_key, config.admin_api_key_file, ADMIN_API_KEY_ENV, "--admin-api-key") is None:
                drawn = next(s for s in specs if s.restart).env[ADMIN_API_KEY_ENV]
                admin_file = _private_file(folder, "admin-api-key", drawn)
                notes.append(f"the operators' key (admin) is in {admin_file} while launch runs: "
                             f"splitserve top --router {_router_url(config)} --admin-api-key-file {admin_file}")
        except ValueError as exc:
            print(f"splitserve launch: {exc}", file=sys.stderr, flush=True)
            return 2
        notes += _restart_notes(config, restart, health)
        return Supervisor(specs, config.ready_timeout_s, config.stop_timeout_s, notes=notes, restart=restart,
                          health=health).run()


def _restart_notes(config: LaunchConfig, restart: RestartPolicy, health: HealthPolicy) -> list[str]:
    """The summary's lines on what launch does with a worker that exits or is not healthy."""
    wedged = (f"fails {health.unhealthy_checks} looks at its /health in a row (one every {health.interval_s:g} s; "
              "--worker-unhealthy-checks)") if health.unhealthy_checks else ""
    if not restart.budget:
        return [f"a worker that {wedged} is stopped, and stops everything"] if wedged else []
    return [f"a worker that exits, is not healthy {config.ready_timeout_s:g} s after a restart (--ready-timeout-s)"
            f"{', or ' + wedged if wedged else ''} is started again, at most {restart.budget} times in "
            f"{restart.window_s:g} s (--restart-budget, --restart-window-s)"]


def _private_file(folder: str, name: str, text: str) -> str:
    """``text`` in a new file ``name`` of ``folder`` that only we can read (mode 0600)."""
    path = os.path.join(folder, name)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(text + "\n")
    return path
