"""Discovery stores chosen by ``--discovery``'s scheme (``discovery/backends.py``): the registry picks
etcd for ``etcd://`` and ``etcds://`` and refuses any other scheme at start, naming the known ones;
a store given as a parameter (an in-memory one, defined here without the seal) carries a worker's
sealed record to a router's discovery and drops a forged one; the ``--discovery-*`` flags fill the
one access config both apps hold. In-process, no etcd."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from splitserve.config import DiscoveryConfig, RouterConfig, ServerConfig
from splitserve.discovery.backends import BACKENDS, Backend, backend_for, read_values

KEY = b"r" * 32


class MemoryStore(Backend):
    """A store in this process: one value per worker id, per URL; every watcher lists at each change."""

    values: dict[str, dict[str, bytes]] = {}
    watchers: list = []
    lock = threading.Lock()

    @classmethod
    def check(cls, url, access):
        return []

    @classmethod
    def registrar(cls, url, access, record, value, ttl_s):
        return MemoryRegistrar(url, record.id, value)

    @classmethod
    def watcher(cls, url, access, read, on_records, on_outage):
        return MemoryWatcher(url, read, on_records)

    @classmethod
    def put(cls, url: str, worker_id: str, value) -> None:
        with cls.lock:
            if value is None:
                cls.values.get(url, {}).pop(worker_id, None)
            else:
                cls.values.setdefault(url, {})[worker_id] = value
            watchers = [w for w in cls.watchers if w.url == url]
        for watcher in watchers:
            watcher.list()


class MemoryRegistrar:
    def __init__(self, url, worker_id, value):
        self.url, self.worker_id, self.value = url, worker_id, value
        self.registered = threading.Event()

    def start(self):
        MemoryStore.put(self.url, self.worker_id, self.value)
        self.registered.set()
        return self

    def revoke(self):
        MemoryStore.put(self.url, self.worker_id, None)
        self.registered.clear()
        return True


class MemoryWatcher:
    def __init__(self, url, read, on_records):
        self.url, self.read, self.on_records = url, read, on_records

    def key(self, worker_id: str) -> str:
        return f"{self.url}/{worker_id}"

    def list(self) -> None:
        with MemoryStore.lock:
            listed = [(self.key(i), v) for i, v in MemoryStore.values.get(self.url, {}).items()]
        self.on_records(*read_values(listed, self.read, self.key))

    def start(self):
        MemoryStore.watchers.append(self)
        self.list()
        return self

    def stop(self):
        MemoryStore.watchers.remove(self)


WITH_MEMORY = {**BACKENDS, "memory": MemoryStore}


def test_the_scheme_picks_the_backend_and_an_unknown_one_is_refused_at_start():
    from splitserve.discovery.etcd import EtcdBackend
    from splitserve.router.app import create_app
    from splitserve.server.registration import check_discovery

    assert backend_for("etcd://h:1/p") is EtcdBackend and backend_for("etcds://h:1/p") is EtcdBackend
    assert backend_for("memory://x", WITH_MEMORY) is MemoryStore
    assert backend_for("ETCD://h:1/p") is EtcdBackend  # a scheme is case-blind, as urlsplit reads it
    for url in ("consul://h:1/p", "memory://x", "h:1/p", "etcd"):
        with pytest.raises(ValueError, match=r"--discovery: .* scheme must be one of etcd://, etcds://$"):
            backend_for(url)
    with pytest.raises(ValueError, match="etcd://, etcds://"):
        check_discovery(ServerConfig(role="decode", discovery="consul://h:1/p"))
    with pytest.raises(ValueError, match="etcd://, etcds://"):
        create_app(RouterConfig(discovery="consul://h:1/p"))
    check_discovery(ServerConfig(role="decode", discovery="memory://x", cluster_secret_file="f"), WITH_MEMORY)


def test_a_store_given_as_a_parameter_carries_a_sealed_record_to_the_router():
    """A worker's record, sealed by ``register``, reaches the router's discovery through the store
    and joins as that worker; an unsigned one put beside it is counted invalid and never joins; the
    record revoked, the worker drains."""
    from splitserve.metrics import Registry
    from splitserve.router.discovery import Discovery
    from splitserve.router.workers import WorkerSet
    from splitserve.server.registration import register

    url = "memory://cluster-a"
    config = ServerConfig(role="decode", discovery=url, advertise_host="10.0.0.7")
    worker = SimpleNamespace(config=config, worker_id="d-1", incarnation="abc", keys=SimpleNamespace(record=KEY),
                             pairing=lambda: {"bootstrap_port": None, "model_fingerprint": "m:fp",
                                              "protocol_version": 1, "transfer_backend": "nixl"})
    tasks = []
    router = SimpleNamespace(workers=WorkerSet(), checker=None, config=RouterConfig(discovery=url),
                             spawn=lambda coro: tasks.append(asyncio.ensure_future(coro)))

    async def main():
        from splitserve.discovery.signing import RecordSeal

        discovery = Discovery(router, Registry(), backends=WITH_MEMORY)
        discovery.start(asyncio.get_running_loop(), RecordSeal(KEY))
        registrar = register(worker, SimpleNamespace(addresses=[("0.0.0.0", 8123)]), tls=False, backends=WITH_MEMORY)
        sealed = MemoryStore.values[url]["d-1"]
        assert b'"hmac"' in sealed
        MemoryStore.put(url, "d-evil", sealed.replace(b"d-1", b"d-evil").replace(b"10.0.0.7", b"10.6.6.6"))
        for _ in range(100):
            await asyncio.sleep(0)
            if discovery.lists >= 3:  # at start, after the record, after the forgery
                break
        assert [(w.id, w.incarnation, w.url) for w in router.workers.all()] == [("d-1", "abc", "http://10.0.0.7:8123")]
        assert discovery.invalid == 1
        assert registrar.revoke()
        for _ in range(100):
            await asyncio.sleep(0)
            if discovery.lists >= 4:
                break
        assert [w.draining for w in router.workers.all()] == [True]
        discovery.stop()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    assert MemoryStore.watchers == []


def test_the_discovery_flags_keep_their_names_and_fill_one_access_config():
    from splitserve.cli import _config_from, build_parser, router_config_from

    flags = ["--discovery-ca-certs", "ca.pem", "--discovery-certfile", "c.pem", "--discovery-keyfile", "k.pem",
             "--discovery-user", "u", "--discovery-password-file", "pw"]
    want = DiscoveryConfig("ca.pem", "c.pem", "k.pem", "u", "pw")
    parser = build_parser()
    router = router_config_from(parser.parse_args(["router", "--discovery", "etcd://h:1/p", *flags]))
    worker = _config_from(ServerConfig, parser.parse_args(["serve", "--discovery", "etcd://h:1/p", *flags]))
    assert router.discovery_access == want and worker.discovery_access == want
    assert ServerConfig().discovery_access == RouterConfig().discovery_access == DiscoveryConfig()
