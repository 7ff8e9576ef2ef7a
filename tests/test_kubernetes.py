"""``deploy/kubernetes/`` (issue 19, part 5): rendered by ``kubectl kustomize``, every object valid
against the Kubernetes schemas (``kubernetes-validate``, schema version :data:`K8S_VERSION`; the
ServiceMonitor against ``deploy/kubernetes/schemas/``), every flag the containers pass one that
``splitserve serve --help`` / ``splitserve router --help`` lists, and what the drain and the CPU
bounds need of the workers' pods. There is no Kubernetes cluster here: docs/deploy.md says so."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import REPO

K8S_VERSION = "1.32.0"
KUSTOMIZE = REPO / "deploy" / "kubernetes"
IN_CI = os.environ.get("CI") == "true"


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


def test_every_object_is_valid_against_its_schema(objects):
    import jsonschema
    import kubernetes_validate

    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(["Namespace", "Secret", "StatefulSet", "Service", "Deployment", "Service", "Deployment",
                            "Service", "Deployment", "Service", "ServiceMonitor"]), kinds
    monitor = json.loads((KUSTOMIZE / "schemas" / "servicemonitor-v1.json").read_text())
    for obj in objects:
        if obj["kind"] == "ServiceMonitor":
            jsonschema.validate(obj, monitor)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        assert obj["kind"] == "Namespace" or obj["metadata"]["namespace"] == "splitserve", obj["metadata"]


def _options(command: str) -> set[str]:
    out = subprocess.run([sys.executable, "-m", "splitserve.cli", command, "--help"], capture_output=True, text=True,
                         timeout=120, cwd=REPO, env=dict(os.environ, COLUMNS="200"))
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"(--[a-z0-9][a-z0-9-]*)", out.stdout))


def test_every_flag_the_containers_pass_is_one_splitserve_has(objects):
    known = {"serve": _options("serve"), "router": _options("router")}
    seen = set()
    for name, dep in by_kind(objects, "Deployment").items():
        for container in dep["spec"]["template"]["spec"]["containers"]:
            command, *args = container["args"]
            flags = {a.split("=")[0] for a in args if a.startswith("--")}
            assert flags <= known[command], f"{name}: not in `splitserve {command} --help`: {flags - known[command]}"
            assert all(a.startswith("--") for a in args), args  # every value with its flag (--flag=value)
            seen.add(command)
    assert seen == {"serve", "router"}


def _flag(container: dict, flag: str) -> str:
    values = [a.split("=", 1)[1] for a in container["args"] if a.split("=")[0] == flag]
    assert len(values) == 1, f"{flag} given {len(values)} times"
    return values[0]


def test_the_workers_pods_cover_their_drain_and_cpu_bounds(objects):
    from splitserve.server.process import END_GRACE_S

    deployments, services = by_kind(objects, "Deployment"), by_kind(objects, "Service")
    for role in ("prefill", "decode"):
        pod = deployments[f"splitserve-{role}"]["spec"]["template"]
        assert pod["metadata"]["labels"]["splitserve.io/role"] == role
        spec = pod["spec"]
        (c,) = spec["containers"]
        assert _flag(c, "--role") == role and _flag(c, "--discovery").startswith("etcd://")
        assert _flag(c, "--advertise-host") == "$(POD_IP)"
        env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in c["env"]}
        assert env["POD_IP"] == "status.podIP"
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        # the drain: preStop, then the grace (lease revoked first), the drain timeout, the handlers
        pre_stop = float(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        needed = pre_stop + float(_flag(c, "--discovery-grace-s")) + float(_flag(c, "--drain-timeout-s")) + END_GRACE_S
        assert spec["terminationGracePeriodSeconds"] >= needed + 5, (spec["terminationGracePeriodSeconds"], needed)
        # CPU: requests equal limits (no throttling), and --threads matches them
        res = c["resources"]
        assert res["requests"] == res["limits"], res
        assert int(_flag(c, "--threads")) == int(res["limits"]["cpu"])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["http"] == int(_flag(c, "--port"))
        # a decode too: it may become a prefill (POST /role), and a prefill listens there from its start
        assert ports["bootstrap"] == int(_flag(c, "--bootstrap-port")), (role, ports)
        (volume,) = [v for v in spec["volumes"] if "secret" in v]
        assert volume["secret"]["defaultMode"] == 0o400
        for flag in ("--cluster-secret-file", "--worker-api-key-file", "--metrics-api-key-file"):
            path = _flag(c, flag)
            mount = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
            assert mount and mount[0]["readOnly"], (flag, path)
            assert os.path.basename(path) in {i["path"] for i in volume["secret"]["items"]}
        assert services[f"splitserve-{role}"]["metadata"]["labels"]["splitserve.io/scrape"] == "true"
    monitor = by_kind(objects, "ServiceMonitor")["splitserve"]
    assert monitor["spec"]["selector"]["matchLabels"] == {"splitserve.io/scrape": "true"}
    assert monitor["spec"]["endpoints"][0]["authorization"]["credentials"]["key"] == "metrics-api-key"
