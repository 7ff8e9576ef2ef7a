"""What a client reads when the router answers a failure itself: words that say what happened, the
request id, and OpenAI's error shape with the type and code of the failure; never a worker's
address or port, nor a library's exception class or text. That detail stays in the router's log
and in the request's record (``GET /debug/requests/{rid}``, an admin route).

The router runs in this process (``create_app`` on aiohttp's test server) in front of small
worker apps in the same event loop that fail for real: a stream or a body cut off mid-answer (a
closed connection, which aiohttp reads as ``ClientPayloadError``), a port that refuses
connections, a worker that never sends its headers, a worker that is down at the first health
check.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
from typing import Optional

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from helpers.sse import sse_events
from splitserve.config import RouterConfig, WorkerAddress
from splitserve.router.app import create_app

RID = "error-text-rid-1"
CLASS_NAME = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception)\b")  # ClientPayloadError, ServerDisconnectedError...
LEAKS = ("127.0.0.1", "aiohttp", "Traceback", "http://")


def closed_port() -> int:
    """A loopback port nothing listens on (bound and released: connections to it are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cut_off(headers: dict, first: bytes):
    """A handler that sends ``headers`` and ``first``, then closes the connection mid-answer."""
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(request)
        await resp.write(first)
        await asyncio.sleep(0.1)
        request.transport.close()
        await asyncio.sleep(1)
        return resp
    return handler


# SSE headers and one event, then the stream is cut off mid-answer
break_stream = cut_off({"Content-Type": "text/event-stream"},
                       b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\n\n')
# a whole answer's headers promise 1000 bytes; 10 come
break_body = cut_off({"Content-Type": "application/json", "Content-Length": "1000"}, b'{"id": "x"')


async def silent(request: web.Request) -> web.StreamResponse:
    await asyncio.sleep(5)  # past the router's worker_header_timeout_s
    return web.json_response({})


async def drop(request: web.Request) -> web.StreamResponse:
    request.transport.close()
    await asyncio.sleep(1)
    return web.Response()


async def start_worker(behaviour, models=None) -> tuple[web.AppRunner, str]:
    """A worker app: healthy, ``behaviour`` on every generation route and on /tokenize, ``models``
    on /v1/models (by default a model list: the router asks for it when it first finds the worker
    healthy)."""
    async def health(request):
        return web.json_response({"status": "ok", "id": f"w{request.url.port}", "incarnation": "i1"})

    async def model_list(request):
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    app = web.Application()
    app.router.add_get("/health", health)
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        app.router.add_post(path, behaviour)
    app.router.add_get("/v1/models", models or model_list)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def assert_says_nothing_internal(text: str, ports: list[int]) -> None:
    assert not any(leak in text for leak in LEAKS), text
    assert not CLASS_NAME.search(text), text
    assert not any(str(port) in text for port in ports), text


def assert_in_words(error: dict, status_type: str, code: str, words: str) -> None:
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == status_type and error["code"] == code, error
    assert words in error["message"] and f"request id {RID}" in error["message"], error


async def run_router(decode_behaviour, request: dict, *, path: str = "/v1/completions", method: str = "POST",
                     split: bool = False, decode_up: bool = True, **config) -> dict:
    """One request through a router (split, else to decode alone) in front of a prefill that
    refuses connections once the router has found it healthy, and a decode worker with
    ``decode_behaviour`` (down from the start unless ``decode_up``): what the client got, the
    router's record of the request and the ports a client must not read."""
    runner, decode_url = await start_worker(decode_behaviour, decode_behaviour if path == "/v1/models" else None)
    prefill, prefill_url = await start_worker(silent)
    if not decode_up:
        await runner.cleanup()
    ports = [int(url.rsplit(":", 1)[1]) for url in (prefill_url, decode_url)]
    app = create_app(RouterConfig(prefill=(WorkerAddress(prefill_url, closed_port()),),
                                  decode=(WorkerAddress(decode_url),), pd_threshold_tokens=0 if split else 10 ** 6,
                                  **config))
    try:
        async with TestClient(TestServer(app)) as client:
            await prefill.cleanup()  # healthy at the router's first check, refusing connections now
            resp = await client.request(method, path, json=request, headers={"X-Request-Id": RID})
            got = {"status": resp.status, "text": await resp.text(), "headers": resp.headers, "ports": ports,
                   "decode_url": decode_url}
            record = await client.get(f"/debug/requests/{RID}")
            got["record"] = (await record.json()).get("router") if record.status == 200 else None
            return got
    finally:
        await runner.cleanup()


def through_router(decode_behaviour, request: Optional[dict] = None, **kwargs) -> dict:
    return asyncio.run(run_router(decode_behaviour, request or {"prompt": "Hello", "max_tokens": 4}, **kwargs))


@pytest.fixture
def router_log(caplog):
    caplog.set_level(logging.INFO, logger="splitserve.router")
    return caplog


def test_a_stream_cut_off_mid_answer_ends_with_an_error_event_in_words(router_log):
    got = through_router(break_stream, {"prompt": "Hello", "max_tokens": 4, "stream": True})
    assert got["status"] == 200 and got["headers"]["X-Request-Id"] == RID
    events = sse_events(got["text"])
    assert events[-1] == "[DONE]" and "error" in events[-2], events
    assert_in_words(events[-2]["error"], "server_error", "worker_unreachable", "the decode worker broke off the answer")
    assert_says_nothing_internal(got["text"], got["ports"])
    assert "ClientPayloadError" in got["record"]["error"] and got["decode_url"] in got["record"]["error"]
    assert f"{got['decode_url']} broke off its stream: ClientPayloadError" in router_log.text


def test_a_whole_answer_cut_off_is_a_502_in_words(router_log):
    got = through_router(break_body)
    assert got["status"] == 502 and got["headers"]["X-Request-Id"] == RID
    assert_in_words(json.loads(got["text"])["error"], "server_error", "worker_unreachable",
                    "the decode worker broke off the answer")
    assert_says_nothing_internal(got["text"], got["ports"])
    assert "ClientPayloadError" in got["record"]["error"] and got["decode_url"] in got["record"]["error"]
    assert f"{got['decode_url']} broke off its answer: ClientPayloadError" in router_log.text


def test_a_prefill_that_refuses_connections_is_a_502_in_words(router_log):
    got = through_router(silent, split=True, pd_fallback=False, max_retries=0)
    assert got["status"] == 502
    assert_in_words(json.loads(got["text"])["error"], "server_error", "worker_unreachable",
                    "the prefill worker could not be reached")
    assert_says_nothing_internal(got["text"], got["ports"])
    assert f"127.0.0.1:{got['ports'][0]}" in got["record"]["error"] and "ClientConnectorError" in router_log.text


def test_a_worker_silent_past_its_header_bound_is_a_504_in_words(router_log):
    got = through_router(silent, {"prompt": "Hello", "max_tokens": 4, "stream": True}, worker_header_timeout_s=0.3)
    assert got["status"] == 504
    assert_in_words(json.loads(got["text"])["error"], "timeout", "worker_timeout",
                    "the decode worker did not answer in time")
    assert_says_nothing_internal(got["text"], got["ports"])
    assert got["decode_url"] in got["record"]["error"]


def test_no_healthy_worker_is_a_503_that_names_no_worker(router_log):
    got = through_router(silent, decode_up=False)
    assert got["status"] == 503 and got["headers"]["Retry-After"] == "1"
    assert_in_words(json.loads(got["text"])["error"], "service_unavailable", "no_healthy_workers",
                    "no healthy decode worker is available")
    assert_says_nothing_internal(got["text"], got["ports"])
    assert f"no healthy decode worker: {got['decode_url']} (down" in router_log.text


@pytest.mark.parametrize("path, method", [("/tokenize", "POST"), ("/v1/models", "GET")])
def test_a_worker_that_drops_tokenize_or_models_is_a_502_in_words(path, method, router_log):
    got = through_router(drop, {"prompt": "Hello"}, path=path, method=method)
    assert got["status"] == 502
    error = json.loads(got["text"])["error"]
    assert error["code"] == "worker_unreachable" and f"failed to answer {path}" in error["message"], error
    assert_says_nothing_internal(got["text"], got["ports"])
    assert f"{got['decode_url']}" in router_log.text and "ServerDisconnectedError" in router_log.text
