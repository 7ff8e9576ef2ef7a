"""Hostile bytes where discovery reads JSON: a value under the prefix nested thousands deep, a
value whose reading raises something no parser should, a callback that fails; ``POST /workers``
and a worker's ``/health`` answer nested as deep. Each is refused and counted; the discovery
watch goes on listing and the router answers 400, never 500. No etcd: a fake client."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from aiohttp import web

from splitserve.discovery.etcd import Target, Watcher
from splitserve.discovery.record import WorkerRecord, parse_record
from splitserve.discovery.signing import RecordSeal
from trust_fakes import ProvingWorker, call, running_router

DEEP = "[" * 2100 + "]" * 2100  # 4.2 KB: under the sealed record's bound
TARGET = Target("127.0.0.1", 1, "/p")
GOOD = WorkerRecord("d-0", "abc", "decode", "http://10.0.0.1:8000", None, "m", 1, "nixl")


class FakeEtcd:
    """A prefix listing of fixed values (key, value); no watch (the watcher relists on ``changed``)."""

    def __init__(self, values):
        self.values = values
        self.lists = 0

    def get(self, prefix, **kwargs):
        self.lists += 1
        return [(v.encode(), {"key": k.encode()}) for k, v in self.values]

    get_prefix = get

    def watch_prefix(self, prefix):
        raise ConnectionError("no watch here")


def test_json_nested_too_deep_is_a_value_error_wherever_it_is_read():
    from splitserve.discovery.record import loads_shallow

    for read in (RecordSeal().open, RecordSeal(b"k" * 32).open, loads_shallow, parse_record):
        with pytest.raises(ValueError, match="nested deeper"):
            read(DEEP if read is not parse_record else DEEP[2100 - 2000:-100])
    assert loads_shallow(b'{"a": "[[[[\\"[[", "b": [[1]]}') == {"a": '[[[["[[', "b": [[1]]}
    with pytest.raises(ValueError):  # an unclosed string of escapes: refused, in linear time
        loads_shallow('"' + '\\"' * 30000)


def run_watcher(values, on_records, read=None, lists: int = 4) -> tuple[Watcher, FakeEtcd, list]:
    etcd, outages = FakeEtcd(values), []
    watcher = Watcher(TARGET, on_records, outages.append, make_client=lambda *a: etcd, read=read)
    watcher.start()
    try:
        for _ in range(2000):
            if etcd.lists >= lists:
                break
            watcher.changed.set()
            time.sleep(0.01)
        assert watcher._thread.is_alive()
    finally:
        watcher.stop()
    assert etcd.lists >= lists, etcd.lists
    return watcher, etcd, outages


def test_a_deeply_nested_value_is_invalid_and_the_watch_goes_on():
    seen = []
    run_watcher([("/p/workers/deep", DEEP), ("/p/workers/d-0", GOOD.to_json().decode())],
                lambda records, invalid: seen.append((records, invalid)), read=RecordSeal().open)
    assert len(seen) >= 4
    records, invalid = seen[-1]
    assert records == [GOOD] and [k for k, _ in invalid] == ["/p/workers/deep"], seen[-1]


def test_whatever_reading_a_value_raises_makes_it_invalid_and_a_failing_callback_an_outage():
    def read(value):
        if b"boom" in value:
            raise RecursionError("a parser gone wrong")
        return parse_record(value)

    seen, failed = [], threading.Event()

    def on_records(records, invalid):
        if not failed.is_set():
            failed.set()
            raise RuntimeError("a bug in the callback")
        seen.append((records, invalid))

    watcher, _, outages = run_watcher([("/p/workers/x", "boom"), ("/p/workers/d-0", GOOD.to_json().decode())],
                                      on_records, read=read)
    assert outages[:2] == ["RuntimeError: a bug in the callback", None], outages
    assert watcher.unexpected == 1
    records, invalid = seen[-1]
    assert records == [GOOD] and invalid == [("/p/workers/x", "RecursionError: a parser gone wrong")]


def test_post_workers_nested_too_deep_is_a_400_and_a_deep_health_answer_a_failed_check():
    from splitserve.config import RouterConfig, WorkerAddress

    async def main():
        async def deep_health(request):
            return web.Response(text="[" * 30000 + "]" * 30000)

        deep_app = web.Application()
        deep_app.router.add_get("/health", deep_health)
        runner = web.AppRunner(deep_app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        deep_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        d = await ProvingWorker("d-1").start()
        cfg = RouterConfig(prefill=(WorkerAddress(deep_url, 8998),), decode=(WorkerAddress(d.url),),
                           health_interval_s=0.2, health_failures=1)
        try:
            async with running_router(cfg) as (url, state):
                status, body = await call("POST", url + "/workers", data=("[" * 5000 + "]" * 5000).encode(),
                                          headers={"Content-Type": "application/json"})
                assert status == 400 and "nested deeper" in body["error"]["message"], body
                deep = state.workers.prefill[0]
                await state.checker.check(deep)  # raises nothing: an answer without identity
                assert not deep.routable and "without a worker identity" in deep.last_error
        finally:
            await d.stop()
            await runner.cleanup()

    asyncio.run(main())


def test_a_list_reads_a_bounded_number_of_keys_and_junk_is_logged_sparsely(caplog):
    """3,000 junk values under the prefix: a list asks etcd for at most MAX_LISTED keys (the rest
    never crosses the network) and says so; 5,000 junk keys applied on the router log at most a
    few dozen lines while every one is counted."""
    from splitserve.discovery.etcd import MAX_LISTED
    from splitserve.metrics import Registry
    from splitserve.router.discovery import Discovery

    class Limited(FakeEtcd):
        def get(self, prefix, limit=None, **kwargs):
            return super().get(prefix)[:limit]

    seen = []
    etcd = Limited([(f"/p/workers/j{i:05}", "junk") for i in range(3000)])
    watcher = Watcher(TARGET, lambda r, i: seen.append(i), lambda why: None, make_client=lambda *a: etcd)
    watcher.start()
    try:
        for _ in range(2000):
            if seen:
                break
            time.sleep(0.01)
    finally:
        watcher.stop()
    assert len(seen[0]) == MAX_LISTED and watcher.capped >= 1

    class State:
        workers, checker = None, None

    from splitserve.router.workers import WorkerSet

    State.workers = WorkerSet()
    discovery = Discovery(State, Registry())
    with caplog.at_level("WARNING", logger="splitserve.router.discovery"):
        for rewrite in range(5):
            discovery.apply([], [(f"/p/workers/j{i}", f"junk {rewrite}") for i in range(1000)])
    assert discovery.invalid == 5000 and len(caplog.records) <= 30, len(caplog.records)
