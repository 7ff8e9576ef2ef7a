"""``deploy/kubernetes/``: rendered by ``kubectl kustomize``, every object valid against the
Kubernetes schemas (``kubernetes-validate``, schema version :data:`K8S_VERSION`; the
ServiceMonitor against ``deploy/kubernetes/schemas/``); every flag the containers pass one that
``splitserve serve --help`` / ``splitserve router --help`` (and ``etcd --help``) lists; the probes
and what the drain and the CPU bounds need of the workers' pods; etcd's auth and NetworkPolicy.

No Kubernetes API server or kubelet runs here (docs/deploy.md says so), so what a kubelet would do
is done by hand: the Secret's files are written as the kubelet writes them for each pod's security
context (owner root, mode ``defaultMode``, and with ``fsGroup`` that group and its read bit) and
read by the image's user — in the computed check, and (as root here) by the real router and
workers started as that user with the containers' own arguments."""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, free_port

K8S_VERSION = "1.32.0"
KUSTOMIZE = REPO / "deploy" / "kubernetes"
IN_CI = os.environ.get("CI") == "true"
DOCKERFILE_USER = re.search(r"^USER (\d+)(?::(\d+))?$", (KUSTOMIZE / "Dockerfile").read_text(), re.M)


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    if shutil.which("kubectl") is None:  # .ci/run installs it
        message = "kubectl is not installed (apt-get install kubernetes-client)"
        pytest.fail(message) if IN_CI else pytest.skip(message)
    out = subprocess.run(["kubectl", "kustomize", str(KUSTOMIZE)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(objects, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def splitserve_pods(objects) -> dict[str, dict]:
    """The pod templates of the router and the workers, by Deployment name."""
    return {name: dep["spec"]["template"] for name, dep in by_kind(objects, "Deployment").items()}


def test_every_object_is_valid_against_its_schema(objects):
    import jsonschema
    import kubernetes_validate

    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(["Namespace", "Secret", "StatefulSet", "Service", "Job", "NetworkPolicy", "Deployment",
                            "Service", "Deployment", "Service", "Deployment", "Service", "NetworkPolicy",
                            "ServiceMonitor"]), kinds
    monitor = json.loads((KUSTOMIZE / "schemas" / "servicemonitor-v1.json").read_text())
    for obj in objects:
        if obj["kind"] == "ServiceMonitor":
            jsonschema.validate(obj, monitor)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        assert obj["kind"] == "Namespace" or obj["metadata"]["namespace"] == "splitserve", obj["metadata"]


def _options(command: list[str]) -> set[str]:
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO,
                         env=dict(os.environ, COLUMNS="200"))
    assert out.returncode == 0 or command[0] == "etcd", out.stderr
    return set(re.findall(r"(--[a-z0-9][a-z0-9-]*)", out.stdout + out.stderr))


def test_every_flag_the_containers_pass_is_one_their_program_has(objects):
    """splitserve's containers against ``splitserve serve|router --help``; etcd's against the
    installed ``etcd --help`` (3.4 here, 3.5 in the image: the flags used are in both). The
    Job's ``etcdctl`` calls are not checked here (no etcdctl): their effect is, against a real
    etcd (:func:`test_the_etcd_user_of_the_workers_and_routers_may_use_its_prefix_and_nothing_else`)."""
    cli = [sys.executable, "-m", "splitserve.cli"]
    known = {"serve": _options(cli + ["serve", "--help"]), "router": _options(cli + ["router", "--help"])}
    seen = set()
    for name, pod in splitserve_pods(objects).items():
        for container in pod["spec"]["containers"]:
            command, *args = container["args"]
            flags = {a.split("=")[0] for a in args if a.startswith("--")}
            assert flags <= known[command], f"{name}: not in `splitserve {command} --help`: {flags - known[command]}"
            assert all(a.startswith("--") for a in args), args  # every value with its flag (--flag=value)
            seen.add(command)
    assert seen == {"serve", "router"}
    if shutil.which("etcd") is None:
        pytest.fail("etcd is not installed") if IN_CI else pytest.skip("etcd is not installed")
    (etcd,) = by_kind(objects, "StatefulSet")["splitserve-etcd"]["spec"]["template"]["spec"]["containers"]
    flags = {a.split("=")[0] for a in etcd["command"][1:]}
    assert flags <= _options(["etcd", "--help"]), flags - _options(["etcd", "--help"])


def _flag(container: dict, flag: str) -> str:
    values = [a.split("=", 1)[1] for a in container["args"] if a.split("=")[0] == flag]
    assert len(values) == 1, f"{flag} given {len(values)} times"
    return values[0]


def _window(probe: dict) -> float:
    """How long a probe may fail before the kubelet acts on it (defaults: every 10 s, 3 times)."""
    return probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


def test_the_workers_pods_cover_their_drain_probes_and_cpu_bounds(objects):
    from splitserve.server.process import END_GRACE_S

    pods, services = splitserve_pods(objects), by_kind(objects, "Service")
    for role in ("prefill", "decode"):
        pod = pods[f"splitserve-{role}"]
        assert pod["metadata"]["labels"]["splitserve.io/role"] == role
        spec = pod["spec"]
        (c,) = spec["containers"]
        assert _flag(c, "--role") == role and _flag(c, "--discovery").startswith("etcd://")
        assert _flag(c, "--advertise-host") == "$(POD_IP)"
        env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in c["env"]}
        assert env["POD_IP"] == "status.podIP"
        # the drain: preStop, then the grace (lease revoked first), the drain timeout, the handlers
        pre_stop = float(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        needed = pre_stop + float(_flag(c, "--discovery-grace-s")) + float(_flag(c, "--drain-timeout-s")) + END_GRACE_S
        assert spec["terminationGracePeriodSeconds"] >= needed + 5, (spec["terminationGracePeriodSeconds"], needed)
        # probes: readiness and liveness on /health (503 while loading, draining or wedged); the
        # startup probe covers the load, and liveness waits longer than a drain or a role switch's
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, (role, probe)
        assert _window(c["livenessProbe"]) > needed, (role, _window(c["livenessProbe"]), needed)
        assert c["livenessProbe"].get("timeoutSeconds", 1) >= 2
        # CPU: requests equal limits (no throttling), and --threads matches them
        res = c["resources"]
        assert res["requests"] == res["limits"], res
        assert int(_flag(c, "--threads")) == int(res["limits"]["cpu"])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["http"] == int(_flag(c, "--port"))
        # a decode too: it may become a prefill (POST /role), and a prefill listens there from its start
        assert ports["bootstrap"] == int(_flag(c, "--bootstrap-port")), (role, ports)
        assert services[f"splitserve-{role}"]["metadata"]["labels"]["splitserve.io/scrape"] == "true"
    monitor = by_kind(objects, "ServiceMonitor")["splitserve"]
    assert monitor["spec"]["selector"]["matchLabels"] == {"splitserve.io/scrape": "true"}
    assert monitor["spec"]["endpoints"][0]["authorization"]["credentials"]["key"] == "metrics-api-key"


def test_the_router_and_etcd_have_probes_that_restart_only_what_is_dead(objects):
    """The router's /health is 503 while it has no worker pair: ready on it, but alive on its
    port (a router is not restarted for its workers' absence). etcd's probes read its own /health."""
    (router,) = splitserve_pods(objects)["splitserve-router"]["spec"]["containers"]
    assert router["readinessProbe"]["httpGet"]["path"] == "/health"
    assert router["livenessProbe"]["tcpSocket"] == {"port": "http"}
    (etcd,) = by_kind(objects, "StatefulSet")["splitserve-etcd"]["spec"]["template"]["spec"]["containers"]
    metrics_port = int(next(a for a in etcd["command"] if a.startswith("--listen-metrics-urls=")).rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in etcd["ports"]}
    for probe in ("readinessProbe", "livenessProbe"):
        assert ports[etcd[probe]["httpGet"]["port"]] == metrics_port and etcd[probe]["httpGet"]["path"] == "/health"


# -- what the kubelet writes, and who can read it -----------------------------------------------


def _identity(pod: dict, container: dict) -> tuple[int, int, set[int]]:
    """The uid, gid and groups a container's process runs with: the pod's security context must
    name the image's user (so nothing rests on the image's /etc/passwd); fsGroup and
    supplementalGroups are added to its groups, as the kubelet does."""
    spec = pod["spec"]
    ctx = {**spec.get("securityContext", {}), **container.get("securityContext", {})}
    assert ctx.get("runAsNonRoot") is True and "runAsUser" in ctx and "runAsGroup" in ctx, ctx
    assert ctx["runAsUser"] == int(DOCKERFILE_USER.group(1)), "the pod runs as the image's USER"
    groups = {ctx["runAsGroup"], *spec.get("securityContext", {}).get("supplementalGroups", [])}
    if "fsGroup" in spec.get("securityContext", {}):
        groups.add(spec["securityContext"]["fsGroup"])
    return ctx["runAsUser"], ctx["runAsGroup"], groups


def _kubelet_files(pod: dict, volume: dict) -> dict[str, tuple[int, int, int]]:
    """Each file of a Secret volume as the kubelet writes it: (owner, group, mode). The atomic
    writer makes it root's with the item's mode or ``defaultMode`` (0644 unless given); with the
    pod's ``fsGroup`` the volume's ownership step gives it that group and ORs in 0440 (the mask
    of a read-only volume)."""
    secret = volume["secret"]
    fs_group = pod["spec"].get("securityContext", {}).get("fsGroup")
    files = {}
    for item in secret["items"]:
        mode = item.get("mode", secret.get("defaultMode", 0o644))
        files[item["path"]] = (0, 0, mode) if fs_group is None else (0, fs_group, mode | 0o440)
    return files


def _may_read(uid: int, groups: set[int], owner: int, group: int, mode: int) -> bool:
    if uid == 0:
        return True
    if uid == owner:
        return bool(mode & 0o400)
    return bool(mode & (0o040 if group in groups else 0o004))


def _mounted_files(pod: dict, container: dict) -> dict[str, tuple[str, str]]:
    """Every flag's value that is a file in one of the container's Secret volumes: flag ->
    (volume name, the file's path in it)."""
    secrets_of = {v["name"]: v for v in pod["spec"]["volumes"] if "secret" in v}
    found = {}
    for arg in container["args"]:
        flag, _, value = arg.partition("=")
        for mount in container.get("volumeMounts", []):
            if mount["name"] in secrets_of and value.startswith(mount["mountPath"] + "/"):
                assert mount.get("readOnly") is True, mount
                found[flag] = (mount["name"], value[len(mount["mountPath"]) + 1:])
    return found


def test_every_file_a_flag_names_is_one_the_kubelet_lets_the_pods_user_read(objects):
    """Who the process is (the pod's security context against the image's USER), what the
    kubelet writes (owner, group, mode), and that no other user may read a key."""
    for name, pod in splitserve_pods(objects).items():
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        for container in pod["spec"]["containers"]:
            uid, _gid, groups = _identity(pod, container)
            files = _mounted_files(pod, container)
            assert {f for f in files if f.endswith("-file")} == set(files), files
            assert "--cluster-secret-file" in files and "--discovery-password-file" in files, (name, files)
            for flag, (volume, path) in files.items():
                written = _kubelet_files(pod, volumes[volume])
                assert path in written, (name, flag, path)
                owner, group, mode = written[path]
                assert _may_read(uid, groups, owner, group, mode), (name, flag, f"{owner}:{group} {mode:o}", uid)
                assert not mode & 0o007, (name, flag, f"{mode:o}")  # the cluster secret's loader refuses it


def test_etcd_takes_a_limited_user_and_only_splitserves_pods(objects):
    """The Job adds the user every --discovery-user names, with a role on exactly the prefix of
    every --discovery, and enables auth last; the user's password is the file the pods mount.
    The NetworkPolicy admits etcd's client port from the router's, the workers' and the Job's pods,
    and docs/deploy.md gives, as expected there, the warning plain etcd:// draws at every start."""
    job = by_kind(objects, "Job")["splitserve-etcd-auth"]["spec"]["template"]
    steps = [c["command"] for c in job["spec"]["initContainers"] + job["spec"]["containers"]]
    assert steps[-1] == ["etcdctl", "auth", "enable"]
    prefixes, users = set(), set()
    for pod in splitserve_pods(objects).values():
        (c,) = pod["spec"]["containers"]
        prefixes.add("/" + _flag(c, "--discovery").split("/", 3)[3].strip("/") + "/")
        users.add(_flag(c, "--discovery-user"))
        assert _flag(c, "--discovery-password-file").endswith("/etcd-password")
    (user,), (prefix,) = users, prefixes
    assert ["etcdctl", "role", "grant-permission", user, "--prefix=true", "readwrite", prefix] in steps
    assert ["etcdctl", "user", "grant-role", user, user] in steps
    assert ["etcdctl", "user", "add", user, "--new-user-password=$(PASSWORD)"] in steps
    env = {e["name"]: e for c in job["spec"]["initContainers"] for e in c.get("env", [])}
    assert env["PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == "etcd-password"
    # plain etcd:// inside the policy: the warning every pod gives at start is documented as expected
    from splitserve.discovery.etcd import Credentials, parse_target, plaintext_password

    (c,) = splitserve_pods(objects)["splitserve-router"]["spec"]["containers"]
    warning = plaintext_password(parse_target(_flag(c, "--discovery")), Credentials(user=user, password_file="f"))
    assert warning is not None and "plain etcd://" in warning
    said = re.sub(r"\s+", " ", (REPO / "docs" / "deploy.md").read_text())
    assert f"--discovery-user {user} over plain etcd://" in said and warning.split(": ", 1)[1][:40] in said
    policy = by_kind(objects, "NetworkPolicy")["splitserve-etcd"]["spec"]
    assert policy["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "splitserve-etcd"}
    client_rule = next(r for r in policy["ingress"] if r["ports"] == [{"protocol": "TCP", "port": 2379}])
    (allowed,) = client_rule["from"][0]["podSelector"]["matchExpressions"]
    names = {p["metadata"]["labels"]["app.kubernetes.io/name"] for p in splitserve_pods(objects).values()}
    assert set(allowed["values"]) == names | {job["metadata"]["labels"]["app.kubernetes.io/name"]}


def test_the_etcd_user_of_the_workers_and_routers_may_use_its_prefix_and_nothing_else(objects):
    """The Job's calls on a real etcd — its own ``etcdctl`` commands where etcdctl is installed
    (Debian's etcd-client), else each made through etcd's JSON gateway (the same API): then the
    limited user registers a worker under a lease, lists the prefix, and is refused elsewhere."""
    from etcd_server import EtcdServer, have_etcd

    from splitserve.discovery.etcd import Credentials, client, parse_target

    if not have_etcd():
        pytest.fail("etcd is not installed") if IN_CI else pytest.skip("etcd is not installed")
    job = by_kind(objects, "Job")["splitserve-etcd-auth"]["spec"]["template"]["spec"]
    passwords = {"$(ROOT_PASSWORD)": secrets.token_hex(8), "$(PASSWORD)": secrets.token_hex(8)}
    with EtcdServer() as etcd, tempfile.TemporaryDirectory() as folder:
        for c in job["initContainers"] + job["containers"]:
            _run_job_step(c["command"], passwords, etcd.http)
        password = Path(folder) / "etcd-password"
        password.write_text(passwords["$(PASSWORD)"] + "\n")
        password.chmod(0o600)
        target = parse_target(etcd.url("/splitserve"))
        limited = client(target, Credentials(user="splitserve", password_file=str(password)))
        lease = limited.lease(ttl=10)
        limited.put(target.key("workers/w-0"), "record", lease=lease)
        assert [v for v, _ in limited.get_prefix(target.prefix + "/")] == [b"record"]
        assert lease.refresh() > 0
        lease.revoke()
        for key in ("/other/x", "/splitserve-other/x", "/x"):
            with pytest.raises(Exception, match="Forbidden|permission denied"):
                limited.put(key, "v")


def _run_job_step(command: list[str], passwords: dict[str, str], endpoint: str) -> None:
    """One init container's ``etcdctl`` call of the Job, by etcdctl itself or through the gateway."""
    if shutil.which("etcdctl"):
        argv = []
        for arg in command:  # the kubelet puts the Secret's values for $(NAME)
            flag, eq, value = arg.partition("=")
            argv.append(f"{flag}={passwords[value]}" if eq and value in passwords else arg)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, ETCDCTL_ENDPOINTS=endpoint))
        assert done.returncode == 0, (command, done.stderr[-2000:])
    elif command[1:] != ["endpoint", "health"]:
        path, body = _gateway_call(command[1:], passwords)
        answer = __import__("requests").post(f"{endpoint}/v3/auth/{path}", json=body, timeout=10)
        assert answer.status_code == 200, (command, answer.text)


def _gateway_call(args: list[str], passwords: dict[str, str]) -> tuple[str, dict]:
    """One ``etcdctl`` auth call of the Job as etcd's v3 JSON gateway takes it."""
    b64 = lambda text: base64.b64encode(text.encode()).decode()  # noqa: E731
    match args:
        case ["user", "add", name, password]:
            return "user/add", {"name": name, "password": passwords[password.split("=", 1)[1]]}
        case ["role", "add", name]:
            return "role/add", {"name": name}
        case ["user", "grant-role", user, role]:
            return "user/grant", {"user": user, "role": role}
        case ["role", "grant-permission", role, "--prefix=true", "readwrite", key]:
            end = key[:-1] + chr(ord(key[-1]) + 1)
            perm = {"permType": "READWRITE", "key": b64(key), "range_end": b64(end)}
            return "role/grant", {"name": role, "perm": perm}
        case ["auth", "enable"]:
            return "enable", {}
    raise AssertionError(f"an etcdctl call this test does not know: {args}")


# -- the real processes, as the image's user, on the files the kubelet writes --------------------


def _python_for_others() -> list[str] | None:
    """An interpreter of this Python (and its site-packages) that any user may run, or None."""
    def open_to_all(path: str) -> bool:
        path = os.path.realpath(path)
        parts = [path] + [str(p) for p in Path(path).parents]
        return all(os.stat(p).st_mode & 0o005 == 0o005 or (os.path.isfile(p) and os.stat(p).st_mode & 0o004)
                   for p in parts)

    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
    if not all(open_to_all(p) for p in site + [str(REPO / "splitserve" / "cli.py")]):
        return None
    for python in (sys.executable, shutil.which(version), f"/usr/bin/{version}"):
        if python and os.path.exists(python) and open_to_all(python):
            return [os.path.realpath(python)]
    return None


def _write_like_the_kubelet(folder: Path, files: dict[str, tuple[int, int, int]], values: dict[str, str],
                            fs_group) -> None:
    """A Secret volume's layout: the files in a timestamped folder, ``..data`` linking to it, and
    each item a link through ``..data`` (what a process opens resolves to the real file)."""
    data = folder / "..2026_01_01_00_00_00.000000001"
    data.mkdir(parents=True)
    for path, (owner, group, mode) in files.items():
        (data / path).write_text(values[path])
        os.chown(data / path, owner, group)
        os.chmod(data / path, mode)
        (folder / path).symlink_to(Path("..data") / path)
    (folder / "..data").symlink_to(data.name)
    for d in (folder, data):
        os.chown(d, 0, 0 if fs_group is None else fs_group)
        os.chmod(d, 0o755 if fs_group is None else 0o2755)


def _local_args(container: dict, mount: str, keys: Path, name: str, etcd_port: int) -> list[str]:
    """The container's arguments, its mount point moved to ``keys`` and its addresses to loopback."""
    local = {"--host": "127.0.0.1", "--advertise-host": "127.0.0.1", "--worker-id": name,
             "--discovery": f"etcd://127.0.0.1:{etcd_port}/splitserve", "--port": str(free_port()),
             "--bootstrap-port": str(free_port())}
    args = []
    for arg in container["args"]:
        flag, eq, value = arg.partition("=")
        value = local.get(flag, value.replace(mount + "/", f"{keys}/"))
        args.append(f"{flag}{eq}{value}" if eq else arg)
    return args


def _start_as(user: tuple[int, int, set[int]], python: list[str], args: list[str], home: Path) -> subprocess.Popen:
    uid, gid, groups = user
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "SPLITSERVE_CACHE": str(home / "cache"), "COLUMNS": "200",
           "PYTHONPATH": os.pathsep.join({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}),
           "PYTHONDONTWRITEBYTECODE": "1"}
    with open(home / "out.log", "wb") as out:  # the child keeps its own descriptor
        return subprocess.Popen(python + ["-m", "splitserve.cli", *args], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, user=uid, group=gid,
                                extra_groups=sorted(groups))


def _wait_for(proc: subprocess.Popen, log: Path, marks: list[str], timeout: float = 90.0) -> str:
    """The output once every mark is in it, or once the process ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if all(m in text for m in marks) or proc.poll() is not None:
            return text
        time.sleep(0.1)
    return log.read_text(errors="replace")


MARKS = {"router": ["router listening", "/v3/auth/authenticate"],  # the password file read, etcd dialled
         "serve": ["CPU placement"]}  # every key file and the cluster secret read; the model is next
"""What the real process has said once it read every file it reads at start."""


def _values(pods: list[dict]) -> dict[str, str]:
    """Fresh values for every file of the pods' Secret volumes (the manifest's are placeholders)."""
    paths = {i["path"] for p in pods for v in p["spec"]["volumes"] if "secret" in v for i in v["secret"]["items"]}
    values = {p: secrets.token_urlsafe(24) + "\n" for p in paths}
    values["cluster-secret"] = base64.b64encode(os.urandom(32)).decode() + "\n"
    return values


AS_ROOT = pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0,
                             reason="needs root: to write the files as root's and start processes as another user")


@AS_ROOT
def test_the_router_starts_as_the_images_user_on_the_files_the_kubelet_writes(objects):
    """The router's Secret volume written as the kubelet writes it (owner, group, mode, links),
    and the real router started as the pod's user with its container's own arguments (mount
    point, addresses and ports moved here): it reads every key, the cluster secret and etcd's
    password, listens and dials etcd. The control: its volume as the kubelet wrote it for the
    manifests before (0400, no fsGroup) stops it with exit 2, Permission denied."""
    pods = splitserve_pods(objects)
    old = json.loads(json.dumps(pods["splitserve-router"]))
    old["spec"]["securityContext"].pop("fsGroup")
    for volume in old["spec"]["volumes"]:
        volume["secret"]["defaultMode"] = 0o400
    router = pods["splitserve-router"]
    assert_pods_start([("router", router, router), ("router-as-before", old, router)], {"router-as-before"})


@AS_ROOT
@pytest.mark.long
def test_the_workers_start_as_the_images_user_on_the_files_the_kubelet_writes(objects):
    """The same for a prefill and a decode pod, up to the point where every file a worker reads
    at start was read (its CPU placement; the model loads next, and is not waited for)."""
    pods = splitserve_pods(objects)
    workers = [(name, pods[f"splitserve-{name}"], pods[f"splitserve-{name}"]) for name in ("prefill", "decode")]
    assert_pods_start(workers, set())


def assert_pods_start(cases: list[tuple[str, dict, dict]], refused: set[str]) -> None:
    """Each case (name, the pod spec its volume is written for, the real pod whose container and
    user run) started; those in ``refused`` must stop with exit 2 and Permission denied, the
    others read every file and go on."""
    python = _python_for_others()
    if python is None:
        pytest.skip("no interpreter of this Python that another user may run")
    values, root, runs = _values([real for _, _, real in cases]), Path(tempfile.mkdtemp(prefix="kubelet-")), {}
    os.chmod(root, 0o755)
    try:
        for name, pod, real in cases:
            runs[name] = _start_pod(root / name, pod, real, values, python)
        for name, (proc, log, marks) in runs.items():
            text = _wait_for(proc, log, marks)
            if name in refused:
                assert proc.wait(60) == 2 and "Permission denied" in text, text[-3000:]
                continue
            assert proc.poll() is None and "Permission denied" not in text, (name, text[-3000:])
            assert all(m in text for m in marks), (name, text[-3000:])
    finally:
        for proc, _log, _marks in runs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _log, _marks in runs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        shutil.rmtree(root, ignore_errors=True)


def _start_pod(folder: Path, pod: dict, real: dict, values: dict[str, str], python: list[str]):
    """The pod's one container started (volume written for ``pod``'s security context; the user
    is ``real``'s, the image's): (process, its log, the marks to wait for)."""
    (container,) = real["spec"]["containers"]
    user = _identity(real, container)
    (volume,) = [v for v in pod["spec"]["volumes"] if "secret" in v]
    (mount,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == volume["name"]]
    fs_group = pod["spec"]["securityContext"].get("fsGroup")
    _write_like_the_kubelet(folder / "keys", _kubelet_files(pod, volume), values, fs_group)
    home = folder / "home"
    home.mkdir()
    os.chown(home, user[0], user[1])
    args = _local_args(container, mount, folder / "keys", folder.name, free_port())
    return _start_as(user, python, args, home), home / "out.log", MARKS[args[0]]
