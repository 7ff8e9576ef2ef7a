"""One request's own data fails that request alone, never the others on its worker.

The edge refuses bad input (``splitserve/validation/``); these tests hand the engine loop requests
that slipped past it — data no validation lets through, standing for a bug in validation or in
the engine — and check that only their own request fails, wherever the loop takes in a request's
own data: its admission (prompt, sampling parameters, stop strings, ``cache_salt``), sampling its
token (its temperature), checking its token (its stop conditions). The others finish with the
tokens they have alone, the loop counts no loop error, and every page comes back.

On a disaggregated worker the same containment goes through the room table: a request whose
admission raises after the table took its room fails through the table; one that raised before
(the table never took it) is answered by the role, its timeline ended and its record forgotten —
also when the failure escalates to ``fail_all``. Those failures are planted (``monkeypatch``, as
``sim_plants.py`` plants bugs): no request's data makes a correct role raise there.

In process, on the tiny model, the loop in its own thread as in a worker; outputs come back on an
asyncio loop in another thread.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from conftest import CACHE_DIR

from splitserve.config import EngineConfig, ServerConfig
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.engine import merge_outputs
from splitserve.engine.io import Bootstrap, GenerateRequest, SamplingParams
from splitserve.outcomes import Reason
from splitserve.models.resolve import resolve_model_dir

GOOD = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPT = tuple(range(10, 50))


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="outputs", daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


@pytest.fixture(scope="module")
def model():
    with pytest.MonkeyPatch.context() as mp:  # the tiny model the servers of the suite use, built once
        mp.setenv("SPLITSERVE_CACHE", str(CACHE_DIR))
        return resolve_model_dir("tiny")


def config(model: str) -> EngineConfig:
    return EngineConfig(model=model, page_size=16, max_total_tokens=2048)


@pytest.fixture(scope="module")
def colocated(model, loop):
    engine = AsyncEngine(config(model))
    engine.start(loop)
    yield engine
    engine.shutdown()


def run(engine: AsyncEngine, loop, reqs: list[GenerateRequest], timeout: float = 120.0) -> dict:
    """Submit ``reqs`` at once; each one's whole answer (``merge_outputs``)."""
    async def go():
        async def collect(stream):
            return merge_outputs([out async for out in stream])

        streams = [engine.submit(r) for r in reqs]
        return dict(zip((r.rid for r in reqs), await asyncio.gather(*(collect(s) for s in streams))))

    return asyncio.run_coroutine_threadsafe(go(), loop).result(timeout)


def pages_all_free(engine: AsyncEngine) -> bool:
    engine.flush_cache()
    stats = engine.stats()
    return stats.pages_free == stats.pages_total


POISONS = {  # where the loop takes each in, and what it is
    "admission: stop strings that are no strings": dict(sampling=SamplingParams(stop=5, max_tokens=8)),
    "admission: a cache_salt that is no string": dict(cache_salt=5),
    "sampling: a temperature that is no number": dict(sampling=SamplingParams(temperature="hot", max_tokens=8)),
    "token check: stop_token_ids that are no list": dict(
        sampling=SamplingParams(temperature=0.0, stop_token_ids=None, ignore_eos=True, max_tokens=8)),
}


@pytest.mark.parametrize("poison", list(POISONS))
def test_a_request_whose_own_data_raises_on_the_loop_fails_alone(colocated, loop, poison):
    alone = run(colocated, loop, [GenerateRequest(f"alone-{poison}", PROMPT, GOOD)])[f"alone-{poison}"]
    assert alone.finish_reason == "length" and len(alone.token_ids) == GOOD.max_tokens
    errors = colocated.stats().loop_errors

    reqs = [GenerateRequest(f"a-{poison}", PROMPT, GOOD),
            GenerateRequest(f"bad-{poison}", (5, 6, 7), **{"sampling": GOOD, **POISONS[poison]}),
            GenerateRequest(f"b-{poison}", PROMPT[:20], GOOD)]
    got = run(colocated, loop, reqs)
    bad = got[f"bad-{poison}"]
    assert bad.finished and bad.reason is Reason.INTERNAL_ERROR and bad.error, bad
    assert got[f"a-{poison}"].token_ids == alone.token_ids and got[f"a-{poison}"].finish_reason == "length"
    assert got[f"b-{poison}"].finish_reason == "length" and got[f"b-{poison}"].error is None
    assert colocated.stats().loop_errors == errors  # nothing escaped to fail the others
    assert pages_all_free(colocated)
    tl = colocated.timeline(rid=f"bad-{poison}")
    assert tl is not None and not tl["live"] and tl["ending"].startswith("FAILED(internal_error)"), tl


# -- a disaggregated worker: through the room table ---------------------------------------------


@pytest.fixture
def decode(model, loop):
    from splitserve.disagg.decode_role import DecodeRole
    from splitserve.disagg.lifecycle import Deadlines
    from splitserve.disagg.seams import Seams

    role = DecodeRole(ServerConfig(role="decode", transfer_backend="tcp"), Deadlines(), seams=Seams(threads=False))
    engine = AsyncEngine(config(model), role)
    engine.start(loop)
    yield engine
    engine.shutdown()


def room_request(rid: str, room: int) -> GenerateRequest:
    return GenerateRequest(rid, PROMPT, GOOD, bootstrap=Bootstrap("127.0.0.1", 1, room))


def plant(monkeypatch, where: str, rid: str) -> None:
    """The planted bug: for request ``rid`` only, the table raises as it takes the request
    (``before``: it never took the room) or decode's first step after it raises (``after``)."""
    from splitserve.disagg.decode_role import DecodeRole
    from splitserve.disagg.lifecycle import DecodeTable, RequestArrived

    if where == "before":
        handle = DecodeTable.handle

        def raising_handle(self, event, now):
            if isinstance(event, RequestArrived) and event.rid == rid:
                raise RuntimeError("planted: the table raised taking the request")
            return handle(self, event, now)

        monkeypatch.setattr(DecodeTable, "handle", raising_handle)
    else:
        arrived = DecodeRole._arrived

        def raising_arrived(self, rec, out):
            if rec is not None and rec.req.rid == rid:
                raise RuntimeError("planted: decode raised after the table took the request")
            return arrived(self, rec, out)

        monkeypatch.setattr(DecodeRole, "_arrived", raising_arrived)


async def first_output(engine: AsyncEngine, req: GenerateRequest, timeout: float = 30.0):
    stream = engine.submit(req)
    return await asyncio.wait_for(stream.__anext__(), timeout)


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_room_whose_admission_raises_fails_alone_and_leaves_nothing(decode, loop, monkeypatch, where):
    plant(monkeypatch, where, "bad")

    async def go():
        live = decode.submit(room_request("live", 1))  # waits for a prefill that never answers: stays live
        out = await first_output(decode, room_request("bad", 2))
        return live, out

    live, out = asyncio.run_coroutine_threadsafe(go(), loop).result(60)
    assert out.finished and out.reason is Reason.INTERNAL_ERROR and "planted" in out.error, out
    role = decode.role
    assert decode.stats().loop_errors == 0 and decode.stats().request_errors == 1
    assert [row["rid"] for row in decode.debug_requests()] == ["live"]  # the other room is untouched
    assert 2 not in role.rooms and "bad" not in role.room_of  # nothing of it is left
    tl = decode.timeline(rid="bad")
    assert tl is not None and not tl["live"] and tl["ending"] == "FAILED(internal_error)", tl
    decode.abort("live")
    asyncio.run_coroutine_threadsafe(live.aclose(), loop).result(10)


def test_fail_all_ends_and_forgets_a_room_the_table_never_took(decode, loop, monkeypatch):
    """If failing the one request raises too, the loop fails everything (``fail_all``): then the
    room the table never took is answered, its timeline ended and its record forgotten as well."""
    from splitserve.disagg.decode_role import DecodeRole

    plant(monkeypatch, "before", "bad")
    monkeypatch.setattr(DecodeRole, "fail_request", lambda self, rid, ending: 1 / 0)
    out = asyncio.run_coroutine_threadsafe(first_output(decode, room_request("bad", 3)), loop).result(60)
    assert out.finished and out.reason is Reason.INTERNAL_ERROR, out
    assert decode.stats().loop_errors == 1
    assert 3 not in decode.role.rooms and not decode.role.room_of
    tl = decode.timeline(rid="bad")
    assert tl is not None and not tl["live"] and tl["ending"] == "FAILED(internal_error)", tl
