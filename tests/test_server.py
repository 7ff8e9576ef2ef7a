"""The worker's HTTP front end.

Two halves:

- In process, around a scripted :class:`FakeEngine` (no model): the paths a real engine rarely
  takes on demand (an engine error mid-stream, a bug in ``submit``, a full queue, a client that
  hangs up while a request waits) are driven exactly, and we check what the client sees and that
  the engine was told to abort.
- Against real ``splitserve serve --model tiny`` processes (``conftest.ServerProcess``): every
  endpoint's shape, the 400/404 error bodies, streaming equal to non-streaming, disconnects
  freeing KV pages, 429, SIGTERM drain and ``/metrics``. One shared server, plus one small
  server for the 429 and drain checks.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
import types

import aiohttp
import pytest
import requests
from aiohttp.test_utils import TestClient, TestServer
from conftest import ServerProcess, free_port
from helpers.fake_engine import FakeEngine
from helpers.sse import sse_events

from splitserve.config import EngineConfig, ServerConfig
from splitserve.metrics import parse_exposition
from splitserve.server.app import create_app
from splitserve.server.state import STATE

# =============================================================================================
# In process, with a fake engine
# =============================================================================================


def run_app(engine, test, **runner_kwargs):
    """Run ``await test(client, app)`` against the app on a loopback TestServer."""
    async def main():
        app = create_app(engine, ServerConfig())
        server = TestServer(app, handler_cancellation=True, **runner_kwargs)
        async with TestClient(server) as client:
            await test(client, app)
    asyncio.run(main())


def test_flush_cache_answers_what_it_dropped_or_503_while_the_loop_is_busy(byte_tokenizer):
    engine = FakeEngine(byte_tokenizer)
    answers = iter([12, TimeoutError()])

    def flush_cache():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    engine.flush_cache = flush_cache

    async def test(client, app):
        r = await client.post("/flush_cache")
        assert r.status == 200 and await r.json() == {"flushed_pages": 12}
        r = await client.post("/flush_cache")  # the engine loop in a step longer than the wait
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        error = (await r.json())["error"]
        assert error["code"] == "loop_busy" and "try again" in error["message"]
    run_app(engine, test)


def test_fake_engine_error_without_streaming_uses_its_status(byte_tokenizer):
    async def test(client, app):
        r = await client.post("/v1/completions", json={"prompt": "FAIL now", "max_tokens": 10})
        assert r.status == 503
        body = await r.json()
        assert body["error"]["message"] == "the peer was lost" and body["error"]["type"] == "service_unavailable"
        assert set(body["error"]) == {"message", "type", "param", "code"}
    run_app(FakeEngine(byte_tokenizer), test)


@pytest.mark.parametrize("endpoint,body", [
    ("/v1/completions", {"prompt": "FAIL now", "max_tokens": 10, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "FAIL"}], "max_tokens": 10, "stream": True,
                              "stream_options": {"include_usage": True}}),
    ("/generate", {"text": "FAIL now", "sampling_params": {"max_new_tokens": 10}, "stream": True}),
])
def test_fake_engine_error_mid_stream_is_an_error_event_then_done(byte_tokenizer, endpoint, body):
    async def test(client, app):
        r = await client.post(endpoint, json=body)
        assert r.status == 200
        events = sse_events(await r.text(), strict=True)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["message"] == "the peer was lost"
        for e in events[:-2]:  # nothing before the error claims the request finished
            assert all(c.get("finish_reason") is None for c in e.get("choices", []))
            assert e.get("meta_info", {}).get("finish_reason") is None
            assert "usage" not in e
    run_app(FakeEngine(byte_tokenizer), test)


class GatedTokenizer:
    """``byte_tokenizer`` whose tokenizing of a text holding ``LONG`` waits until the gate opens
    (or 60 s), counting the tokenizations begun and ended; its copies share the gate and counts."""

    def __init__(self, inner, gate=None, counts=None):
        self.inner = inner
        self.gate = gate or threading.Event()
        self.counts = counts if counts is not None else {"begun": 0, "ended": 0}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __len__(self):
        return len(self.inner)

    def __deepcopy__(self, memo):
        import copy

        return GatedTokenizer(copy.deepcopy(self.inner, memo), self.gate, self.counts)

    def encode(self, text, *a, **kw):
        if "LONG" in text:
            self.counts["begun"] += 1
            self.gate.wait(60)
            self.counts["ended"] += 1
        return self.inner.encode(text, *a, **kw)


def test_a_short_request_is_not_held_behind_long_tokenizations(byte_tokenizer):
    """Two long prompts are being tokenized (their tokenizer waits on a gate); a short request sent
    then is answered while both are still held, and they are answered once the gate opens. With
    one tokenizer thread the short one would wait behind them."""
    from splitserve.server.tokenize_lanes import SHORT_BODY_BYTES

    tok = GatedTokenizer(byte_tokenizer)
    body = b'{"prompt": "LONG", "max_tokens": 2' + b" " * SHORT_BODY_BYTES + b"}"  # a long body: the long lane

    async def test(client, app):
        try:
            longs = [asyncio.ensure_future(client.post("/v1/completions", data=body,
                                                       headers={"Content-Type": "application/json"}))
                     for _ in range(2)]
            for _ in range(600):
                if tok.counts["begun"]:
                    break
                await asyncio.sleep(0.05)
            assert tok.counts["begun"] == 1  # the first is held, the second waits behind it in its lane
            r = await asyncio.wait_for(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 30)
            assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 2
            assert tok.counts == {"begun": 1, "ended": 0} and not any(t.done() for t in longs)
        finally:
            tok.gate.set()
        for t in longs:
            r = await asyncio.wait_for(t, 30)
            assert r.status == 200, await r.text()
        assert tok.counts == {"begun": 2, "ended": 2}
    run_app(FakeEngine(tok), test)


def test_fake_engine_bug_in_submit_is_a_500_and_the_worker_keeps_serving(byte_tokenizer, caplog):
    """The client reads the request id, the log the exception; the next request is served."""
    async def test(client, app):
        r = await client.post("/v1/completions", json={"prompt": "RAISE", "max_tokens": 3})
        message = (await r.json())["error"]["message"]
        assert r.status == 500 and message.startswith("internal error in the worker (request id ")
        assert "a bug in submit" not in message and "a bug in submit" in caplog.text
        r = await client.post("/v1/completions", json={"prompt": "fine", "max_tokens": 3})
        assert r.status == 200 and (await r.json())["choices"][0]["text"] == "fin"
    run_app(FakeEngine(byte_tokenizer), test)


def test_fake_engine_overloaded_is_429_with_retry_after(byte_tokenizer):
    async def test(client, app):
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
        assert (await r.json())["error"]["type"] == "rate_limit_error"
    run_app(FakeEngine(byte_tokenizer, capacity=0), test)


def test_fake_engine_not_ready_and_draining_are_503(byte_tokenizer):
    engine = FakeEngine(byte_tokenizer)
    engine.ready = False

    async def test(client, app):
        assert (await client.get("/health")).status == 503
        r = await client.post("/v1/completions", json={"prompt": "x"})
        assert r.status == 503 and (await r.json())["error"]["code"] == "not_ready"
        engine.ready = True
        assert (await client.get("/health")).status == 200
        app[STATE].draining = True
        r = await client.get("/health")
        assert r.status == 503 and (await r.json())["status"] == "draining"
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status == 503 and "draining" in (await r.json())["error"]["message"]
        assert engine.submitted == 0
    run_app(engine, test)


@pytest.mark.parametrize("stream", [False, True])
def test_fake_engine_client_disconnect_aborts_the_request(byte_tokenizer, stream):
    engine = FakeEngine(byte_tokenizer, delay=0.02)

    async def test(client, app):
        body = {"prompt": "hello", "max_tokens": 200, "stream": stream, "rid": "gone"}
        if stream:
            r = await client.post("/v1/completions", json=body)
            await r.content.readline()  # the first event has arrived: the request is live
            r.close()
        else:
            with pytest.raises(asyncio.TimeoutError):
                await client.post("/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.2))
        for _ in range(100):
            if "gone" in engine.aborted and not engine.live:
                break
            await asyncio.sleep(0.02)
        assert "gone" in engine.aborted and not engine.live
        metrics = parse_exposition(app[STATE].registry.exposition())
        key = ("splitserve_requests_total",
               frozenset({("role", "colocated"), ("outcome", "aborted"), ("reason", "client_abort")}))
        assert metrics[key] == 1
        assert metrics[("splitserve_http_inflight_requests", frozenset())] == 0
    run_app(engine, test)


def test_fake_engine_client_gone_before_the_first_event_still_ends_the_request(byte_tokenizer, monkeypatch):
    """The client leaves between submit and the first write: the engine stream, never iterated,
    must still be aborted and read to its end (else the engine would keep it forever)."""
    from splitserve.server import sse

    async def gone(self):
        raise sse.ClientGone()

    monkeypatch.setattr(sse.SSEWriter, "start", gone)
    engine = FakeEngine(byte_tokenizer, delay=0.01)

    async def test(client, app):
        r = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 200, "stream": True,
                                                       "rid": "early"})
        r.close()
        for _ in range(100):
            if not engine.live:
                break
            await asyncio.sleep(0.02)
        assert engine.aborted == ["early"] and not engine.live
    run_app(engine, test)


def test_fake_engine_unknown_route_and_method_get_json_errors(byte_tokenizer):
    async def test(client, app):
        r = await client.get("/v2/nothing")
        assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
        r = await client.get("/v1/completions")
        assert r.status == 405 and "POST" in r.headers["Allow"]
        r = await client.post("/v1/completions", data=b"\x00garbage")
        assert r.status == 400 and "JSON" in (await r.json())["error"]["message"]
    run_app(FakeEngine(byte_tokenizer), test)


# =============================================================================================
# Against real servers
# =============================================================================================


def post(server, path, body, **kw):
    kw.setdefault("timeout", 60)
    return requests.post(server.url + path, json=body, **kw)


def metrics_of(server) -> dict:
    r = requests.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    return parse_exposition(r.text)


def sample(metrics: dict, name: str, **labels) -> float:
    return metrics.get((name, frozenset(labels.items())), 0.0)


def wait_idle(server, timeout=30.0) -> dict:
    """Flush the prefix cache and poll /metrics until every KV page is free and both queues are empty."""
    deadline = time.monotonic() + timeout
    while True:
        requests.post(server.url + "/flush_cache", timeout=10)
        m = metrics_of(server)
        idle = (sample(m, "splitserve_kv_pages_free") == sample(m, "splitserve_kv_pages_total") > 0
                and sample(m, "splitserve_queue_requests", role="colocated", queue="waiting") == 0
                and sample(m, "splitserve_queue_requests", role="colocated", queue="running") == 0)
        if idle:
            return m
        assert time.monotonic() < deadline, f"not idle after {timeout}s: {m}"
        time.sleep(0.1)


def sse_stream(response):
    """Decoded events of a streaming response, as they arrive ([DONE] included)."""
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith(b"data: "), line
        payload = line[len(b"data: "):].decode()
        yield payload if payload == "[DONE]" else json.loads(payload)


@pytest.fixture(scope="module")
def info(server):
    models = requests.get(server.url + "/v1/models", timeout=10).json()
    return types.SimpleNamespace(model=models["data"][0]["id"], max_context=models["data"][0]["max_model_len"])


def test_ready_line_health_models_and_sglang_info(server, info):
    ready = [line for line in server.stdout().splitlines() if line.startswith("splitserve ready:")]
    assert ready and f"{server.url} (model tiny)" in ready[0] and f"curl {server.url}/v1/completions" in ready[0]
    assert info.model == "tiny"
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    models = requests.get(server.url + "/v1/models", timeout=10).json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    assert models["data"][0]["id"] == info.model and info.max_context > 0
    mi = requests.get(server.url + "/get_model_info", timeout=10).json()
    assert mi["is_generation"] is True and mi["model_path"] and mi["tokenizer_path"]
    si = requests.get(server.url + "/get_server_info", timeout=10).json()
    assert si["page_size"] == EngineConfig().page_size and si["context_length"] == info.max_context
    assert si["model_path"] == mi["model_path"] and si["max_total_num_tokens"] > 0
    assert si["kv_cache_dtype"] == "auto"  # what the pages hold: a memory bench counts their bytes by it


def test_completion_and_chat_shapes(server, info):
    r = post(server, "/v1/completions", {"model": info.model, "prompt": "Hello", "max_tokens": 5,
                                         "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == info.model
    assert isinstance(body["created"], int)
    choice = body["choices"][0]
    assert isinstance(choice["text"], str) and choice["finish_reason"] == "length" and choice["index"] == 0
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5

    r = post(server, "/v1/chat/completions", {"model": info.model, "max_tokens": 4, "temperature": 0,
                                              "messages": [{"role": "user", "content": "Hi there"}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert 1 <= body["usage"]["completion_tokens"] <= 4


def test_generate_with_text_and_input_ids(server):
    r = post(server, "/generate", {"text": "Once upon a time", "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    a = r.json()
    assert len(a["output_ids"]) == 6 and a["meta_info"]["completion_tokens"] == 6
    assert a["meta_info"]["finish_reason"] == {"type": "length"} and isinstance(a["text"], str)
    r = post(server, "/generate", {"input_ids": [5, 6, 7, 8], "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    b = r.json()
    assert len(b["output_ids"]) == 3 and b["meta_info"]["prompt_tokens"] == 4
    assert all(isinstance(t, int) for t in b["output_ids"])


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokenz": 2}, "max_tokenz"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools[0]"),
    ("/generate", {"text": "x", "sampling_params": {"top_k": -5}}, "sampling_params.top_k"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 10**7}}, "sampling_params.max_new_tokens"),
    ("/generate", {"input_ids": [1], "sampling_params": {"stop": [f"s{i}" for i in range(17)]}}, "sampling_params.stop"),
    ("/generate", {"input_ids": [1], "sampling_params": {"stop": "s" * 257}}, "sampling_params.stop"),
    ("/generate", {"input_ids": [1], "sampling_params": {"stop_token_ids": list(range(65))}},
     "sampling_params.stop_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": ["s" * 257]}, "stop"),
])
def test_bad_input_is_400_with_openai_error_body(server, path, body, param):
    kw = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = requests.post(server.url + path, timeout=30, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"]


def test_context_overflow_names_both_numbers_and_the_server_keeps_serving(server, info):
    r = post(server, "/v1/completions", {"prompt": [1] * (info.max_context - 2), "max_tokens": 10})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert str(info.max_context - 2) in msg and "10" in msg and str(info.max_context) in msg
    r = post(server, "/v1/completions", {"prompt": "still alive?", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    wait_idle(server)


def test_unknown_model_is_404(server):
    r = post(server, "/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_streaming_text_equals_non_streaming_text(server, path):
    if path == "/generate":
        body = {"text": "The quick brown fox", "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
    elif path == "/v1/completions":
        body = {"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0}
    else:
        body = {"messages": [{"role": "user", "content": "The quick brown fox"}], "max_tokens": 24,
                "temperature": 0}
    whole = post(server, path, body).json()
    r = post(server, path, dict(body, stream=True), stream=True)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = list(sse_stream(r))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    if path == "/generate":
        assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
        assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    elif path == "/v1/completions":
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
        assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    else:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert text == whole["choices"][0]["message"]["content"]
        assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_stream_include_usage_ends_with_a_usage_chunk(server):
    r = post(server, "/v1/completions", {"prompt": "Count", "max_tokens": 7, "ignore_eos": True, "stream": True,
                                         "stream_options": {"include_usage": True}}, stream=True)
    events = list(sse_stream(r))
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 7
    assert all("usage" not in e for e in events[:-2])


def _long_request(info, prompt="Tell me a very long story"):
    """A streaming request that runs to the context's end (ignore_eos)."""
    return {"prompt": prompt, "max_tokens": info.max_context - 64, "ignore_eos": True, "stream": True}


ABORTED = ("splitserve_requests_total",
           frozenset({("role", "colocated"), ("outcome", "aborted"), ("reason", "client_abort")}))


def wait_aborted(server, before: dict, timeout=30.0) -> None:
    deadline = time.monotonic() + timeout
    while metrics_of(server).get(ABORTED, 0) <= before.get(ABORTED, 0):
        assert time.monotonic() < deadline, "the disconnect was never noticed"
        time.sleep(0.1)


def test_client_disconnect_mid_stream_frees_pages(server, info):
    before = metrics_of(server)
    r = post(server, "/v1/completions", _long_request(info), stream=True)
    events = sse_stream(r)
    for _ in range(3):
        next(events)
    during = metrics_of(server)
    assert sample(during, "splitserve_kv_pages_free") < sample(during, "splitserve_kv_pages_total")
    r.close()  # hang up mid-stream
    wait_aborted(server, before)
    wait_idle(server)


def test_client_disconnect_while_waiting_frees_pages(server, info):
    before = metrics_of(server)
    body = dict(_long_request(info, "Another long story"), stream=False)
    with pytest.raises(requests.exceptions.Timeout):
        post(server, "/v1/completions", body, timeout=0.5)  # the client gives up and closes
    wait_aborted(server, before)
    wait_idle(server)


def test_metrics_has_the_required_series(server):
    post(server, "/v1/completions", {"prompt": "metrics", "max_tokens": 2})
    m = metrics_of(server)
    names = {name for name, _ in m}
    for name in ("splitserve_kv_pages_free", "splitserve_kv_pages_total", "splitserve_queue_requests",
                 "splitserve_requests_total", "splitserve_http_requests_total"):
        assert name in names, name
    assert sample(m, "splitserve_kv_pages_total") > 0
    assert ("splitserve_queue_requests", frozenset({("role", "colocated"), ("queue", "waiting")})) in m
    assert ("splitserve_queue_requests", frozenset({("role", "colocated"), ("queue", "running")})) in m
    assert sample(m, "splitserve_requests_total", role="colocated", outcome="finished", reason="length") >= 1
    assert sample(m, "splitserve_http_requests_total", path="/v1/completions", status="200") >= 1
    text = requests.get(server.url + "/metrics", timeout=10).text
    assert "# TYPE splitserve_requests_total counter" in text and "# HELP splitserve_kv_pages_free" in text


def test_queue_full_is_429_then_sigterm_drains(start_server):
    """One small server: a full waiting queue answers 429; then SIGTERM lets the request in flight
    end (error or finished), answers 503 to new requests during the drain and exits 0."""
    srv = start_server("--max-waiting-requests", "1", "--max-running-requests", "1", "--drain-timeout-s", "2")
    models = requests.get(srv.url + "/v1/models", timeout=10).json()["data"][0]
    info = types.SimpleNamespace(max_context=models["max_model_len"])

    first = post(srv, "/v1/completions", _long_request(info), stream=True)
    first_events = sse_stream(first)
    next(first_events)  # running
    second = post(srv, "/v1/completions", _long_request(info), stream=True)
    assert second.status_code == 200  # admitted: waiting behind the first
    third = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert third.status_code == 429, third.text
    assert third.headers["Retry-After"] and third.json()["error"]["type"] == "rate_limit_error"
    second.close()

    srv.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while True:  # during the drain: 503 for new work, the listener still up
        r = requests.get(srv.url + "/health", timeout=5)
        if r.status_code == 503:
            break
        assert time.monotonic() < deadline, "health never went 503 after SIGTERM"
        time.sleep(0.05)
    r = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"

    rest = list(first_events)  # the in-flight stream ends: finished or an error event, then [DONE]
    assert rest[-1] == "[DONE]"
    last = rest[-2]
    assert "error" in last or last["choices"][0]["finish_reason"] in ("stop", "length")
    assert srv.wait(timeout=30) == 0, srv.output_tail()


def test_port_in_use_fails_fast():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        proc = ServerProcess(startup_timeout=60)
        proc._spawn(s.getsockname()[1])
        try:
            assert proc.wait(timeout=60) == 1
            assert "cannot listen" in proc.stderr()
        finally:
            proc.stop(timeout=5)


def test_a_model_that_fails_to_load_exits_1(tmp_path):
    proc = ServerProcess(model=str(tmp_path / "no-such-checkpoint"), startup_timeout=60)
    proc._spawn(free_port())
    try:
        assert proc.wait(timeout=120) == 1, proc.output_tail()
        assert "failed to start" in proc.stderr() and "no-such-checkpoint" in proc.stderr()
    finally:
        proc.stop(timeout=5)


def test_a_request_id_reused_right_after_an_abort_gets_its_own_answer(server):
    """A client gives up on a long request (its connection closes while the answer is computed) and
    sends a new one with the same ``rid`` at once. The new request must get its own answer,
    never the old one's tokens or its abort (the engine keys requests by its own ticket, and ``rid``
    is only a label)."""
    want = requests.post(server.url + "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 6, "temperature": 0}}, timeout=30).json()["output_ids"]
    for i in range(10):
        rid = f"reused-{i}"
        with pytest.raises(requests.exceptions.ReadTimeout):
            requests.post(server.url + "/generate", json={"rid": rid, "input_ids": list(range(10, 300)),
                                                          "sampling_params": {"max_new_tokens": 2000,
                                                                              "ignore_eos": True}}, timeout=0.3)
        deadline = time.monotonic() + 10
        while True:
            resp = requests.post(server.url + "/generate", json={"rid": rid, "input_ids": [5, 6, 7], "sampling_params": {
                "max_new_tokens": 6, "temperature": 0}}, timeout=30)
            if resp.status_code == 400 and "already in flight" in resp.text and time.monotonic() < deadline:
                continue  # the old one has not ended yet: the id is still taken
            break
        assert resp.status_code == 200, (i, resp.status_code, resp.text)
        assert resp.json()["output_ids"] == want, (i, resp.text)


@pytest.mark.parametrize("room", ["²", "٣", "9" * 5000, str(2**63), "-1", "1e3", "0x10"])
def test_a_room_that_is_not_a_room_number_is_400(server, room):
    """``/debug/rooms/{room}`` takes a decimal number in [0, 2**63), ASCII digits only: "²" passes
    ``str.isdigit`` and 5,000 digits exceed Python's int-parsing limit; both are the client's error."""
    r = requests.get(f"{server.url}/debug/rooms/{room}", timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "room" in err["message"] and len(err["message"]) < 200
    assert requests.get(f"{server.url}/debug/rooms/{2**63 - 1}", timeout=10).status_code == 404


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"prompt": "hi \\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
     "messages[0].content"),
    ("/generate", '{"text": "x", "sampling_params": {"stop": ["\\ud800"]}}', "sampling_params.stop[0]"),
    ("/generate", '{"input_ids": [5, 6], "cache_salt": "\\ud800"}', "cache_salt"),
])
def test_a_lone_surrogate_is_400_without_a_traceback(server, path, body, param):
    """Legal JSON, not text: refused at the edge, before the tokenizer or the engine loop sees it."""
    tracebacks = server.stderr().count("Traceback")
    r = requests.post(server.url + path, data=body.encode(), headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and "surrogate" in err["message"]
    assert server.stderr().count("Traceback") == tracebacks, server.output_tail()


def test_a_tiny_temperature_answers_the_greedy_tokens(server):
    def ids(temperature):
        r = post(server, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 6, "temperature": temperature, "ignore_eos": True, "seed": 1}})
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    assert ids(1e-308) == ids(5e-324) == ids(0)


@pytest.mark.parametrize("path,field", [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")])
def test_a_prompt_that_cannot_fit_is_refused_by_its_length_before_it_is_tokenized(server, info, path, field):
    """7.6 MiB of text (just under the body cap): at least so many tokens that it cannot fit,
    known from its length alone; refused, and the worker answers the next request."""
    text = "a " * int(3.8 * (1 << 20))
    body = {"prompt": text} if field == "prompt" else {"messages": [{"role": "user", "content": text}]}
    r = post(server, path, body)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "prompt" and "at least" in err["message"] and "characters" in err["message"], err
    assert post(server, "/v1/completions", {"prompt": "next", "max_tokens": 2}).status_code == 200


def test_sigterm_while_a_prefill_loads_its_model_exits_0():
    """A prefill sent SIGTERM while its model loads exits 0, not with
    ``terminate called without an active exception`` (SIGABRT, exit -6: the interpreter finalizing
    under the thread still loading the model in native code). SIGTERM as soon as the load begins
    (its ``--dtype`` line): exit 0, no C++ terminate."""
    proc = ServerProcess("--role", "prefill", "--bootstrap-port", str(free_port())).spawn()
    try:
        deadline = time.monotonic() + 120
        while "--dtype auto" not in proc.stderr() and proc.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "--dtype auto" in proc.stderr(), proc.output_tail()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    finally:
        proc.stop()
    assert rc == 0 and "terminate called" not in proc.stderr(), (rc, proc.output_tail())
    assert "exiting" in proc.stderr(), proc.output_tail()
