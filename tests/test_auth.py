"""API keys (``splitserve/auth.py``, ``docs/security.md``): how a key is loaded, and a real router
in front of real keyed workers: the official ``openai`` client without a key, with a wrong one and
with the right one; the router reaches its workers with their own key, never the client's; what
stays open (``/health``), what ``/metrics`` takes, and which key opens each route (docs/security.md)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from cluster import Cluster, RouterProcess, pages_back_to_total
from conftest import REPO
from helpers.fake_engine import FullFakeEngine
from splitserve.auth import load_key

openai = pytest.importorskip("openai")

CLIENT_KEY = "client-key-0123456789"
WORKER_KEY = "worker-key-9876543210"
ADMIN_KEY = "admin-key-5555555555"
METRICS_KEY = "metrics-key-7777777777"
WORKERS_CLIENT_KEY = "a-worker-s-own-client-key"


def key_file(tmp_path_factory, name: str, key: str) -> str:
    path = tmp_path_factory.mktemp("keys") / name
    path.write_text(key + "\n")
    os.chmod(path, 0o600)
    return str(path)


def test_a_key_comes_from_the_flag_its_file_or_the_environment(tmp_path):
    path = tmp_path / "key"
    path.write_text("from-file\nignored second line\n")
    env = {"SPLITSERVE_API_KEY": "from-env"}
    assert load_key("from-flag", None, "SPLITSERVE_API_KEY", environ=env) == "from-flag"
    assert load_key(None, str(path), "SPLITSERVE_API_KEY", environ=env) == "from-file"
    assert load_key(None, None, "SPLITSERVE_API_KEY", environ=env) == "from-env"
    assert load_key(None, None, "SPLITSERVE_API_KEY", environ={}) is None


@pytest.mark.parametrize("value, path, words", [
    ("a", "/x", "two keys"),
    ("   ", None, "empty"),
    ("has space", None, "printable ASCII without spaces"),
    (None, "/nonexistent/key", "cannot read"),
])
def test_a_bad_key_is_refused_naming_where_it_came_from(value, path, words):
    with pytest.raises(ValueError, match=words) as info:
        load_key(value, path, "SPLITSERVE_API_KEY", environ={})
    assert "has space" not in str(info.value)  # a key is never repeated in a message


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    client, worker = key_file(tmp_path_factory, "client", CLIENT_KEY), key_file(tmp_path_factory, "worker", WORKER_KEY)
    admin = key_file(tmp_path_factory, "admin", ADMIN_KEY)
    cluster = Cluster(prefill=1, decode=1, backend="tcp",
                      worker_args=["--worker-api-key-file", worker, "--admin-api-key-file", admin],
                      router_args=["--api-key-file", client, "--worker-api-key-file", worker, "--admin-api-key-file",
                                   admin])
    with cluster:
        yield cluster


def test_the_openai_client_needs_the_router_s_key(keyed):
    base = keyed.url + "/v1"
    no_key = {"Authorization": openai.omit}  # the client then sends no Authorization header at all
    for key, headers in ((CLIENT_KEY, no_key), ("wrong-key", None), (WORKER_KEY, None)):  # the workers' is not ours
        client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as info:
            client.completions.create(model="tiny", prompt="Hello", max_tokens=4, extra_headers=headers)
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client.models.list(extra_headers=headers)
    client = openai.OpenAI(base_url=base, api_key=CLIENT_KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    counts = requests.get(keyed.url + "/metrics", timeout=10, headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
    assert 'splitserve_http_unauthorized_total{why="missing"} 2' in counts
    assert 'splitserve_http_unauthorized_total{why="wrong"} 4' in counts
    for w in keyed.workers:
        pages_back_to_total(w, api_key=WORKER_KEY)


def test_workers_take_only_their_own_key_and_the_router_sends_it(keyed):
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
    for w in keyed.workers:
        for headers in ({}, {"Authorization": f"Bearer {CLIENT_KEY}"}, {"Authorization": f"Basic {WORKER_KEY}"}):
            for method, path in (("POST", "/generate"), ("GET", "/v1/models"), ("GET", "/get_server_info"),
                                 ("GET", "/get_model_info"), ("GET", "/debug/requests")):
                r = requests.request(method, w.url + path, json=body, headers=headers, timeout=10)
                assert r.status_code == 401, (w.role, path, headers, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["WWW-Authenticate"]
        assert requests.get(w.url + "/health", timeout=10).status_code == 200
        assert requests.get(w.url + "/metrics", timeout=10).status_code == 401
        assert requests.get(w.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                            timeout=10).status_code == 200
        r = requests.get(w.url + "/get_model_info", headers={"Authorization": f"Bearer {WORKER_KEY}"}, timeout=10)
        assert r.status_code == 200
    # through the router, with the clients' key: the workers got theirs
    r = requests.post(keyed.url + "/generate", json=body, headers={"Authorization": f"Bearer {CLIENT_KEY}"},
                      timeout=60)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2


def test_top_reads_a_keyed_deployment_with_the_operators_key(keyed, tmp_path):
    """``splitserve top --once`` through the keyed router: with the admin key (its file, or the
    environment) it shows both workers; without it, the router's 401."""
    def top(*args, **env):
        out = subprocess.run([sys.executable, "-m", "splitserve.cli", "top", "--once", "--router", keyed.url, *args],
                             capture_output=True, text=True, timeout=60, cwd=REPO,
                             env={**os.environ, "COLUMNS": "300", "PYTHONPATH": str(REPO), **env})
        assert out.returncode == 0, out.stderr
        return out.stdout

    admin = tmp_path / "admin"
    admin.write_text(ADMIN_KEY + "\n")
    admin.chmod(0o600)
    for shown in (top("--admin-api-key-file", str(admin)), top(SPLITSERVE_ADMIN_API_KEY=ADMIN_KEY)):
        assert "2 workers" in shown and "HTTP" not in shown and "unreachable" not in shown, shown
        assert all(w.url in shown for w in keyed.workers), shown
    assert f"router {keyed.url}: HTTP 401" in top()


@pytest.mark.parametrize("side", ["router", "worker"])
def test_metrics_need_a_key_wherever_a_key_is_set(side, byte_tokenizer):
    """The prefix cache's counters tell whether a prompt was served before: with a client key only,
    /metrics takes that key (its fallback) and refuses anonymous readers; --no-protect-metrics
    opens it to anyone, and a process without keys is open."""
    from aiohttp.test_utils import TestClient, TestServer

    from splitserve.config import RouterConfig, ServerConfig, WorkerAddress
    from splitserve.router.app import create_app as router_app
    from splitserve.server.app import create_app as worker_app

    def app(**keys):
        if side == "router":
            down = "http://127.0.0.1:9"
            return router_app(RouterConfig(prefill=(WorkerAddress(down, 9),), decode=(WorkerAddress(down),), **keys))
        return worker_app(FullFakeEngine(byte_tokenizer), ServerConfig(**keys))

    keyed = {"Authorization": f"Bearer {CLIENT_KEY}"}

    async def status(application, headers=None) -> int:
        async with TestClient(TestServer(application)) as client:
            r = await client.get("/metrics", headers=headers or {})
            text = await r.text()
            assert r.status != 200 or "splitserve_http_unauthorized_total" in text
            return r.status

    async def main():
        assert await status(app(api_key=CLIENT_KEY)) == 401
        assert await status(app(api_key=CLIENT_KEY), keyed) == 200
        assert await status(app(api_key=CLIENT_KEY, protect_metrics=False)) == 200
        assert await status(app()) == 200
    asyncio.run(main())


def test_a_bad_key_file_exits_2_naming_it(tmp_path, capsys):
    from splitserve.cli import main

    empty = tmp_path / "key"
    empty.write_text("\n")
    for argv in (["router", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:9",
                  "--worker-api-key-file", str(empty)],
                 ["serve", "--api-key-file", str(empty)]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert f"-api-key-file {empty}: the API key is empty" in capsys.readouterr().err


# -- which key opens which route: docs/security.md's tables, against the real apps ---------------------------------

SECURITY_MD = Path(__file__).resolve().parent.parent / "docs" / "security.md"
ALL_KEYS = {"client": CLIENT_KEY, "worker": WORKER_KEY, "admin": ADMIN_KEY, "metrics": METRICS_KEY}


def doc_tables() -> tuple[dict, dict]:
    """docs/security.md's route table ({(method, path): {"router": class, "worker": class}}, "-"
    where the app has no such route) and class table ({class: {"router": keys, "worker": keys}})."""
    text = SECURITY_MD.read_text()
    routes = {(m, path): {"router": r, "worker": w} for m, path, r, w in
              re.findall(r"^\| `(GET|POST|DELETE) (\S+)` \| (\S+) \| (\S+) \|$", text, re.M)}
    classes = {}
    for name, router, worker in re.findall(r"^\| (open|client|metrics|admin) \| ([^|]+) \| ([^|]+) \|$", text, re.M):
        classes[name] = {side: None if keys.strip() == "anyone" else {k.strip() for k in keys.split(",")}
                         for side, keys in (("router", router), ("worker", worker))}
    assert routes and set(classes) == {"open", "client", "metrics", "admin"}, "the tables of docs/security.md moved"
    return routes, classes


def app_routes(app) -> set:
    return {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}


def concrete(path: str) -> str:
    return path.replace("{rid}", "some-rid").replace("{room}", "7").replace("{id}", "some-id")


async def walk(client, side: str, routes: set, doc_routes: dict, classes: dict) -> list[str]:
    """Every route with no key, an unknown key and each key of ``ALL_KEYS``; what differs from the docs."""
    wrong = []
    for method, path in sorted(routes):
        kind = doc_routes[(method, path)][side]
        openers = classes[kind][side]
        for name, key in [("none", None), ("unknown", "not-a-key-of-ours"), *ALL_KEYS.items()]:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = await client.request(method, concrete(path), headers=headers, json={})
            await r.read()
            if openers is None or name in openers:
                expected = "not 401/403"
                ok = r.status not in (401, 403)
            else:
                expected = 403 if name in ALL_KEYS and not (side == "router" and name == "worker") else 401
                ok = r.status == expected
            if not ok:
                wrong.append(f"{side} {method} {path} with the {name} key: {r.status}, the docs say {expected}")
    return wrong


def test_every_route_opens_with_the_keys_of_this_table(byte_tokenizer):
    """Each route of the router's app and the worker's app, with every key, against docs/security.md;
    every route of each app is in the table (a route added later without a row fails here)."""
    from aiohttp.test_utils import TestClient, TestServer

    from splitserve.config import RouterConfig, ServerConfig, WorkerAddress
    from splitserve.router.app import create_app as router_app
    from splitserve.server.app import create_app as worker_app

    doc_routes, classes = doc_tables()
    down = "http://127.0.0.1:9"
    apps = {
        "router": lambda: router_app(RouterConfig(
            prefill=(WorkerAddress(down, 9),), decode=(WorkerAddress(down),), api_key=CLIENT_KEY,
            admin_api_key=ADMIN_KEY, metrics_api_key=METRICS_KEY, worker_api_key=WORKER_KEY, protect_metrics=True)),
        "worker": lambda: worker_app(FullFakeEngine(byte_tokenizer), ServerConfig(
            api_key=WORKERS_CLIENT_KEY, worker_api_key=WORKER_KEY, admin_api_key=ADMIN_KEY,
            metrics_api_key=METRICS_KEY, protect_metrics=True)),
    }
    keys = dict(ALL_KEYS)

    async def main():
        wrong = []
        for side, make in apps.items():
            app = make()
            routes = app_routes(app)
            documented = {route for route, sides in doc_routes.items() if sides[side] != "-"}
            assert routes == documented, f"{side}: routes without a row in docs/security.md: " \
                                         f"{routes - documented}; rows without a route: {documented - routes}"
            ALL_KEYS["client"] = CLIENT_KEY if side == "router" else WORKERS_CLIENT_KEY
            async with TestClient(TestServer(app)) as client:
                wrong += await walk(client, side, routes, doc_routes, classes)
        return wrong

    try:
        wrong = asyncio.run(main())
    finally:
        ALL_KEYS.update(keys)
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("side", ["router", "worker"])
def test_a_client_key_never_opens_the_admin_routes(side, byte_tokenizer):
    """With only a client key, /flush_cache and the debug routes are closed to it (403) and to
    anyone (401); generation and /metrics (its fallback) take it."""
    from aiohttp.test_utils import TestClient, TestServer

    from splitserve.config import RouterConfig, ServerConfig, WorkerAddress
    from splitserve.router.app import create_app as router_app
    from splitserve.server.app import create_app as worker_app

    if side == "router":
        app = router_app(RouterConfig(prefill=(WorkerAddress("http://127.0.0.1:9", 9),),
                                      decode=(WorkerAddress("http://127.0.0.1:9"),), api_key=CLIENT_KEY,
                                      protect_metrics=True))
        admin = [("POST", "/flush_cache"), ("GET", "/workers"), ("GET", "/debug/requests/x")]
    else:
        app = worker_app(FullFakeEngine(byte_tokenizer), ServerConfig(api_key=CLIENT_KEY, protect_metrics=True))
        admin = [("POST", "/flush_cache"), ("GET", "/debug/requests"), ("GET", "/debug/rooms/1")]
    keyed = {"Authorization": f"Bearer {CLIENT_KEY}"}

    async def main():
        async with TestClient(TestServer(app)) as client:
            for method, path in admin:
                r = await client.request(method, path, headers=keyed)
                body = await r.json()
                assert r.status == 403 and body["error"]["code"] == "permission_denied", (path, r.status, body)
                assert "--admin-api-key" in body["error"]["message"]
                assert (await client.request(method, path)).status == 401
            assert (await client.get("/metrics", headers=keyed)).status == 200
            assert (await client.get("/metrics")).status == 401
            r = await client.post("/v1/completions", headers=keyed, json={"prompt": "Hi", "max_tokens": 1})
            assert r.status not in (401, 403)
            metrics = await (await client.get("/metrics", headers=keyed)).text()
            assert 'splitserve_http_unauthorized_total{why="forbidden"} 3' in metrics
    asyncio.run(main())


@pytest.mark.parametrize("on_worker, given, client, metrics, admin", [
    # no key at all: everything open
    (False, (), "open", "open", "open"),
    (True, (), "open", "open", "open"),
    # a client key alone: /metrics falls back to it, admin is closed
    (False, ("client",), {"client"}, {"client"}, set()),
    (True, ("client",), {"client"}, {"client"}, set()),
    # an admin key alone: generation open, metrics and admin by the admin key
    (False, ("admin",), "open", {"admin"}, {"admin"}),
    # a metrics key alone: generation open, admin closed
    (False, ("metrics",), "open", {"metrics"}, set()),
    # the router's key on a worker opens everything there; a client key beside it opens generation too
    (True, ("worker",), {"worker"}, {"worker"}, {"worker"}),
    (True, ("client", "worker"), {"client", "worker"}, {"worker"}, {"worker"}),
    (True, ("client", "worker", "admin", "metrics"), {"client", "worker"}, {"metrics", "admin", "worker"},
     {"admin", "worker"}),
])
def test_with_some_keys_only_each_class_falls_back_as_documented(on_worker, given, client, metrics, admin):
    from splitserve.auth import Access

    access = Access({name: ALL_KEYS[name].encode() for name in given}, on_worker)
    for kind, want in (("open", "open"), ("client", client), ("metrics", metrics), ("admin", admin),
                       ("a class added later", admin)):
        got = access.openers(kind)
        assert (got is None and want == "open") or got == want, (kind, got, want)


def test_one_key_in_two_roles_is_refused():
    from splitserve.auth import with_keys
    from splitserve.config import RouterConfig, ServerConfig

    with pytest.raises(ValueError, match="--api-key and --admin-api-key are the same key"):
        with_keys(RouterConfig(api_key="k" * 20, admin_api_key="k" * 20), environ={})
    with pytest.raises(ValueError, match="--api-key and --worker-api-key are the same key"):
        with_keys(ServerConfig(api_key="k" * 20), environ={"SPLITSERVE_WORKER_API_KEY": "k" * 20})


def test_a_keyed_router_s_health_shows_status_only_to_anonymous_callers():
    """Anonymous callers (and the clients' key) see only the status; a key that reads /metrics also
    sees each worker's URL, load and last error."""
    from aiohttp.test_utils import TestClient, TestServer

    from splitserve.config import RouterConfig, WorkerAddress
    from splitserve.router.app import create_app

    down = "http://127.0.0.1:9"
    app = create_app(RouterConfig(prefill=(WorkerAddress(down, 9),), decode=(WorkerAddress(down),),
                                  api_key=CLIENT_KEY, admin_api_key=ADMIN_KEY, metrics_api_key=METRICS_KEY))

    async def main():
        async with TestClient(TestServer(app)) as client:
            for key in (None, CLIENT_KEY, "not-a-key"):
                r = await client.get("/health", headers={"Authorization": f"Bearer {key}"} if key else {})
                assert r.status == 503 and await r.json() == {"status": "unavailable"}, key
            for key in (ADMIN_KEY, METRICS_KEY):
                r = await client.get("/health", headers={"Authorization": f"Bearer {key}"})
                body = await r.json()
                assert r.status == 503 and body["prefill"][0]["url"] == down and "error" in body["decode"][0]
    asyncio.run(main())


# -- who may name the prefill a decode worker dials (the bootstrap fields) ----------------------------------------

FIELDS = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 12345}


@pytest.mark.parametrize("role, config, calls", [
    # the router's key set: only its holder sends bootstrap fields (the clients' key may generate without them)
    ("decode", {"api_key": CLIENT_KEY, "worker_api_key": WORKER_KEY},
     [(CLIENT_KEY, FIELDS, "--worker-api-key"), (WORKER_KEY, FIELDS, None), (CLIENT_KEY, {}, None)]),
    ("prefill", {"api_key": CLIENT_KEY, "worker_api_key": WORKER_KEY},
     [(CLIENT_KEY, FIELDS, "--worker-api-key"), (WORKER_KEY, FIELDS, None)]),
    # no router's key: decode takes the addresses on its list only (an address, a host, a network)
    ("decode", {"allowed_prefill": "127.0.0.1:8998,prefill-3.internal,10.1.0.0/16"},
     [(None, FIELDS, None), (None, {**FIELDS, "bootstrap_port": 8999}, "--allowed-prefill"),
      (None, {**FIELDS, "bootstrap_host": "PREFILL-3.internal", "bootstrap_port": 1}, None),
      (None, {**FIELDS, "bootstrap_host": "10.1.200.3"}, None),
      (None, {**FIELDS, "bootstrap_host": "10.2.0.1"}, "--allowed-prefill"),
      (None, {**FIELDS, "bootstrap_host": "evil.example"}, "--allowed-prefill")]),
    # both: the router's key, and its list too
    ("decode", {"worker_api_key": WORKER_KEY, "allowed_prefill": "127.0.0.1:8998"},
     [(WORKER_KEY, FIELDS, None), (WORKER_KEY, {**FIELDS, "bootstrap_port": 9000}, "--allowed-prefill")]),
    # neither (run_server refuses to start so; an app built without it refuses every address)
    ("decode", {}, [(None, FIELDS, "was given neither")]),
])
def test_bootstrap_fields_come_only_from_the_router_or_an_allowed_address(role, config, calls, byte_tokenizer):
    """A decode worker dials the address the bootstrap fields name and hands it its KV pool's link;
    so they are taken only from the router's key, or for an address on the list."""
    from aiohttp.test_utils import TestClient, TestServer

    from splitserve.config import ServerConfig
    from splitserve.server.app import create_app

    app = create_app(FullFakeEngine(byte_tokenizer), ServerConfig(role=role, **config))

    async def main():
        async with TestClient(TestServer(app)) as client:
            for key, fields, refused in calls:
                r = await client.post("/generate", headers={"Authorization": f"Bearer {key}"} if key else {},
                                      json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}, **fields})
                body = await r.json()
                if refused is None:
                    assert r.status == 200, (key, fields, body)
                else:
                    assert r.status == 403 and body["error"]["code"] == "bootstrap_not_allowed", (key, fields, body)
                    assert refused in body["error"]["message"], body
    asyncio.run(main())


def test_a_prefill_refuses_a_leg_that_names_another_bootstrap_port(byte_tokenizer):
    """A router that has not yet seen a worker switch from decode to prefill (POST /role) may still
    send it a decode leg: the same fields, naming another prefill's bootstrap port. Taken as a
    prefill room, that leg and the real prefill's both waited for a registration that never came
    (bootstrap_timeout after 60 s, seen in a full run). A prefill refuses it with 503 before
    accepting the room, which the router retries elsewhere with a fresh room."""
    from aiohttp.test_utils import TestClient, TestServer

    from splitserve.config import ServerConfig
    from splitserve.server.app import create_app

    app = create_app(FullFakeEngine(byte_tokenizer), ServerConfig(role="prefill", bootstrap_port=8998))

    async def main():
        async with TestClient(TestServer(app)) as client:
            statuses = []
            for port in (8998, 9000):
                r = await client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2},
                                                         **{**FIELDS, "bootstrap_port": port}})
                statuses.append((r.status, (await r.json()).get("error", {}).get("message", "")))
            assert statuses[0][0] == 200, statuses
            assert statuses[1][0] == 503 and "a decode leg" in statuses[1][1], statuses
    asyncio.run(main())


def test_a_decode_worker_that_would_trust_any_address_does_not_start(tmp_path):
    """Neither the router's key nor --allowed-prefill: exit 2 naming both, before the model loads."""
    out = subprocess.run([sys.executable, "-m", "splitserve.cli", "serve", "--role", "decode", "--port", "0"],
                         capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO), "SPLITSERVE_WORKER_API_KEY": ""})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--worker-api-key" in out.stderr and "--allowed-prefill" in out.stderr, out.stderr[-2000:]
