"""API keys (``splitserve/auth.py``, ``docs/security.md``): how a key is loaded, and a real router
in front of real keyed workers: the official ``openai`` client without a key, with a wrong one and
with the right one; the router reaches its workers with their own key, never the client's; what
stays open (``/health``, ``/metrics``) and what ``--protect-metrics`` closes."""

from __future__ import annotations

import os

import pytest
import requests

from cluster import Cluster, RouterProcess, pages_back_to_total
from splitserve.auth import load_key

openai = pytest.importorskip("openai")

CLIENT_KEY = "client-key-0123456789"
WORKER_KEY = "worker-key-9876543210"


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
    cluster = Cluster(prefill=1, decode=1, backend="tcp", worker_args=["--api-key-file", worker],
                      router_args=["--api-key-file", client, "--worker-api-key-file", worker])
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
    counts = requests.get(keyed.url + "/metrics", timeout=10).text  # open without --protect-metrics
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
        assert requests.get(w.url + "/metrics", timeout=10).status_code == 200
        r = requests.get(w.url + "/get_model_info", headers={"Authorization": f"Bearer {WORKER_KEY}"}, timeout=10)
        assert r.status_code == 200
    # through the router, with the clients' key: the workers got theirs
    r = requests.post(keyed.url + "/generate", json=body, headers={"Authorization": f"Bearer {CLIENT_KEY}"},
                      timeout=60)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2


def test_protect_metrics_closes_metrics_but_never_health(tmp_path_factory):
    client = key_file(tmp_path_factory, "client", CLIENT_KEY)
    router = RouterProcess([("http://127.0.0.1:9", 9)], ["http://127.0.0.1:9"], "--api-key-file", client,
                           "--protect-metrics", wait_healthy=False).start()
    try:
        assert requests.get(router.url + "/health", timeout=5).status_code == 503  # no worker up, but open
        assert requests.get(router.url + "/metrics", timeout=5).status_code == 401
        ok = requests.get(router.url + "/metrics", headers={"Authorization": f"Bearer {CLIENT_KEY}"}, timeout=5)
        assert ok.status_code == 200 and "splitserve_http_unauthorized_total" in ok.text
    finally:
        router.stop()


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
