"""What the router takes from discovery (``router/discovery.py``, ``discovery/signing.py``): only
records sealed with the cluster secret; a record's absence as evidence, not proof; an operator's
removal that sticks; nothing kept per record without a bound. The real router app runs in this
process against a real etcd of this file's own (``tests/etcd_server.py``), in front of fake
workers that record every call (``trust_fakes.py``); the bound and the one-drain-per-list rule
are checked on :meth:`Discovery.apply` with a clock of the test's. Lists are counted, never timed."""

from __future__ import annotations

import asyncio
import secrets

import pytest

from etcd_server import own_etcd
from splitserve.config import RouterConfig
from splitserve.discovery.proof import SECRET
from splitserve.discovery.signing import RecordSeal
from trust_fakes import ProvingWorker, Secret, call, running_router, until

WORKER_KEY = "wk-" + "5" * 40


@pytest.fixture(scope="module")
def etcd():
    yield from own_etcd()


def discovering(etcd, secret, prefix: str) -> RouterConfig:
    return RouterConfig(discovery=etcd.url(prefix), cluster_secret_file=secret.path, worker_api_key=WORKER_KEY,
                        health_interval_s=0.2, health_failures=1, pd_threshold_tokens=0, max_retries=0)


def put(etcd, prefix: str, worker_id: str, value: bytes) -> None:
    etcd.client().put(f"{prefix}/workers/{worker_id}", value.decode())


def ids(state, draining: bool = False) -> set:
    return {w.id for w in state.workers.all() if w.draining == draining}


async def lists_more(state, n: int) -> None:
    target = state.discovery.lists + n
    await until(f"{n} more lists", lambda: state.discovery.lists >= target)


def test_only_records_sealed_with_the_cluster_secret_are_used(etcd, tmp_path):
    """An unsigned record and one sealed with another secret, both naming a process that holds no
    key, are dropped and counted, and that process is never called; a sealed record naming it (a
    member's old record, its address now another's) is checked, and the process, which cannot
    answer the nonce, gets no call with the worker key and no prompt."""
    secret, prefix = Secret.new(tmp_path), "/only-sealed"
    seal = RecordSeal(secret.record_key)

    async def main():
        keys = {SECRET: secret.proof_key}
        p, d = await ProvingWorker("p-1", "prefill", keys).start(), await ProvingWorker("d-1", "decode", keys).start()
        evil = await ProvingWorker("d-evil", "decode").start()
        try:
            async with running_router(discovering(etcd, secret, prefix)) as (url, state):
                for w in (p, d):
                    put(etcd, prefix, w.id, seal.seal(w.record()))
                put(etcd, prefix, "d-evil", evil.record().to_json())
                put(etcd, prefix, "d-evil2", RecordSeal(b"k" * 32).seal(evil.record(id="d-evil2")))
                await until("the pair ready", state.workers.ready)
                await until("both forgeries counted", lambda: state.discovery.invalid >= 2)
                await lists_more(state, 1)
                assert ids(state) == {"p-1", "d-1"} and evil.calls == []
                put(etcd, prefix, "d-evil3", seal.seal(evil.record(id="d-evil3")))
                await until("d-evil3 checked twice", lambda: evil.calls.count(("/health", None)) >= 2)
                for n in range(4):
                    status, _ = await call("POST", url + "/generate", json={"text": f"hi {n}"})
                    assert status == 200
                assert "d-evil3" in ids(state) and not next(w for w in state.workers.all() if w.id == "d-evil3").routable
            assert state.discovery.invalid == 2
            assert evil.keyed_calls() == [] and evil.generations() == 0, evil.calls
            assert d.generations() == 4
        finally:
            for w in (p, d, evil):
                await w.stop()

    asyncio.run(main())


def test_an_etcd_that_lists_nothing_drains_no_healthy_worker(etcd, tmp_path):
    """Every record deleted at once (an etcd restored without its data): lists go by and every
    worker stays in rotation; a worker that says it is leaving, its record gone, drains at once."""
    secret, prefix = Secret.new(tmp_path), "/wiped"
    seal = RecordSeal(secret.record_key)

    async def main():
        keys = {SECRET: secret.proof_key}
        workers = [await ProvingWorker(name, name[0] == "p" and "prefill" or "decode", keys).start()
                   for name in ("p-1", "d-1", "d-2")]
        try:
            async with running_router(discovering(etcd, secret, prefix)) as (url, state):
                for w in workers:
                    put(etcd, prefix, w.id, seal.seal(w.record()))
                await until("all routable", lambda: len([w for w in state.workers.all() if w.routable]) == 3)
                etcd.client().delete_prefix(prefix + "/workers/")
                await lists_more(state, 2)
                assert len([w for w in state.workers.all() if w.routable]) == 3, [w.describe() for w in
                                                                                 state.workers.all()]
                for w in workers[:2]:  # they put their records again, as a keepalive does
                    put(etcd, prefix, w.id, seal.seal(w.record()))
                workers[2].leaving = True  # d-2 revoked its lease on its way out
                await until("d-2 draining", lambda: "d-2" not in ids(state))
                await lists_more(state, 2)
                assert ids(state) == {"p-1", "d-1"}
                status, _ = await call("POST", url + "/generate", json={"text": "hi"})
                assert status == 200
        finally:
            for w in workers:
                await w.stop()

    asyncio.run(main())


def test_a_discovered_worker_deleted_stays_removed_until_posted_again(etcd, tmp_path):
    """DELETE /workers/d-2 while its record stays, then its restart under a new incarnation with a
    new record: lists go by and it is never added again; POST /workers naming it brings it back."""
    secret, prefix = Secret.new(tmp_path), "/removed"
    seal = RecordSeal(secret.record_key)

    async def main():
        keys = {SECRET: secret.proof_key}
        workers = [await ProvingWorker(name, name[0] == "p" and "prefill" or "decode", keys).start()
                   for name in ("p-1", "d-1", "d-2")]
        d2 = workers[2]
        try:
            async with running_router(discovering(etcd, secret, prefix)) as (url, state):
                for w in workers:
                    put(etcd, prefix, w.id, seal.seal(w.record()))
                await until("all three", lambda: ids(state) == {"p-1", "d-1", "d-2"})
                status, body = await call("DELETE", url + "/workers/d-2")
                assert status == 202, body
                await lists_more(state, 2)
                assert "d-2" not in ids(state)
                d2.incarnation = secrets.token_hex(8)  # restarted
                put(etcd, prefix, d2.id, seal.seal(d2.record()))
                await lists_more(state, 2)
                assert "d-2" not in ids(state)
                before = d2.generations()
                for n in range(4):
                    assert (await call("POST", url + "/generate", json={"text": f"hi {n}"}))[0] == 200
                assert d2.generations() == before
                status, body = await call("POST", url + "/workers", json={"url": d2.url, "worker_type": "decode",
                                                                          "id": "d-2"})
                assert status == 202, body
                await until("d-2 routable again", lambda: any(w.id == "d-2" and w.routable
                                                              for w in state.workers.all()))
        finally:
            for w in workers:
                await w.stop()

    asyncio.run(main())


# -- Discovery.apply alone: its bounds and its rule for absent records --------------------------------


class FakeState:
    def __init__(self):
        from splitserve.router.workers import WorkerSet

        self.workers, self.checker, self.config = WorkerSet(), None, RouterConfig()
        self.tasks = []

    def spawn(self, coro):
        task = asyncio.ensure_future(coro)
        self.tasks.append(task)
        return task


def records(n: int):
    from splitserve.discovery.record import WorkerRecord

    return [WorkerRecord(f"d-{i}", "abc", "decode", f"http://10.0.0.{i + 1}:8000", None, "m", 1, "nixl")
            for i in range(n)]


def test_one_list_drains_at_most_one_healthy_worker_and_only_past_the_grace():
    from splitserve.metrics import Registry
    from splitserve.router.discovery import Discovery

    async def main():
        now = [0.0]
        state = FakeState()
        discovery = Discovery(state, Registry(), absent_grace_s=10, clock=lambda: now[0])
        discovery.apply(records(4))
        for w in state.workers.all():
            w.healthy = w.proven = True
        state.workers.all()[3].healthy = False  # d-3 is down
        discovery.apply([])
        assert ids(state, draining=True) == {"d-3"}  # absent and unhealthy: at once
        now[0] = 9.0
        discovery.apply([])
        assert ids(state, draining=True) == {"d-3"}
        now[0] = 10.0
        for drained in (2, 3, 4):
            discovery.apply([])
            assert len(ids(state, draining=True)) == drained
        for task in state.tasks:
            task.cancel()

    asyncio.run(main())


def test_absent_records_that_come_back_drain_nothing():
    from splitserve.metrics import Registry
    from splitserve.router.discovery import Discovery

    async def main():
        now = [0.0]
        state = FakeState()
        discovery = Discovery(state, Registry(), absent_grace_s=10, clock=lambda: now[0])
        discovery.apply(records(3))
        for w in state.workers.all():
            w.healthy = w.proven = True
        for t in (0.0, 5.0, 9.0):
            now[0] = t
            discovery.apply([])
        discovery.apply(records(3))
        now[0] = 100.0
        discovery.apply(records(3))
        assert ids(state, draining=True) == set() and discovery.absent_since == {}

    asyncio.run(main())


def test_invalid_values_and_what_is_said_are_remembered_within_a_bound():
    """2,000 keys rewritten four times with bad values: every value counted once, the memory of
    them bounded; so too what is said once per record."""
    from splitserve.metrics import Registry
    from splitserve.router.discovery import MEMORY, Discovery
    from splitserve.router.workers import Worker

    async def main():
        state = FakeState()
        discovery = Discovery(state, Registry())
        for keys, counted in ((MEMORY // 2, 4 * (MEMORY // 2)), (2000, 4 * MEMORY)):
            discovery.invalid = 0
            for rewrite in range(4):
                bad = [(f"/p/workers/k{i}", f"not json {rewrite} {'x' * 200}") for i in range(keys)]
                discovery.apply([], bad)
                discovery.apply([], bad)  # listed again: not counted again
                assert len(discovery.invalid_seen) <= MEMORY and discovery.invalid_now == keys
            assert discovery.invalid == counted
        state.workers.add(Worker("decode", "http://10.9.9.9:1", id="static"))
        for i in range(3 * MEMORY):  # records for an id already served, each a new incarnation
            rec = records(1)[0]
            discovery.apply([type(rec)("static", f"i{i}", "decode", rec.url, None, "m", 1, "nixl")])
        assert len(discovery._said) <= MEMORY

    asyncio.run(main())


def test_a_record_naming_another_incarnation_replaces_a_worker_only_once_it_is_out_of_rotation():
    """A member's old record put back (another incarnation under a serving worker's id) drains
    nothing while the worker serves; once the worker is out of rotation (a restart in place shows
    as another incarnation at its check) it drains, and the new incarnation joins at the next list."""
    from splitserve.discovery.record import WorkerRecord
    from splitserve.metrics import Registry
    from splitserve.router.discovery import Discovery

    async def main():
        state = FakeState()
        discovery = Discovery(state, Registry(), absent_grace_s=10, clock=lambda: 0.0)
        discovery.apply(records(2))
        for w in state.workers.all():
            w.healthy = w.proven = True
        old = records(2)
        other = [WorkerRecord("d-0", "fedcba", *dataclasses_tail(old[0])), old[1]]
        for _ in range(3):
            discovery.apply(other)
            assert ids(state, draining=True) == set()
            assert {w.incarnation for w in state.workers.all() if w.id == "d-0"} == {"abc"}
        state.workers.all()[0].healthy = False
        discovery.apply(other)
        discovery.apply(other)
        serving = {(w.id, w.incarnation) for w in state.workers.all() if not w.draining}
        assert serving == {("d-0", "fedcba"), ("d-1", "abc")}, serving
        for task in state.tasks:
            task.cancel()

    asyncio.run(main())


def dataclasses_tail(record) -> tuple:
    return (record.role, record.url, record.bootstrap_port, record.model, record.protocol_version,
            record.transfer_backend)


def test_a_worker_that_says_it_is_leaving_drains_once_its_record_is_gone():
    from splitserve.metrics import Registry
    from splitserve.router.discovery import Discovery

    async def main():
        state = FakeState()
        discovery = Discovery(state, Registry(), absent_grace_s=10, clock=lambda: 0.0)
        discovery.apply(records(2))
        for w in state.workers.all():
            w.healthy = w.proven = w.leaving = True
        discovery.apply(records(2))  # its record still there: it serves on
        assert ids(state, draining=True) == set()
        discovery.apply(records(2)[1:])
        assert ids(state, draining=True) == {"d-0"}
        for task in state.tasks:
            task.cancel()

    asyncio.run(main())


def test_a_record_of_an_ended_incarnation_never_replaces_a_live_worker(tmp_path):
    """A check of a worker pinned to incarnation A answered, proven, by its id as incarnation B
    marks A ended; A's sealed record put back later (from etcd's history) neither joins nor
    drains the live B, past the absent grace and any number of lists; once B is out of rotation
    the old record drains it as before (its own record comes back at its next keepalive)."""
    import aiohttp

    from splitserve.discovery.record import WorkerRecord
    from splitserve.metrics import Registry
    from splitserve.router.discovery import Discovery
    from splitserve.router.workers import DISCOVERY, HealthChecker, Worker

    secret = Secret.new(tmp_path)

    async def main():
        live = await ProvingWorker("d-0", "decode", {SECRET: secret.proof_key}).start()
        now = [0.0]
        state = FakeState()
        discovery = Discovery(state, Registry(), absent_grace_s=10, clock=lambda: now[0])
        try:
            async with aiohttp.ClientSession() as session:
                checker = HealthChecker(state.workers, session, 1.0, 3, {SECRET: secret.proof_key})
                checker.on_superseded.append(discovery.ended)
                gone = Worker("decode", live.url, id="d-0", incarnation="a0", source=DISCOVERY,
                              fixed_incarnation=True)
                await checker.check(gone)  # its address answers, proven, as another incarnation
                assert not gone.routable and ("d-0", "a0") in discovery.superseded
        finally:
            await live.stop()
        old = WorkerRecord("d-0", "a0", "decode", live.url, None, "fake:fp", 1, "nixl")
        new = WorkerRecord("d-0", live.incarnation, *dataclasses_tail(old))
        discovery.apply([new])
        worker = next(w for w in state.workers.all() if w.id == "d-0")
        worker.healthy = worker.proven = True
        for t in (0.0, 5.0, 10.0, 50.0, 100.0):
            now[0] = t
            discovery.apply([old])
            serving = {(w.id, w.incarnation) for w in state.workers.all() if not w.draining}
            assert serving == {("d-0", live.incarnation)}, (t, serving)
        worker.healthy = False
        discovery.apply([old])
        assert ids(state, draining=True) == {"d-0"} and ids(state) == set()
        for task in state.tasks:
            task.cancel()

    asyncio.run(main())


def test_a_drained_incarnation_whose_id_serves_again_as_another_never_comes_back():
    """A worker restarted the usual way (its record revoked, it drained, its new incarnation
    joined and proved itself): the old incarnation's record put back joins nothing and drains
    the new one neither, past the grace."""
    from splitserve.discovery.record import WorkerRecord
    from splitserve.metrics import Registry
    from splitserve.router.discovery import Discovery

    async def main():
        now = [0.0]
        state = FakeState()
        discovery = Discovery(state, Registry(), absent_grace_s=10, clock=lambda: now[0])
        old = records(1)[0]
        new = WorkerRecord(old.id, "b1", *dataclasses_tail(old))
        discovery.apply([old])
        state.workers.all()[0].leaving = True
        discovery.apply([])  # revoked at SIGTERM: it drains at once
        state.workers.remove(state.workers.all()[0])
        discovery.apply([new])
        joined = state.workers.all()[0]
        joined.healthy = joined.proven = True
        discovery.apply([new])
        for t in (0.0, 20.0, 100.0):
            now[0] = t
            discovery.apply([old])
            assert [(w.incarnation, w.draining) for w in state.workers.all()] == [("b1", False)]
        for task in state.tasks:
            task.cancel()

    asyncio.run(main())
