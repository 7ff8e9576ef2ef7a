"""Our prefill and decode workers behind SGLang's own gateway (`sglang_router.launch_router
--pd-disaggregation`, the pinned sglang-router 0.3.2): it probes /health, /get_server_info and
/get_model_info, then posts /generate and /v1/* with the bootstrap fields to both workers. The
tokens must equal a colocated server's (the session's ``server``)."""

from __future__ import annotations

import random
import subprocess
import sys
import time

import pytest
import requests

from cluster import pages_back_to_total
from conftest import ServerProcess, free_port

pytest.importorskip("sglang_router")

WORKER_KEY = "the-workers-key"
KEYED = {"Authorization": f"Bearer {WORKER_KEY}"}


@pytest.fixture(scope="module")
def gateway(server):
    bootstrap = free_port()
    keyed = {"SPLITSERVE_WORKER_API_KEY": WORKER_KEY}  # the gateway is the workers' router
    procs = [ServerProcess("--role", "prefill", "--bootstrap-port", str(bootstrap), env=keyed),
             ServerProcess("--role", "decode", env=keyed)]
    router = None
    try:
        for proc in procs:  # both start at once
            proc._spawn(free_port())
        for proc in procs:
            proc.wait_ready()
        (prefill, decode), colocated = procs, server
        port = free_port()
        router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
             "--prefill", prefill.url, str(bootstrap), "--decode", decode.url,
             "--host", "127.0.0.1", "--port", str(port), "--api-key", WORKER_KEY],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                r = requests.post(url + "/generate", json={"input_ids": [11], "sampling_params": {"max_new_tokens": 1}},
                                  headers=KEYED, timeout=10)
                if r.status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert router.poll() is None, "sglang_router exited"
            time.sleep(0.5)
        else:
            pytest.fail("sglang_router never answered")
        yield url, prefill, decode, colocated
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        for proc in procs:
            proc.stop()


def test_generate_through_sglang_gateway_matches_colocated(gateway):
    url, prefill, decode, colocated = gateway
    rng = random.Random(3)
    for n in (1, 16, 17, 100, 700, 1500):
        body = {"input_ids": [rng.randint(10, 2047) for _ in range(n)],
                "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        via_gateway = requests.post(url + "/generate", json=body, headers=KEYED, timeout=60)
        reference = requests.post(colocated.url + "/generate", json=body, timeout=60)
        assert via_gateway.status_code == 200, via_gateway.text
        assert via_gateway.json()["output_ids"] == reference.json()["output_ids"], f"prompt of {n} tokens"


@pytest.mark.parametrize("endpoint, body", [
    ("/v1/completions", {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}],
                              "max_tokens": 12, "temperature": 0}),
])
def test_openai_endpoints_through_sglang_gateway_match_colocated(gateway, endpoint, body):
    url, prefill, decode, colocated = gateway
    got = requests.post(url + endpoint, json=body, headers=KEYED, timeout=60)
    want = requests.post(colocated.url + endpoint, json=body, timeout=60)
    assert got.status_code == 200, got.text

    def text(r):
        choice = r.json()["choices"][0]
        return choice.get("text", choice.get("message", {}).get("content"))

    assert text(got) == text(want)
    assert got.json()["usage"] == want.json()["usage"]


def test_pages_come_back_after_the_gateway_runs(gateway):
    _, prefill, decode, _ = gateway
    for worker in (prefill, decode):
        samples = pages_back_to_total(worker, 10, api_key=WORKER_KEY)  # raises if they never do
        assert samples[("splitserve_kv_pages_free", frozenset())] == samples[("splitserve_kv_pages_total", frozenset())]


def test_the_workers_behind_the_gateway_refuse_requests_without_its_key(gateway):
    _, prefill, decode, _ = gateway
    body = {"input_ids": [11, 12], "sampling_params": {"max_new_tokens": 1}}
    for worker in (prefill, decode):
        assert requests.post(worker.url + "/generate", json=body, timeout=10).status_code == 401
        assert requests.get(worker.url + "/get_server_info", timeout=10).status_code == 401
