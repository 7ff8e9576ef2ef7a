"""What the router trusts a worker with (``router/worker_trust.py``), with the real router app in
this process in front of fake workers that record every call: a worker that does not answer the
router's nonce with a proof under a key the router holds gets no call carrying the worker key and
no client's prompt; one that does gets both; a router without keys says at start what it leaves
open. No model, no etcd: cheap."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from splitserve.config import RouterConfig, WorkerAddress
from splitserve.discovery.proof import KEY, SECRET, new_nonce, prove, verify
from trust_fakes import ProvingWorker, Secret, call, running_router, until

WORKER_KEY = "wk-" + "7" * 40


def config(secret=None, *prefill, decode=(), **more) -> RouterConfig:
    return RouterConfig(prefill=tuple(WorkerAddress(w.url, 8998) for w in prefill),
                        decode=tuple(WorkerAddress(w.url) for w in decode), health_interval_s=0.2,
                        health_failures=1, pd_threshold_tokens=0, max_retries=0, pd_fallback=False,
                        cluster_secret_file=secret.path if secret else None, **more)


def by_url(state, worker) -> object:
    return next(w for w in state.workers.all() if w.url == worker.url)


def test_a_worker_that_cannot_prove_itself_gets_no_key_and_no_prompt(tmp_path):
    """Three prefills and a decode: one proves itself under the cluster secret, one under the
    worker key, one (a process that holds neither) cannot; only the last never gets a call with
    the worker key nor a prompt, and it is out of rotation saying why."""
    secret = Secret.new(tmp_path)

    async def main():
        liar = await ProvingWorker("p-liar", "prefill").start()
        by_secret = await ProvingWorker("p-secret", "prefill", {SECRET: secret.proof_key}).start()
        by_key = await ProvingWorker("p-key", "prefill", {KEY: WORKER_KEY.encode()}).start()
        decode = await ProvingWorker("d-1", "decode", {SECRET: secret.proof_key}).start()
        try:
            cfg = config(secret, liar, by_secret, by_key, decode=(decode,), worker_api_key=WORKER_KEY)
            async with running_router(cfg) as (url, state):
                await until("the honest workers routable", lambda: all(
                    by_url(state, w).routable for w in (by_secret, by_key, decode)))
                await until("the liar checked three times", lambda: liar.calls.count(("/health", None)) >= 3)
                for n in range(6):
                    status, _ = await call("POST", url + "/generate", json={"text": f"hi {n}"})
                    assert status == 200
                seen = by_url(state, liar)
                assert not seen.routable and "does not prove" in seen.last_error, seen
            assert liar.keyed_calls() == [] and liar.generations() == 0, liar.calls
            assert {p for p, _ in liar.calls} == {"/health"}, liar.calls
            assert by_secret.generations() + by_key.generations() == 6 and decode.generations() == 6
            for honest in (by_secret, by_key, decode):  # its model and pairing asked with the key
                assert {"/v1/models", "/get_server_info"} <= set(honest.keyed_calls()), honest.calls
        finally:
            for w in (liar, by_secret, by_key, decode):
                await w.stop()

    asyncio.run(main())


def test_post_workers_refuses_a_worker_that_cannot_prove_itself(tmp_path):
    secret = Secret.new(tmp_path)

    async def main():
        p = await ProvingWorker("p-1", "prefill", {SECRET: secret.proof_key}).start()
        d = await ProvingWorker("d-1", "decode", {SECRET: secret.proof_key}).start()
        liar = await ProvingWorker("d-liar", "decode", {SECRET: b"x" * 32}).start()  # another cluster's
        try:
            async with running_router(config(secret, p, decode=(d,), worker_api_key=WORKER_KEY)) as (url, state):
                status, body = await call("POST", url + "/workers", json={"url": liar.url, "worker_type": "decode"})
                assert status == 409 and body["error"]["code"] == "worker_unproven", body
                assert all(w.url != liar.url for w in state.workers.all())
            assert liar.keyed_calls() == [] and liar.generations() == 0
        finally:
            for w in (p, d, liar):
                await w.stop()

    asyncio.run(main())


def test_a_router_without_keys_says_so_at_start_and_trusts_what_answers(caplog):
    async def main():
        p, d = await ProvingWorker("p-1", "prefill").start(), await ProvingWorker("d-1", "decode").start()
        try:
            with caplog.at_level(logging.WARNING, logger="splitserve.router.app"):
                async with running_router(config(None, p, decode=(d,))) as (url, state):
                    await until("a pair ready", state.workers.ready)
            assert "cannot ask a worker to prove itself" in caplog.text
        finally:
            await p.stop()
            await d.stop()

    asyncio.run(main())


def test_a_proof_holds_for_its_nonce_and_identity_only():
    keys = {SECRET: b"s" * 32}
    nonce = new_nonce()
    proof = prove(keys, nonce, "w", "abc")
    assert verify(keys, proof, nonce, "w", "abc")
    assert not verify(keys, proof, new_nonce(), "w", "abc")  # replayed for another nonce
    assert not verify(keys, proof, nonce, "w", "abd") and not verify(keys, proof, nonce, "v", "abc")
    assert not verify({SECRET: b"t" * 32}, proof, nonce, "w", "abc")  # another cluster's
    assert not verify(keys, {KEY: proof[SECRET]}, nonce, "w", "abc")  # under a key of another name
    for bad in (None, "zz", "A" * 32, nonce + "0", 5):
        assert prove(keys, bad, "w", "abc") == {}
    for bad in (None, [], {SECRET: 5}, {SECRET: "é" * 64}):
        assert not verify(keys, bad, nonce, "w", "abc")


def test_the_worker_answers_a_nonce_under_each_key_it_holds(tmp_path):
    from splitserve.config import ServerConfig
    from splitserve.discovery.proof import NONCE_HEADER
    from splitserve.server.identity_proof import WorkerKeys, answer

    secret = Secret.new(tmp_path)
    keys = WorkerKeys.of(ServerConfig(role="decode", cluster_secret_file=secret.path, worker_api_key=WORKER_KEY))
    assert keys.record == secret.record_key and set(keys.proof) == {SECRET, KEY}
    nonce, who = new_nonce(), {"id": "d-1", "incarnation": "abc"}
    proofs = answer({NONCE_HEADER: nonce}, keys, who)["proof"]
    assert verify({SECRET: secret.proof_key}, proofs, nonce, "d-1", "abc")
    assert verify({KEY: WORKER_KEY.encode()}, proofs, nonce, "d-1", "abc")
    assert answer({}, keys, who) == {} and answer({NONCE_HEADER: nonce}, WorkerKeys(), who) == {}


def test_a_router_with_a_bad_cluster_secret_file_does_not_start(tmp_path):
    import pytest

    from splitserve.router.app import create_app

    shared = tmp_path / "shared"
    shared.write_text("ab" * 32 + "\n")
    shared.chmod(0o644)
    for path, words in ((tmp_path / "missing", "cannot read it"), (shared, "every user")):
        with pytest.raises(ValueError, match=f"--cluster-secret-file.*{words}"):
            create_app(RouterConfig(prefill=(WorkerAddress("http://127.0.0.1:1", 8998),),
                                    decode=(WorkerAddress("http://127.0.0.1:2"),), cluster_secret_file=str(path)))


def test_the_health_probe_never_carries_the_key_and_a_probe_that_times_out_unproves_at_once(tmp_path):
    """The /health probe re-proves a worker, so it never carries the worker key (whatever answers
    at a proven address gets no key by being asked); a probe that times out takes the worker out
    of rotation at once, before its failures reach health_failures, until a probe proves it again."""
    secret = Secret.new(tmp_path)

    async def main():
        p = await ProvingWorker("p-1", "prefill", {SECRET: secret.proof_key}).start()
        d = await ProvingWorker("d-1", "decode", {SECRET: secret.proof_key}).start()
        try:
            cfg = config(secret, p, decode=(d,), worker_api_key=WORKER_KEY)
            cfg = dataclasses.replace(cfg, health_failures=3)
            async with running_router(cfg) as (url, state):
                await until("both routable", lambda: by_url(state, p).routable and by_url(state, d).routable)
                await until("probes after proof", lambda: p.calls.count(("/health", None)) >= 4)
                p.stall_s = 5.0
                await until("a probe timed out", lambda: "timed out" in by_url(state, p).last_error)
                seen = by_url(state, p)
                assert not seen.proven and not seen.routable and seen.failures < 3, seen
                status, _ = await call("POST", url + "/generate", json={"text": "hi"})
                assert status != 200 and p.generations() == 0
                p.stall_s = 0.0
                await until("proven again", lambda: by_url(state, p).routable)
            for w in (p, d):
                assert "/health" not in w.keyed_calls(), w.calls
                assert "/v1/models" in w.keyed_calls()
        finally:
            for w in (p, d):
                await w.stop()

    asyncio.run(main())
